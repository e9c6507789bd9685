"""``compare`` and ``sweep`` under the real ``torchrun`` (2 gloo processes): each run of the grid trains on both
ranks and rank 0 alone writes and prints, so the grid equals the one a single process makes with the same
global batch. Every other command runs in one process and is refused under torchrun before it writes
anything (before, ``export`` ran once per rank: one rank wrote the folder, the other failed on it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchrun_helpers import hybridnorm, run, torchrun

from hybridnorm.cli import ONE_PROCESS_COMMANDS, main

needs_torchrun = pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch has no torch.distributed")


def _compare(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["compare", "--placements", "pre,post", "--size", "tiny", "--max-steps", "4", "--seeds", "0",
            "--out", str(out), f"--data.source={corpus}", "--data.tokenizer=bytes", "--seq_len=32",
            "--batch_size=4", "--eval_batches=2", "--device=cpu", *extra]


def _refusal(stderr: str, text: str) -> None:
    """Each rank that got to speak printed this one error line and nothing else of ours. One line or two:
    torchrun stops the other worker as soon as one exits, which can be before that worker prints (seen under
    load), so two lines is not a property of ours to assert."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert 1 <= len(errors) <= 2 and all(e.startswith(f"error: {text}") for e in errors), stderr[-3000:]
    assert "hybridnorm/" not in stderr  # no traceback of ours (torchrun prints its own summary)


def _runs(out: Path) -> dict[str, dict]:
    return {r["placement"]: r for r in json.loads((out / "runs.json").read_text())["runs"]}


@needs_torchrun
def test_compare_under_torchrun_trains_each_run_on_both_ranks_and_reports_once(corpus, cache_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    single = run(hybridnorm(*_compare(corpus, one, "--global_batch=4")), cache_dir)
    assert single.returncode == 0, single.stderr[-3000:]
    ranks = run(torchrun(*_compare(corpus, two, "--global_batch=4")), cache_dir)
    assert ranks.returncode == 0, ranks.stderr[-3000:]

    # rank 0 alone speaks: each grid line and the report line once
    assert ranks.stdout.count("report: ") == 1
    for line in ("[grid] 1/2 pre-init=megatron-seed0", "[grid] 2/2 post-init=megatron-seed0",
                 "[grid] precision auto", "[grid] post-init=megatron-seed0: "):
        assert ranks.stderr.count(line) == 1, line
    assert "(one at a time, each on all 2 processes)" in ranks.stderr

    a, b = _runs(one), _runs(two)
    for placement in ("pre", "post"):
        assert b[placement]["hardware"]["processes"] == 2 and a[placement]["hardware"]["processes"] == 1
        assert b[placement]["tokens_seen"] == a[placement]["tokens_seen"] == 4 * 4 * 32
        assert b[placement]["final_val_loss"] == pytest.approx(a[placement]["final_val_loss"], abs=1e-5)
        assert b[placement]["final_train_loss"] == pytest.approx(a[placement]["final_train_loss"], abs=1e-5)
        assert json.loads((two / "runs" / f"{placement}-init=megatron-seed0" / "done.json").read_text()) == \
            {"step": 4, "diverged": False}
    assert "Hardware that ran them: 2 × cpu" in (two / "summary.md").read_text()

    # the same command again finds the grid done, on both ranks (no rank trains a run the other skips)
    again = run(torchrun(*_compare(corpus, two, "--global_batch=4")), cache_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[grid] 2 runs, 2 already done, 0 to train" in again.stderr


@needs_torchrun
def test_jobs_under_torchrun_and_one_process_commands_are_refused_before_writing(corpus, cache_dir, tmp_path):
    out = tmp_path / "grid"
    jobs = run(torchrun(*_compare(corpus, out, "--jobs", "2")), cache_dir)
    assert jobs.returncode != 0 and not out.exists()
    _refusal(jobs.stderr, "--jobs=2 under torchrun: each run of the grid already trains on all 2")
    fsdp = run(torchrun(*_compare(corpus, out, "--parallel=fsdp")), cache_dir)
    assert fsdp.returncode != 0 and not out.exists()
    _refusal(fsdp.stderr, "parallel='fsdp' in a grid: its verdicts and depth plots need per-layer")

    # refused before the run is read (so none need exist): every one-process command, in-process, below (rank 1's
    # refusal too, which torchrun may stop before it prints)
    export = run(torchrun("export", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")), cache_dir)
    assert export.returncode != 0 and not (tmp_path / "hf").exists()
    _refusal(export.stderr, "hybridnorm export runs in one process, but torchrun started 2")


@pytest.mark.parametrize("command", ONE_PROCESS_COMMANDS)
def test_every_one_process_command_is_refused_in_a_multi_process_world(command, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.chdir(tmp_path)
    assert main([command, "x", "--out", "y"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: hybridnorm {command} runs in one process, but torchrun started 2 (WORLD_SIZE=2), "
                   "which would each run it and write the same files; run it without torchrun (train, compare, "
                   "sweep and eval are the commands that use several processes)"]
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun with one process: every command runs
    assert main(["placements"]) == 0
    monkeypatch.setenv("WORLD_SIZE", "2")  # a WORLD_SIZE a job script exported, with no rank: not torchrun's
    monkeypatch.delenv("RANK")
    assert main(["placements"]) == 0
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert main(["placements"]) == 0
