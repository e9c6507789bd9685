"""A real ``hybridnorm train`` process: SIGKILL mid-run then ``--resume`` continues from the last
checkpoint; SIGTERM / SIGINT save a checkpoint at the step reached and exit with code 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_helpers import wait_for
from train_helpers import read_metrics, tiny_overrides

from hybridnorm import cli
from hybridnorm.train.checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint

TOKENS_PER_STEP = 4 * 32


def _start(run_dir: Path, corpus: Path, cache: Path, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hybridnorm.cli", "train", *tiny_overrides(corpus, cache, run_dir),
           "--max_steps=100000", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe would block the trainer
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def test_sigkill_then_resume_continues_from_last_checkpoint(corpus, cache_dir, tmp_path, no_peak_measure):
    run, log = tmp_path / "run", tmp_path / "train.log"
    proc = _start(run, corpus, cache_dir, log, "--ckpt_interval=2")
    wait_for(proc, lambda: bool(list_checkpoints(run / "checkpoints")), log, timeout=90.0)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL

    ckpt = latest_checkpoint(run / "checkpoints")  # a half-written .tmp_step_* from the kill is ignored
    assert ckpt is not None
    verify_checkpoint(ckpt)
    ckpt_step = int(ckpt.name.split("_")[1])
    assert ckpt_step >= 2 and ckpt_step % 2 == 0
    killed = read_metrics(run)
    assert killed[-1]["step"] >= ckpt_step  # it got at least as far as its checkpoint
    kept = [r for r in killed if r["step"] <= ckpt_step]
    # as if it had died a step after its checkpoint, in the middle of writing a record
    with open(run / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"kind": "train", "step": ckpt_step + 1, "loss": -1.0}) + '\n{"kind": "tra')

    target = ckpt_step + 3
    rc = cli.main(["train", *tiny_overrides(corpus, cache_dir, run), "--ckpt_interval=2", "--resume",
                   f"--max-steps={target}"])
    assert rc == 0
    records = read_metrics(run)
    assert records[:len(kept)] == kept  # the history up to the checkpoint is kept ...
    resumed = records[len(kept):]  # ... what came after it is replaced by the resumed run's records
    assert [r["step"] for r in resumed] == list(range(ckpt_step + 1, target + 1))
    assert all(r["loss"] > 0 for r in resumed)
    assert resumed[0]["tokens"] == (ckpt_step + 1) * TOKENS_PER_STEP  # counters restored, not restarted
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert all(json.loads(line) for line in lines)  # no torn line left behind
    assert latest_checkpoint(run / "checkpoints").name == f"step_{target:06d}"
    leftover = list(run.glob("checkpoints/.tmp_*"))  # only a save the SIGKILL cut short may have left one
    assert all(p.name.endswith(f"_{proc.pid}") for p in leftover), leftover


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_checkpoint_at_current_step_and_exits_130(corpus, cache_dir, tmp_path, sig):
    run, log = tmp_path / "run", tmp_path / "train.log"
    proc = _start(run, corpus, cache_dir, log)  # ckpt_interval=1000: the only checkpoint is the signal's
    wait_for(proc, lambda: (run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= 2, log, timeout=90.0)
    proc.send_signal(sig)
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the trainer did not stop after the signal")
    output = log.read_text(errors="replace")
    assert rc == 130, output[-3000:]
    assert "Traceback" not in output
    last = read_metrics(run)[-1]["step"]
    ckpts = list_checkpoints(run / "checkpoints")
    assert [p.name for p in ckpts] == [f"step_{last:06d}"]  # saved at the step the signal landed in
    verify_checkpoint(ckpts[0])
    assert f"stopped at step {last} (signal)" in output
