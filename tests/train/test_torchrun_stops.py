"""How a real ``torchrun`` job (2 gloo processes on CPU) stops early when the reason is found on one rank only:
``--max_minutes`` (each rank times the run from its own start, and rank 0 starts later: it writes the run
folder and opens TensorBoard while the others wait at the first step) and a signal sent to one worker (a
``kill`` of its pid). The stop is agreed by every rank, and so must be its reason: before, the rank alone out
of time ran the closing evaluation alone and waited in it until ``--dist_timeout`` (then every rank failed,
rank 0 with a traceback), and a signal to rank 1 stopped rank 0 too, which exited 0 saying
"(stop_after_steps)"."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from torchrun_helpers import alive, rank_of, run, start, wait_for, workers
from train_helpers import TORCHRUN, kill_tree, read_metrics, tiny_overrides

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch has no torch.distributed")

# many short steps (far more than fit in the time), no evaluation but the one a stop makes
ENDLESS = ("--max_steps=1000000", "--eval_interval=1000000", "--log_interval=5", "--dist_timeout=20")


def test_max_minutes_stops_every_rank_with_one_evaluation_and_the_time_limit_named(corpus, cache_dir, tmp_path):
    out = tmp_path / "R"
    cmd = [*TORCHRUN, "--nproc_per_node", "2", "-m", "hybridnorm.cli", "train",
           *tiny_overrides(corpus, cache_dir, out), *ENDLESS, "--max_minutes=0.05"]
    done = run(cmd, cache_dir, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    stops = [line for line in done.stderr.splitlines() if line.startswith("stopped at step")]
    assert len(stops) == 1 and stops[0].endswith(f"(time limit); checkpoint saved in {out / 'checkpoints'}"), stops
    step = int(stops[0].split()[3])
    assert [r["step"] for r in read_metrics(out, "eval")] == [step]  # the model stopped with, scored once
    assert (out / "checkpoints" / f"step_{step:06d}").is_dir()
    assert f"final: step {step}," in done.stdout and "error:" not in done.stderr


def _python_workers(launcher_pid: int) -> list[int]:
    """The hybridnorm processes under torchrun's workers (each a shell that records its exit status)."""
    return [kid for shell in workers(launcher_pid) for kid in workers(shell)]


def test_a_signal_to_one_worker_stops_every_rank_as_a_signal(corpus, cache_dir, tmp_path):
    """``kill -TERM`` of rank 1's process alone: every rank saves the same checkpoint, names the signal and
    exits 130, as when torchrun itself is signalled (rank 0 named "stop_after_steps" and exited 0)."""
    out, log = tmp_path / "R", tmp_path / "log"
    args = [sys.executable, "-m", "hybridnorm.cli", "train", *tiny_overrides(corpus, cache_dir, out), *ENDLESS]
    inner = " ".join(f"'{a}'" for a in args)
    wrapped = [*TORCHRUN, "--nproc_per_node", "2", "--no-python", "bash", "-c",
               f"{inner}; echo $? > {tmp_path}/rc.$RANK"]
    proc = start(wrapped, cache_dir, log)
    wait_for(log, "step 10 ", proc)
    pids = _python_workers(proc.pid)
    os.kill(next(p for p in pids if rank_of(p) == 1), signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except Exception:
        kill_tree(proc)
        pytest.fail(f"torchrun still running 120 s after the signal:\n{log.read_text()[-3000:]}")
    assert not any(alive(p) for p in pids)
    text = log.read_text()
    assert [(tmp_path / f"rc.{r}").read_text().strip() for r in (0, 1)] == ["130", "130"], text[-3000:]
    stops = [line for line in text.splitlines() if line.startswith("stopped at step")]
    assert len(stops) == 1 and "(signal)" in stops[0], text[-3000:]
    step = int(stops[0].split()[3])
    assert (Path(out) / "checkpoints" / f"step_{step:06d}").is_dir()
    assert "final:" not in text and "error:" not in text


LEAVE_WORKER = """
import os, time, torch
from hybridnorm.train.distributed import init_distributed, leave
d = init_distributed(torch.device("cpu"), timeout_s=60)
if d.rank == 1:
    os._exit(0)  # gone after the last collective, before the group is left together
time.sleep(2)
try:
    leave()
except Exception as e:
    print(f"RAISED {type(e).__name__}: {e}")
"""


def test_a_rank_gone_before_the_group_is_left_is_one_collective_error(tmp_path):
    """``leave()`` (every command's last barrier under torchrun) met a peer already gone with gloo's raw
    RuntimeError, a traceback on the surviving rank where every other collective says one ``error:`` line
    (cli.main prints a CollectiveError as one)."""
    worker = tmp_path / "worker.py"
    worker.write_text(LEAVE_WORKER)
    r = run([*TORCHRUN, "--nproc_per_node", "2", str(worker)], tmp_path, timeout=120)
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("RAISED")]
    assert line.startswith("RAISED CollectiveError: rank 0 of 2: a collective failed: another rank's process went "
                           "away"), line
