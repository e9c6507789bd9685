"""``hybridnorm generate --prompt-file FILE [--batch-size N] [--output FILE.jsonl]``: many prompts, generated N at
a time as left-padded batches, one JSON record per prompt. Oracles: a greedy loop written here (each prompt
alone, the whole sequence forwarded at every step: no cache, no padding) for the completions, where they end
and why, and the token counts; the printed texts of the same prompts (sampled: the same draws)."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from bad_input_helpers import assert_refused
from train_helpers import cli_in_process

from hybridnorm.cli import main
from hybridnorm.data.tokenizer import with_start
from hybridnorm.loading import load_run

PROMPTS = ["And God said", "In the beginning God created the heaven", "Behold", "Unto thee", "For the"]
NEW = 24


def greedy_alone(source: Path, prompt: str, stops: set[int], max_new: int = NEW) -> dict:
    """The record the command should write for ``prompt``: argmax of a full forward per step, until a stop id."""
    run = load_run(source)
    row = with_start(run.tokenizer, run.tokenizer.encode(prompt))
    ids, new = torch.tensor([row]), []
    with torch.no_grad():
        for _ in range(max_new):
            token = int(run.model(ids)[0, -1, :run.model.config.vocab_size].argmax())
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if token in stops:
                break
    ended = new[-1] in stops
    return {"prompt": prompt, "completion": run.tokenizer.decode(new[:-1] if ended else new),
            "finish_reason": "stop" if ended else "length", "prompt_tokens": len(row), "completion_tokens": len(new)}


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def prompt_file(tmp_path: Path) -> Path:
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join([PROMPTS[0], "", *PROMPTS[1:3], "   ", *PROMPTS[3:]]) + "\n")  # blank lines skipped
    return f


@pytest.mark.parametrize("batch_size", ["1", "2", "16"])
def test_greedy_records_are_each_prompt_alone_in_any_batches(trained_run: Path, tmp_path: Path, batch_size) -> None:
    out = tmp_path / "out" / "completions.jsonl"  # a folder not there yet is made
    res = cli_in_process("generate", str(trained_run), "--prompt-file", str(prompt_file(tmp_path)),
                         "--temperature=0", f"--max-new-tokens={NEW}", "--batch-size", batch_size, "--output", str(out))
    assert res.stdout == f"wrote 5 completions to {out}\n"
    eot = load_run(trained_run).tokenizer.eot_id
    assert records(out) == [greedy_alone(trained_run, p, {eot}) for p in PROMPTS]


def test_a_folders_eos_ids_end_rows_as_stop_and_others_run_to_length(exported: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(exported, tmp_path / "hf")
    run = load_run(folder)
    eot = run.tokenizer.eot_id
    replies = [run.tokenizer.encode(greedy_alone(folder, p, {eot})["completion"]) for p in PROMPTS]
    # a token the greedy replies first emit at different steps, declared an eos id as transformers' generate
    # reads it, and a --max-new-tokens that ends the rows that emit it later by length
    first = [{t: r.index(t) for t in reversed(r)} for r in replies]  # token -> step it first comes at, per row
    stop, new = max(((t, max(f.get(t, NEW) for f in first)) for t in replies[0]
                     if len({f.get(t, NEW) for f in first}) > 1), key=lambda tn: tn[1])
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [eot, stop]}))
    out = tmp_path / "c.jsonl"
    cli_in_process("generate", str(folder), "--prompt-file", str(prompt_file(tmp_path)), "--temperature=0",
                   f"--max-new-tokens={new}", "--batch-size=2", "--output", str(out))
    expected = [greedy_alone(folder, p, {eot, stop}, new) for p in PROMPTS]
    assert records(out) == expected
    reasons = [r["finish_reason"] for r in expected]
    assert "stop" in reasons and "length" in reasons, reasons  # both kinds of ending are compared


@pytest.mark.parametrize("seed", ["3", "11"])
def test_sampled_records_hold_the_texts_the_command_prints(trained_run: Path, tmp_path: Path, seed: str) -> None:
    flags = ["--max-new-tokens=20", "--ignore-eos", "--seed", seed, "--temperature=1.0", "--top-k=0"]
    printed = cli_in_process("generate", str(trained_run), *[w for p in PROMPTS for w in ("--prompt", p)],
                             *flags).stdout
    out = tmp_path / "c.jsonl"
    cli_in_process("generate", str(trained_run), "--prompt-file", str(prompt_file(tmp_path)), "--output", str(out),
                   *flags)
    got = records(out)
    assert printed == "\n".join(r["prompt"] + r["completion"] + "\n" for r in got)
    assert {r["finish_reason"] for r in got} == {"length"} and {r["completion_tokens"] for r in got} == {20}
    again = tmp_path / "again.jsonl"
    cli_in_process("generate", str(trained_run), "--prompt-file", str(prompt_file(tmp_path)), "--output", str(again),
                   *flags)
    assert again.read_bytes() == out.read_bytes()


def test_jsonl_prompts_with_newlines_and_standard_input(trained_run: Path, tmp_path: Path, monkeypatch) -> None:
    prompts = ["And God said,\nLet there be", "Behold — «the» lamb", "For the"]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)) + "\n",
                 encoding="utf-8")
    flags = ["--temperature=0", "--max-new-tokens=8", "--ignore-eos"]
    out = tmp_path / "c.jsonl"
    cli_in_process("generate", str(trained_run), "--prompt-file", str(f), "--output", str(out), *flags)
    assert [r["prompt"] for r in records(out)] == prompts
    assert "«the»" in out.read_text(encoding="utf-8")  # UTF-8 as it is, not \\u escapes
    lines = "\n".join(p.replace("\n", " ") for p in prompts).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines)))
    piped = tmp_path / "piped.jsonl"
    cli_in_process("generate", str(trained_run), "--prompt-file", "-", "--output", str(piped), *flags)
    assert [r["prompt"] for r in records(piped)] == [p.replace("\n", " ") for p in prompts]
    alone = cli_in_process("generate", str(trained_run), "--prompt", prompts[1], *flags).stdout
    assert alone == prompts[1] + records(piped)[1]["completion"] + "\n"


def test_a_byte_order_mark_and_crlf_line_ends_are_not_part_of_a_prompt(trained_run: Path, tmp_path: Path) -> None:
    f = tmp_path / "windows.txt"
    f.write_bytes("\ufeffBehold\r\nFor the\u2028Lord\r\n".encode())  # U+2028 is no line end here
    out = tmp_path / "c.jsonl"
    cli_in_process("generate", str(trained_run), "--prompt-file", str(f), "--max-new-tokens=2", "--output", str(out))
    assert [r["prompt"] for r in records(out)] == ["Behold", "For the\u2028Lord"]
    assert "\u2028" not in out.read_text(encoding="utf-8")  # escaped: str.splitlines would end a line there


def test_an_interrupted_run_leaves_the_previous_output_as_it_was(trained_run: Path, tmp_path: Path, capsys,
                                                                  monkeypatch) -> None:
    from hybridnorm.nn.model import TransformerLM

    out = tmp_path / "c.jsonl"
    out.write_text("an earlier result\n")
    real, calls = TransformerLM.generate, []

    def second_batch_interrupted(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(TransformerLM, "generate", second_batch_interrupted)
    assert main(["generate", str(trained_run), "--prompt-file", str(prompt_file(tmp_path)), "--batch-size=2",
                 "--max-new-tokens=4", "--output", str(out)]) == 130
    assert "interrupted:" in capsys.readouterr().err
    assert out.read_text() == "an earlier result\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "c.jsonl", "prompts.txt"]  # no half-written file beside it


BAD_FILES = {  # name -> (content, what the one error line holds)
    "blank.txt": (b"\n  \n", ["holds no prompts"]),
    "latin1.txt": ("Behold caf\xe9\n".encode("latin-1"), ["latin1.txt is not UTF-8"]),
    "broken.jsonl": (b'{"prompt": "a"}\n{"prompt": "b"\n', ["broken.jsonl:2", "not valid JSON"]),
    "list.jsonl": (b'["a"]\n', ["list.jsonl:1", "JSON object"]),
    "field.jsonl": (b'{"text": "a"}\n', ["field.jsonl:1", "'prompt'", "'text'"]),
    "number.jsonl": (b'{"prompt": 5}\n', ["number.jsonl:1", "a int"]),
    "deep.jsonl": (b'{"prompt": "a"}\n{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", ["deep.jsonl:2"]),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_a_bad_prompt_file_is_one_error_naming_file_and_line(trained_run: Path, tmp_path: Path, capsys, name) -> None:
    content, needles = BAD_FILES[name]
    (tmp_path / name).write_bytes(content)
    out = tmp_path / "c.jsonl"
    assert_refused(["generate", str(trained_run), "--prompt-file", str(tmp_path / name), "--output", str(out)],
                   capsys, needles, tmp_path)
    assert not out.exists()


@pytest.mark.parametrize(("argv", "needles"), [
    (["--prompt-file", "{d}/nowhere.txt"], ["nowhere.txt", "cannot read"]),
    (["--prompt-file", "{d}"], ["is a folder"]),
    (["--prompt-file", "{d}/prompts.txt", "--prompt", "Behold"], ["--prompt and --prompt-file"]),
    (["--prompt-file", "{d}/prompts.txt", "--batch-size=0"], ["--batch-size=0 must be >= 1"]),
    (["--prompt-file", "{d}/prompts.txt", "--output", "{d}"], ["--output", "is a folder"]),
    (["--prompt-file", "{d}/prompts.txt", "--output", "{d}/prompts.txt"], ["is the --prompt-file", "what it reads"]),
    # the run being read: its checkpoint's weights, or any file of it (before 2026-12-02: overwritten)
    (["--output", "{run}/checkpoints/{step}/model.safetensors"], ["inside the checkpoint", "what it reads"]),
    (["--output", "{run}/completions.jsonl"], ["--output", "inside the checkpoint"]),
    (["--prompt-file", "{d}/prompts.txt", "--output", "{d}/prompts.txt/c.jsonl"], ["--output"]),
    (["--prompt-file", "{d}/long.txt", "--output", "{d}/c.jsonl"], ["long.txt:3", "max_seq_len=128"]),
])
def test_bad_options_are_refused_before_anything_is_generated(trained_run: Path, tmp_path: Path, capsys, argv,
                                                              needles) -> None:
    prompt_file(tmp_path)
    (tmp_path / "long.txt").write_text("Behold\nFor the\n" + "a" * 200 + "\nUnto\n")
    step = sorted((trained_run / "checkpoints").glob("step_*"))[-1].name
    argv = [w.replace("{d}", str(tmp_path)).replace("{run}", str(trained_run)).replace("{step}", step) for w in argv]
    weights = (trained_run / "checkpoints" / step / "model.safetensors").read_bytes()
    assert_refused(["generate", str(trained_run), *argv], capsys, needles, tmp_path)
    assert (trained_run / "checkpoints" / step / "model.safetensors").read_bytes() == weights
    assert not (trained_run / "completions.jsonl").exists()
    assert not (tmp_path / "c.jsonl").exists()
