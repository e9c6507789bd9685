"""``hybridnorm eval`` with --mc, --text and --tasks: a results table, a JSON file equal to the library's
numbers, and bad input as ONE ``error:`` line with exit code 2."""

from __future__ import annotations

import json

import pytest
from eval_helpers import write_jsonl

from hybridnorm import cli
from hybridnorm.eval import TASKS_DIR
from hybridnorm.eval.multiple_choice import evaluate_mc
from hybridnorm.eval.perplexity import perplexity

QUESTIONS = [{"context": "The lord said", "endings": ["unto moses", "go", "by day and by night"], "label": 1},
             {"context": "And the river", "endings": ["ran dry", "x", "was built upon a hill"], "label": 2}]


def _one_error_line(err: str, needles: list[str]) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_eval_mc_and_text_print_a_table_and_write_json(run_dir, model, tok, tmp_path, capsys):
    mc_file = write_jsonl(tmp_path / "questions.jsonl", QUESTIONS)
    text_file = tmp_path / "psalm.txt"
    text_file.write_text("the lord said unto moses and aaron, go forth into a land of milk and honey\n" * 3,
                         encoding="utf-8")
    out = tmp_path / "res" / "eval.json"
    argv = ["eval", str(run_dir), "--mc", str(mc_file), "--text", str(text_file), "--output", str(out),
            "--batch-size", "3"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    for needle in ("mc:questions.jsonl", "acc_norm", "text:psalm.txt", "bits_per_byte", "word_perplexity",
                   "step_000000"):
        assert needle in printed, (needle, printed)
    res = json.loads(out.read_text(encoding="utf-8"))
    mc = evaluate_mc(model, tok, mc_file)
    assert (res["mc"]["acc"], res["mc"]["acc_norm"], res["mc"]["n"]) == (mc.acc, mc.acc_norm, 2)
    assert [it["pred_norm"] for it in res["mc"]["items"]] == [r.pred_norm for r in mc.items]
    ppl = perplexity(model, tok, [text_file.read_text(encoding="utf-8")])
    assert res["text"]["bits_per_byte"] == pytest.approx(ppl.bits_per_byte, rel=1e-6)
    assert res["text"]["n_tokens"] == ppl.n_tokens


def test_an_output_that_cannot_be_written_is_refused_before_anything_is_evaluated(run_dir, tmp_path, capsys):
    """Not after the evaluation (hours, for a big task), whose results would then be lost."""
    blocker = tmp_path / "taken"
    blocker.write_text("a file where the output's folder should be", encoding="utf-8")
    mc_file = write_jsonl(tmp_path / "questions.jsonl", QUESTIONS)
    capsys.readouterr()
    assert cli.main(["eval", str(run_dir), "--mc", str(mc_file), "--output", str(blocker / "r.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "taken is a file, not a folder" in err  # no table: nothing was evaluated
    assert blocker.read_text(encoding="utf-8").startswith("a file")


def test_batch_size_auto_finds_a_size_and_scores_as_a_fixed_one(run_dir, tmp_path, capsys):
    """``--batch-size auto`` for --mc and --text: the table of the default batch size, and a note of the sizes
    found (from --max-batch-size down; the tiny model fits at once here)."""
    mc_file = write_jsonl(tmp_path / "questions.jsonl", QUESTIONS)
    text_file = tmp_path / "psalm.txt"
    text_file.write_text("the lord said unto moses and aaron, go forth into a land of milk and honey\n" * 3,
                         encoding="utf-8")
    base = ["eval", str(run_dir), "--mc", str(mc_file), "--text", str(text_file)]
    assert cli.main(base) == 0
    fixed = capsys.readouterr().out
    assert cli.main([*base, "--batch-size", "auto:2", "--max-batch-size", "5"]) == 0
    auto = capsys.readouterr().out
    # mc: 6 windows, sized twice (auto:2: the first batch, and the second, which starts past half of them);
    # text: 5 windows, one batch, sized once
    assert "batch sizes found by --batch-size auto:2: 5, 5, 5" in auto, auto
    assert [ln for ln in auto.splitlines() if "batch sizes" not in ln] == fixed.splitlines()


def test_eval_tasks_finds_the_shipped_task_from_any_directory(run_dir, model, tok, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lm_eval", reason="lm_eval is not installed: --tasks needs pip install 'hybridnorm[eval]'")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["eval", str(run_dir), "--tasks", "kjv_mc", "--limit", "5", "--output", "r.json"]) == 0
    printed = capsys.readouterr().out
    assert "kjv_mc" in printed and "acc_norm" in printed
    got = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))["lm_eval"]["results"]["kjv_mc"]
    ours = evaluate_mc(model, tok, TASKS_DIR / "kjv_mc" / "kjv_mc.jsonl", limit=5)
    assert (got["acc,none"], got["acc_norm,none"]) == pytest.approx((ours.acc, ours.acc_norm))


def test_eval_tasks_from_an_include_path(run_dir, tmp_path, capsys):
    pytest.importorskip("lm_eval", reason="lm_eval is not installed: --tasks needs pip install 'hybridnorm[eval]'")
    data = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "cli_mc.yaml").write_text(
        f"task: cli_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"  cache_dir: {tmp_path / 'hf-cache'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: context\ndoc_to_choice: endings\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n", encoding="utf-8")
    assert cli.main(["eval", str(run_dir), "--tasks", "cli_mc", "--include-path", str(tmp_path / "tasks"),
                     "--output", str(tmp_path / "r.json")]) == 0
    res = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert res["lm_eval"]["n-samples"]["cli_mc"]["effective"] == 2
    assert "cli_mc" in capsys.readouterr().out


def _bad_json(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(QUESTIONS[0]) + '\n{"context": "a", "endings": [\n', encoding="utf-8")
    return bad


def _bad_task_folder(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "broken.yaml").write_text(
        f"task: broken\ndataset_path: json\ndataset_kwargs:\n  data_files: {tmp_path / 'gone.jsonl'}\n"
        "test_split: train\noutput_type: multiple_choice\ndoc_to_text: context\ndoc_to_choice: endings\n"
        "doc_to_target: label\n", encoding="utf-8")
    return tmp_path / "t"


# name -> (extra argv builder(tmp_path), substrings of the one error line, needs lm_eval)
BAD = {
    "mc bad json": (lambda t: ["--mc", str(_bad_json(t))], ["bad.jsonl:2", "not valid JSON"], False),
    "mc missing": (lambda t: ["--mc", str(t / "none.jsonl")], ["none.jsonl"], False),
    "mc label out of range": (lambda t: ["--mc", str(write_jsonl(t / "l.jsonl", [{**QUESTIONS[0], "label": 9}]))],
                              ["l.jsonl:1", "label 9"], False),
    "text missing": (lambda t: ["--text", str(t / "none.txt")], ["none.txt", "does not exist"], False),
    # named as the option it was given as (before 2026-12-02: as training's data.source)
    "text empty": (lambda t: ["--text", str(t / "e.txt") if (t / "e.txt").write_text("") == 0 else ""],
                   ["error: --text ", "e.txt: the corpus is empty"], False),
    "include path without tasks": (lambda t: ["--include-path", str(t)], ["--include-path", "--tasks"], False),
    "limit zero": (lambda t: ["--mc", "x.jsonl", "--limit", "0"], ["--limit"], False),
    "batch size not a number": (lambda t: ["--mc", "x.jsonl", "--batch-size", "big"],
                                ["--batch-size='big'", "positive integer, 'auto' or 'auto:N'"], False),
    "batch size auto for the validation loss": (lambda t: ["--batch-size", "auto"],
                                                ["--batch-size auto", "--mc, --text and --tasks"], False),
    "max batch size without auto": (lambda t: ["--mc", "x.jsonl", "--max-batch-size", "4"],
                                    ["--max-batch-size", "--batch-size auto"], False),
    "max batch size zero": (lambda t: ["--mc", "x.jsonl", "--batch-size", "auto", "--max-batch-size", "0"],
                            ["--max-batch-size=0", ">= 1"], False),
    "output is a folder": (lambda t: ["--mc", str(write_jsonl(t / "q.jsonl", QUESTIONS)), "--output", str(t)],
                           ["--output", "is a folder", "results.json"], False),
    "output under a file": (lambda t: ["--mc", str(write_jsonl(t / "q.jsonl", QUESTIONS)), "--output",
                                       str(t / "q.jsonl" / "r.json")], ["--output", "q.jsonl is a file"], False),
    # what it reads is never written over (before 2026-12-02 each was: the questions, the run's files)
    "output is the questions": (lambda t: ["--mc", str(write_jsonl(t / "q.jsonl", QUESTIONS)), "--output",
                                           str(t / "q.jsonl")], ["--output", "is --mc", "what it reads"], False),
    "output is the text": (lambda t: ["--text", str(write_jsonl(t / "q.jsonl", QUESTIONS)), "--output",
                                      str(t / "q.jsonl")], ["--output", "is --text"], False),
    "output inside the run": (lambda t: ["--mc", str(write_jsonl(t / "q.jsonl", QUESTIONS)), "--output",
                                         "{run}/results.json"], ["--output", "inside the checkpoint"], False),
    "bad device": (lambda t: ["--mc", str(write_jsonl(t / "q.jsonl", QUESTIONS)), "--device", "gpu9"],
                   ["--device", "gpu9"], False),
    "include path missing": (lambda t: ["--tasks", "kjv_mc", "--include-path", str(t / "nowhere")],
                             ["nowhere", "not a folder"], True),
    "task data missing": (lambda t: ["--tasks", "broken", "--include-path", str(_bad_task_folder(t))],
                          ["broken", "gone.jsonl"], True),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_error_line(case, run_dir, tmp_path, capsys):
    build, needles, needs_lm_eval = BAD[case]
    if needs_lm_eval:
        pytest.importorskip("lm_eval", reason="lm_eval is not installed: --tasks needs pip install 'hybridnorm[eval]'")
    argv = [a.replace("{run}", str(run_dir)) for a in build(tmp_path)]
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert cli.main(["eval", str(run_dir), *argv]) == 2
    _one_error_line(capsys.readouterr().err, needles)
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == files  # the run is untouched


def test_without_device_eval_runs_on_the_gpu_where_one_is_visible():
    """As ``train``'s ``--device auto`` and lm-eval's HF backend: a GPU machine evaluates on its GPU unless
    told otherwise; a machine without one on the CPU, where the run loads (None: the model is not moved)."""
    import torch

    from hybridnorm.loading import inference_device

    assert inference_device(None) == (torch.device("cuda") if torch.cuda.is_available() else None)
    assert inference_device("cpu") == torch.device("cpu")


def test_a_run_folder_and_a_text_file_with_brackets_are_printed_as_they_are(run_dir, tmp_path, capsys):
    """The header (the checkpoint's path), the table's task names and the notes were printed as rich markup:
    a run folder under 'x[/y]' ended eval with a MarkupError traceback after the evaluation had run (no JSON
    written), and a file named 't[red].txt' was printed as a red 't.txt'."""
    import shutil

    run = tmp_path / "x[" / "y]" / "run[v2]"
    shutil.copytree(run_dir, run)
    text_file = tmp_path / "t[red].txt"
    text_file.write_text("the lord said [b]unto[/b] moses\n", encoding="utf-8")
    out = tmp_path / "eval.json"
    assert cli.main(["eval", str(run), "--text", str(text_file), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(run / "checkpoints") in printed and "text:t[red].txt" in printed, printed
    assert json.loads(out.read_text(encoding="utf-8"))["text"]["n_docs"] == 1
