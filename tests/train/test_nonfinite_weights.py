"""The end of a step. A learning rate so large that one update leaves the weights non-finite while its loss and
gradient were finite: the run stops as diverged before it saves that state (before 2026-12-02 it saved the
checkpoint, whose weights every later load refused, and a run whose last step did so exited 0 with val loss
nan). A time limit reached at the last step: one final eval."""

from __future__ import annotations

import json
from pathlib import Path

from train_helpers import cli_in_process, read_metrics, tiny_overrides

from hybridnorm.train.checkpoint import list_checkpoints


def test_an_update_that_makes_the_weights_nonfinite_is_diverged_and_never_saved(tmp_path: Path, corpus: Path,
                                                                                cache_dir: Path) -> None:
    run = tmp_path / "run"
    r = cli_in_process("train", *tiny_overrides(corpus, cache_dir, run), "--max_steps=3", "--ckpt_interval=1",
                       "--optim.lr=1e300", "--optim.grad_clip=0", "--optim.warmup_steps=0", ok=False)
    assert r.returncode == 3, r.stderr  # EXIT_DIVERGED
    first = read_metrics(run)[0]
    assert first["step"] == 1 and first["grad_norm"] < float("inf")  # the step itself was finite
    report = json.loads((run / "divergence.json").read_text(encoding="utf-8"))
    assert report["step"] == 1 and report["first_nonfinite_param"] is not None
    assert "non-finite weights after the update at step 1" in r.stdout + r.stderr
    assert list_checkpoints(run / "checkpoints") == []  # no checkpoint of the poisoned state


def test_a_time_limit_reached_at_the_last_step_evaluates_once(tmp_path: Path, corpus: Path, cache_dir: Path) -> None:
    """The last step is an eval step whatever eval_interval says; a time limit reached there added a second,
    identical eval record before 2026-12-02."""
    run = tmp_path / "run"
    cli_in_process("train", *tiny_overrides(corpus, cache_dir, run), "--max_steps=1", "--eval_interval=1000",
                   "--max_minutes=1e-9")
    assert [r["step"] for r in read_metrics(run, "eval")] == [1]  # the last step, out of time there too: once
