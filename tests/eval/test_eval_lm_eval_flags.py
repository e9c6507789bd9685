"""Two of lm-eval's command-line flags on ``hybridnorm eval --tasks``, each against lm-eval doing the same:
``--log-samples`` (every document's record, one JSONL file per task: == what lm-eval's own
``EvaluationTracker.save_results_samples`` writes for the same records, and read back by ``datasets``) and
``--gen-kwargs`` (== the same settings written into the task's ``generation_kwargs``)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from eval_helpers import task_folder

from hybridnorm import cli
from hybridnorm.errors import ConfigError

lm_eval = pytest.importorskip("lm_eval", reason="lm_eval is not installed: pip install 'hybridnorm[eval]'")
from hybridnorm.eval.lm_eval_adapter import run_lm_eval  # noqa: E402

MC = [{"context": "The lord said", "endings": ["unto moses", "go", "by day and by night"], "label": 1},
      {"context": "And the river", "endings": ["ran dry", "x", "was built upon a hill"], "label": 2}]
ROLL = [{"text": "the lord said unto moses and aaron"}, {"text": "behold the river ran dry " * 4}]
GEN = [{"context": "The lord said", "answer": "unto"}, {"context": "Behold", "answer": "the"},
       {"context": "And the city", "answer": "was"}]
GEN_BODY = ("output_type: generate_until\ndoc_to_text: '{{{{context}}}}'\ndoc_to_target: '{{{{answer}}}}'\n"
            "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 12\n{extra}metric_list:\n  - metric: exact_match\n")
TASKS = {
    "flag_mc": (MC, "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{endings}}'\n"
                    "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n"),
    "flag_roll": (ROLL, "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                        "metric_list:\n  - metric: word_perplexity\n"),
    "flag_gen": (GEN, GEN_BODY.format(extra="  do_sample: false\n")),
    # flag_gen with the settings --gen-kwargs gives below written into the task itself
    "flag_gen_sampled": (GEN, GEN_BODY.format(extra="  do_sample: true\n  temperature: 1.3\n")),
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return task_folder(tmp_path_factory.mktemp("flags"), TASKS)


def _jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_log_samples_writes_lm_evals_own_records_that_datasets_reads(run_dir, tasks, tmp_path, capsys):
    from datasets import load_dataset
    from lm_eval.loggers import EvaluationTracker

    names = ["flag_mc", "flag_roll", "flag_gen"]
    out = tmp_path / "res" / "r.json"
    assert cli.main(["eval", str(run_dir), "--tasks", ",".join(names), "--include-path", str(tasks),
                     "--output", str(out), "--log-samples"]) == 0
    printed = capsys.readouterr().out
    ours = {t: out.with_name(f"r_samples_{t}.jsonl") for t in names}
    assert f"samples: {', '.join(map(str, ours.values()))}" in printed
    assert "samples" not in json.loads(out.read_text(encoding="utf-8"))["lm_eval"]  # results stay aggregate
    # lm-eval's own writer on the records of the same evaluation through the library
    res = run_lm_eval(run_dir, names, include_path=tasks, log_samples=True, include_defaults=False)
    tracker = EvaluationTracker(output_path=str(tmp_path / "lm" / "x.json"))
    tracker.date_id = "d"
    for task in names:
        tracker.save_results_samples(task, copy.deepcopy(res["samples"][task]))
        theirs = _jsonl(tmp_path / "lm" / f"samples_{task}_d.jsonl")
        assert _jsonl(ours[task]) == theirs, task
        assert len(theirs) == len(TASKS[task][0])
        read = load_dataset("json", data_files=str(ours[task]), cache_dir=str(tmp_path / "hf-cache"))["train"]
        assert read.num_rows == len(theirs) and sorted(read["doc_id"]) == list(range(len(theirs)))
    replies = [r["filtered_resps"][0] for r in _jsonl(ours["flag_gen"])]
    assert all(isinstance(r, str) for r in replies) and any(replies)


def test_gen_kwargs_act_as_the_same_settings_written_into_the_task(run_dir, tasks, tmp_path):
    def replies(task, **kw):
        res = run_lm_eval(run_dir, [task], include_path=tasks, log_samples=True, include_defaults=False, seed=5,
                          **kw)
        return [s["filtered_resps"][0] for s in sorted(res["samples"][task], key=lambda s: s["doc_id"])]

    written = replies("flag_gen_sampled")
    assert replies("flag_gen", gen_kwargs="do_sample=true,temperature=1.3") == written
    assert replies("flag_gen", gen_kwargs={"do_sample": True, "temperature": 1.3}) == written
    assert replies("flag_gen") != written  # greedy: the flag changed the replies
    out = tmp_path / "r.json"  # the command line: the same replies, and the settings in the results' config
    assert cli.main(["eval", str(run_dir), "--tasks", "flag_gen", "--include-path", str(tasks), "--seed", "5",
                     "--gen-kwargs", "do_sample=true,temperature=1.3", "--output", str(out), "--log-samples"]) == 0
    assert [r["filtered_resps"][0] for r in _jsonl(tmp_path / "r_samples_flag_gen.jsonl")] == written
    assert json.loads(out.read_text(encoding="utf-8"))["lm_eval"]["config"]["gen_kwargs"] == {
        "do_sample": True, "temperature": 1.3}


@pytest.mark.parametrize(("argv", "needles"), [
    (["--tasks", "kjv_mc", "--log-samples"], ["--log-samples", "--output"]),
    (["--mc", "q.jsonl", "--log-samples", "--output", "r.json"], ["--log-samples", "only for lm-eval tasks"]),
    (["--mc", "q.jsonl", "--gen-kwargs", "temperature=1"], ["--gen-kwargs", "only for lm-eval tasks"]),
    (["--tasks", "kjv_mc", "--gen-kwargs", "do_sample=true,temperature"], ["'temperature' is not key=value"]),
    (["--tasks", "kjv_mc", "--seq-len", "5"], ["--seq-len: only for the validation loss"]),  # was: ignored
    (["--mc", "q.jsonl", "--data", "nope", "--batches", "2"], ["--data, --batches: only for the validation loss"]),
])
def test_bad_flags_are_one_error_line(run_dir, argv, needles, capsys):
    capsys.readouterr()
    assert cli.main(["eval", str(run_dir), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert all(n in err[0] for n in needles), err


def test_a_samples_file_that_cannot_be_written_is_one_error_naming_it(tmp_path):
    from hybridnorm.eval.report import write_samples

    (tmp_path / "r_samples_t.jsonl").mkdir()  # a folder where the file goes
    with pytest.raises(ConfigError, match=r"cannot write --log-samples file .*r_samples_t\.jsonl"):
        write_samples(tmp_path / "r.json", {"t": []})


@pytest.mark.parametrize("value", ["temperature=abc", "max_gen_toks=0", "top_p=5"])
def test_a_bad_gen_kwargs_value_is_refused_before_any_task_is_scored(run_dir, tasks, value, capsys, monkeypatch):
    """Before 2026-12-02 it was found at the first generation batch, after every other task had been scored."""
    from hybridnorm.eval.lm_eval_adapter import HybridNormLM

    def scored(*_a, **_k):
        raise AssertionError("a request was scored before the bad --gen-kwargs was refused")

    monkeypatch.setattr(HybridNormLM, "loglikelihood", scored)
    capsys.readouterr()
    assert cli.main(["eval", str(run_dir), "--tasks", "flag_mc,flag_gen", "--include-path", str(tasks),
                     "--gen-kwargs", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: gen_kwargs='{value}': "), err
    assert value.partition("=")[0] in err[0], err


BAD_TASKS = {  # each fails while lm-eval builds its requests; before 2026-12-02 each was a traceback (exit 1)
    "bad_field": (ROLL, "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{nosuchfield}}'\n"
                        "metric_list:\n  - metric: word_perplexity\n"),
    "bad_syntax": (ROLL, "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text'\n"
                         "metric_list:\n  - metric: word_perplexity\n"),
}


@pytest.mark.parametrize(("task", "needle"), [("bad_field", "UndefinedError"), ("bad_syntax", "TemplateSyntaxError"),
                                              ("bad_no_dataset", "bad_no_dataset")])
def test_a_task_whose_template_or_dataset_is_broken_is_one_error_line(run_dir, tmp_path, task, needle, capsys):
    folder = task_folder(tmp_path, BAD_TASKS)
    (folder / "bad_no_dataset.yaml").write_text(  # no dataset_path: lm-eval fails with a TypeError
        "task: bad_no_dataset\ntest_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n", encoding="utf-8")
    capsys.readouterr()
    assert cli.main(["eval", str(run_dir), "--tasks", task, "--include-path", str(folder), "--limit", "2"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith(("error", "Traceback"))]
    assert len(err) == 1 and err[0].startswith(f"error: lm-eval could not run {task}: ") and needle in err[0], err


def test_an_unknown_task_names_the_task_files_that_do_not_parse(run_dir, tmp_path, capsys):
    """lm-eval skips a task file that is not YAML without a word: before 2026-12-02 the task was only unknown."""
    folder = task_folder(tmp_path, {"good_roll": (ROLL, TASKS["flag_roll"][1])})
    (folder / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n", encoding="utf-8")
    (folder / "tagged.yaml").write_text("task: tagged\ncustom_dataset: !function mod.load\n", encoding="utf-8")
    capsys.readouterr()
    assert cli.main(["eval", str(run_dir), "--tasks", "broken", "--include-path", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown lm-eval task(s) 'broken'" in err[0], err
    assert f"do not parse, and lm-eval skipped them: {folder / 'broken.yaml'} (" in err[0], err
    assert "tagged.yaml" not in err[0] and "good_roll" not in err[0]  # lm-eval's tags are YAML


def test_an_unknown_task_names_the_close_ones(tasks):
    """A typo was only "unknown" before 2026-12-02 (lm-eval suggests nothing): the names nearest it now."""
    from hybridnorm.eval.lm_eval_adapter import task_manager

    with pytest.raises(ConfigError, match=r"^unknown lm-eval task\(s\) 'flag_mcq' \(did you mean 'flag_mc'[,?]"):
        task_manager(["flag_mcq"], tasks, include_defaults=False)
    with pytest.raises(ConfigError, match=r"'flag_gen_sampld', 'qqqq' \(did you mean 'flag_gen_sampld': "
                                          r"'flag_gen_sampled', 'flag_gen'\?\); looked in"):
        task_manager(["flag_roll", "flag_gen_sampld", "qqqq"], tasks, include_defaults=False)


def test_a_task_whose_metric_does_not_apply_is_named_under_the_table(run_dir, tmp_path, capsys):
    """lm-eval computes no ``acc`` for a rolling task and says nothing: an empty table and exit 0 before."""
    folder = task_folder(tmp_path, {"roll_acc": (ROLL, "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
                                                       "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: acc\n")})
    capsys.readouterr()
    assert cli.main(["eval", str(run_dir), "--tasks", "roll_acc", "--include-path", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "roll_acc: lm-eval computed no metric (does its metric_list apply to its output_type?)" in out, out


def test_a_group_without_an_aggregate_is_not_called_metricless(run_dir, tmp_path, capsys):
    """A group with no aggregate_metric_list has no score of its own in lm-eval's results: before 2026-12-02 the
    note under the table said lm-eval computed no metric for it and asked about its metric_list."""
    folder = task_folder(tmp_path, {"flag_mc": TASKS["flag_mc"]})
    (folder / "grp.yaml").write_text("group: flag_group\ntask:\n  - flag_mc\n", encoding="utf-8")
    capsys.readouterr()
    assert cli.main(["eval", str(run_dir), "--tasks", "flag_group", "--include-path", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "flag_mc" in out and "acc" in out, out
    assert "flag_group: a group without aggregate_metric_list (lm-eval scores its tasks, not it)" in out, out
    assert "computed no metric" not in out, out


def test_a_task_whose_data_file_is_not_json_is_one_error_line(run_dir, tmp_path):
    """datasets' DatasetGenerationError was a traceback (exit 1) before 2026-12-02, then one error line after
    datasets' own "Failed to load JSON" log line; now the error line alone, its cause and the file in it. A
    real process: datasets' log handler writes to the stderr it found when datasets was imported."""
    import hybridnorm

    folder = task_folder(tmp_path, {"bad_json": (ROLL, TASKS["flag_roll"][1])})
    data = tmp_path / "bad_json.jsonl"
    data.write_text('{"text": "the lord said"}\n{"text": unquoted}\n', encoding="utf-8")
    src = str(Path(hybridnorm.__file__).parents[1])  # this checkout's package, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "hybridnorm.cli", "eval", str(run_dir), "--tasks", "bad_json",
                           "--include-path", str(folder)], capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]  # datasets' progress bars: \r-separated
    assert proc.returncode == 2 and lines, proc.stderr
    assert lines[-1].startswith("error: lm-eval could not run bad_json: DatasetGenerationError: "), lines[-1]
    assert "JSON parse error" in lines[-1] and f"'{data}'" in lines[-1], lines[-1]
    assert not [ln for ln in lines[:-1] if "error" in ln.lower() or "Traceback" in ln], proc.stderr[-2000:]


def test_datasets_log_is_held_back_only_while_a_load_runs(monkeypatch):
    """A load that succeeds passes datasets' records on to its handlers, after it (its warnings say something);
    one that fails puts its error records into the exception's notes and passes the rest on."""
    import logging

    import datasets.utils.logging  # noqa: F401  (its handler in place first, as in a run)

    from hybridnorm.eval.dataset_log import datasets_log_held

    seen: list[str] = []
    keep = logging.Handler()
    keep.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    monkeypatch.setattr(logging.getLogger("datasets"), "handlers", [keep])  # the test's own handler alone
    with datasets_log_held():
        logging.getLogger("datasets.builder").warning("a warning")
        assert seen == []
    assert seen == ["a warning"] and logging.getLogger("datasets").handlers == [keep]
    with pytest.raises(ValueError, match=r"^bad") as info, datasets_log_held():
        logging.getLogger("datasets.packaged_modules.json.json").error("Failed to load JSON from file 'f'")
        logging.getLogger("datasets.builder").warning("another")
        raise ValueError("bad")
    assert seen == ["a warning", "another"], seen
    assert info.value.__notes__ == ["datasets: Failed to load JSON from file 'f'"]
