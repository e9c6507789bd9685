"""Running the real command line under the real ``torchrun`` (2 gloo processes on CPU) for the multi-process
tests: launch, wait for a log line, find the worker processes, and read TensorBoard's own view of a run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import TORCHRUN, kill_tree, run_bounded


def env(cache: Path) -> dict[str, str]:
    """The environment of a README command: the default data (kjv, BPE) prepared into ``cache``."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDNORM_CACHE": str(cache)}


def torchrun(*args: str) -> list[str]:
    return [*TORCHRUN, "--nproc_per_node", "2", "-m", "hybridnorm.cli", *args]


def hybridnorm(*args: str) -> list[str]:
    return [sys.executable, "-m", "hybridnorm.cli", *args]


def run(cmd: list[str], cache: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_bounded(cmd, timeout, env=env(cache))  # a hang kills torchrun's workers too


def start(cmd: list[str], cache: Path, log: Path) -> subprocess.Popen:
    """``cmd`` in the background, its stdout and stderr into ``log``."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(cache))


def wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc)
            pytest.fail(f"{text!r} never appeared (rc {proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def workers(launcher_pid: int) -> list[int]:
    """The worker processes torchrun started (its children), by pid."""
    kids: list[int] = []
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        kids += [int(p) for p in (task / "children").read_text().split()]
    return sorted(kids)


def rank_of(pid: int) -> int:
    """The global rank torchrun gave worker ``pid`` (its RANK variable)."""
    env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
    return int(env["RANK"])


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0]
    except FileNotFoundError:
        return False
    return state != "Z"


def tensorboard_steps(run_dir: Path, tag: str) -> list[int]:
    """The steps TensorBoard itself shows for ``tag`` (its reader applies purge_step and out-of-order purges)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []
