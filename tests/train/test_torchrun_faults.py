"""Faults of a real ``torchrun`` FSDP job (2 gloo processes on CPU), delivered as they happen in life:
SIGTERM to torchrun (a scheduler's stop), a worker frozen with SIGSTOP (a rank that never reaches the next
collective) and a worker killed with SIGKILL mid-step or while it writes its checkpoint shards. None may
hang: each ends within its bound with an ``error:`` line naming the rank and the cause, or with every rank
saved and exited 130; the run then resumes from its newest complete checkpoint."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
from torchrun_helpers import alive, hybridnorm, rank_of, run, start, torchrun, wait_for, workers
from train_helpers import TORCHRUN, kill_tree, read_metrics

from hybridnorm.train.checkpoint import check_checkpoint, latest_checkpoint

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch has no torch.distributed")

# 4 sequences a rank: what a fault does to the job does not depend on the batch, and a step of 16 took most of
# this file's minutes (the README's defaults are tests/train/test_torchrun_defaults.py's)
TINY = ("train", "--size", "tiny", "--parallel=fsdp", "--log_interval=5", "--batch_size=4")


@pytest.fixture(scope="module")
def kjv_cache(tmp_path_factory: pytest.TempPathFactory):
    from hybridnorm.data import prepare_data

    cache = tmp_path_factory.mktemp("kjv_cache")
    prepare_data("kjv", tokenizer="bpe", vocab_size=8192, cache_dir=cache)
    return cache


def _end(proc, timeout: float) -> float:
    """Seconds until ``proc`` (torchrun) exits; fails the test (killing it) past ``timeout``."""
    t0 = time.monotonic()
    try:
        proc.wait(timeout=timeout)
    except Exception:
        kill_tree(proc)
        pytest.fail(f"torchrun still running {timeout} s after the fault")
    return time.monotonic() - t0


def _weights(run_dir) -> dict[str, torch.Tensor]:
    from hybridnorm.loading import load_run

    return load_run(run_dir).model.state_dict()


STRAIGHT = [*TINY, "--max-steps", "60"]  # the run every interrupted one must end as, bit for bit


@pytest.fixture(scope="module")
def straight(kjv_cache, tmp_path_factory: pytest.TempPathFactory):
    """``STRAIGHT`` trained through without a fault (torchrun, 2 ranks), once for every test that compares
    with it: (its loss at each logged step, its final weights). Checkpoint intervals and async saves change
    neither (the faulted runs that use them end equal to it)."""
    ref = tmp_path_factory.mktemp("straight") / "R"
    whole = run(torchrun(*STRAIGHT, "--out", str(ref)), kjv_cache)
    assert whole.returncode == 0, whole.stderr[-3000:]
    return {r["step"]: r["loss"] for r in read_metrics(ref)}, _weights(ref)


def _steps_matching_a_straight_run(out, straight) -> list[int]:
    """Asserts that every step ``out`` logged has the straight run's loss and that ``out`` ends at its
    weights, bit for bit; returns ``out``'s logged steps."""
    losses, weights = straight
    got = read_metrics(out)
    assert all(r["loss"] == losses[r["step"]] for r in got)
    a = _weights(out)
    assert all(torch.equal(a[k], weights[k]) for k in weights)
    return [r["step"] for r in got]


@pytest.mark.parametrize("extra", [pytest.param((), id="sync"),  # async: a background save is in flight too
                                   pytest.param(("--ckpt_interval=10", "--async_checkpoint=true"), id="async")])
def test_sigterm_to_torchrun_saves_on_every_rank_exits_130_and_resumes_bitwise(extra, kjv_cache, straight,
                                                                              tmp_path):
    out, log = tmp_path / "R", tmp_path / "log"
    args = [*STRAIGHT, *extra, "--out", str(out)]
    # each worker is wrapped in a shell that records its exit status; the shell's own no-op trap lets it
    # outlive the signal torchrun sends to the whole worker process group
    inner = " ".join(f"'{a}'" for a in [sys.executable, "-m", "hybridnorm.cli", *args])
    wrapped = [*TORCHRUN, "--nproc_per_node", "2", "--no-python", "bash", "-c",
               f"trap : TERM INT; {inner}; echo $? > {tmp_path}/rc.$RANK"]
    proc = start(wrapped, kjv_cache, log)
    wait_for(log, "step 30 ", proc)
    pids = workers(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert _end(proc, 60) < 60
    assert not any(alive(p) for p in pids)
    assert [(tmp_path / f"rc.{r}").read_text().strip() for r in (0, 1)] == ["130", "130"], log.read_text()[-3000:]
    ckpt = latest_checkpoint(out / "checkpoints")
    stopped = int(ckpt.name.split("_")[1])
    assert f"stopped at step {stopped} (signal)" in log.read_text()
    check_checkpoint(ckpt)  # every file against its manifest and schema

    assert not list((out / "checkpoints").glob(".tmp_*"))  # every save published or never begun
    resumed = run(torchrun(*STRAIGHT, *extra, "--out", str(out), "--resume"), kjv_cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = _steps_matching_a_straight_run(out, straight)  # before and after
    assert steps == sorted({*range(5, stopped + 1, 5), *range(5, 61, 5)})


@pytest.mark.parametrize("killed", [0, 1])  # rank 0 also holds the run folder's lock and writes the logs
def test_torchrun_max_restarts_brings_a_killed_rank_back_and_the_run_ends_as_if_never_stopped(killed, kjv_cache,
                                                                                               straight, tmp_path):
    """torchrun's own fault tolerance (``--max-restarts``): a rank killed mid-run makes the agent restart the
    whole group with the same command, whose ``--resume`` continues from the newest complete checkpoint.
    The restarted group must meet (it failed to, on a store still holding the dead group's addresses) and
    end where a run never stopped ends, bit for bit."""
    out, log = tmp_path / "R", tmp_path / "log"
    args = [*STRAIGHT, "--ckpt_interval=20"]
    restarting = [*TORCHRUN, "--nproc_per_node", "2", "--max-restarts", "1", "-m", "hybridnorm.cli", *args,
                  "--out", str(out), "--resume"]
    proc = start(restarting, kjv_cache, log)
    wait_for(log, "step 30 ", proc)
    first = workers(proc.pid)
    os.kill(next(p for p in first if rank_of(p) == killed), signal.SIGKILL)
    _end(proc, 180)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert not any(alive(p) for p in first)
    assert f"resumed from {out / 'checkpoints'}/step_0000" in text, text[-3000:]
    assert "final: step 60," in text

    steps = _steps_matching_a_straight_run(out, straight)
    assert steps == list(range(5, 61, 5))  # the dead attempt's steps past its checkpoint dropped


def _rank_0_saw_its_peer_go(log) -> None:
    """rank 0 ends with an error line saying its peer went away, or, when torchrun (seeing rank 1 die)
    stops it a moment before its collective fails, with "interrupted:" (exit 130); never a traceback of ours."""
    lines = log.read_text().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    stopped = [line for line in lines if line.startswith("interrupted:")]
    assert (errors and "rank 0 of 2" in errors[0] and "went away" in errors[0]) or stopped, "\n".join(lines[-40:])
    assert not any("hybridnorm" in line for line in lines if line.strip().startswith("File "))


def test_a_frozen_rank_ends_the_job_at_the_timeout_with_an_error_naming_it(kjv_cache, tmp_path):
    out, log = tmp_path / "R", tmp_path / "log"
    proc = start(torchrun(*TINY, "--max-steps", "5000", "--dist_timeout=10", "--out", str(out)), kjv_cache, log)
    wait_for(log, "step 10 ", proc)  # training: past the group's start-up and its first evaluations
    pids = workers(proc.pid)
    os.kill(pids[1], signal.SIGSTOP)  # it never reaches the next collective
    try:
        assert _end(proc, 120) < 120  # 10 s timeout, then torchrun tears the frozen one down
    finally:
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
    errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
    assert errors and "rank 0 of 2" in errors[0] and "waited 10 s (dist_timeout)" in errors[0], log.read_text()[-3000:]
    assert proc.returncode != 0


def test_a_rank_killed_mid_step_ends_the_job_then_it_resumes_from_the_newest_checkpoint(kjv_cache, tmp_path):
    out, log = tmp_path / "R", tmp_path / "log"
    proc = start(torchrun(*TINY, "--max-steps", "5000", "--ckpt_interval=20", "--out", str(out)), kjv_cache, log)
    wait_for(log, "step 30 ", proc)
    os.kill(workers(proc.pid)[1], signal.SIGKILL)
    assert _end(proc, 90) < 90
    _rank_0_saw_its_peer_go(log)
    newest = latest_checkpoint(out / "checkpoints")
    check_checkpoint(newest)

    resumed = run(hybridnorm("train", "--size", "tiny", "--max-steps", str(int(newest.name[5:]) + 5), "--out",
                             str(out), "--resume"), kjv_cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {newest}" in resumed.stderr


HELD_SAVE = """
import os, runpy, sys, time
import hybridnorm.train.checkpoint.save as save

original, calls, pidfile = save.save_file, [], sys.argv[1]


def held(*args, **kwargs):  # rank 1, second checkpoint: say where it is, then never finish writing
    calls.append(1)
    if os.environ["RANK"] == "1" and save.current_dist().world_size == 2 and len(calls) > 3:
        with open(pidfile, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
    return original(*args, **kwargs)


save.save_file = held
sys.argv = ["hybridnorm", *sys.argv[2:]]
runpy.run_module("hybridnorm.cli", run_name="__main__")
"""


def test_a_rank_killed_mid_save_ends_the_job_and_the_half_written_checkpoint_is_never_used(kjv_cache, tmp_path):
    """rank 1 is SIGKILLed while it writes its shards of the second checkpoint: rank 0 (done with its own
    shards, waiting for the fsync agreement) ends with an error: it lost a rank; the first checkpoint
    is the newest, the half-written one is only a temporary folder, which the resumed run's first save clears."""
    out, log, pidfile, script = tmp_path / "R", tmp_path / "log", tmp_path / "pid", tmp_path / "held_save.py"
    script.write_text(HELD_SAVE, encoding="utf-8")
    cmd = [*TORCHRUN, "--nproc_per_node", "2", str(script), str(pidfile), *TINY, "--max-steps", "5000",
           "--ckpt_interval=20", "--out", str(out)]
    proc = start(cmd, kjv_cache, log)
    deadline = time.monotonic() + 240
    while not pidfile.is_file() or not pidfile.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc)
            pytest.fail(f"rank 1 never reached its second save:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    os.kill(int(pidfile.read_text()), signal.SIGKILL)
    assert _end(proc, 90) < 90
    _rank_0_saw_its_peer_go(log)
    newest = latest_checkpoint(out / "checkpoints")
    assert newest.name == "step_000020"  # the interrupted save of step 40 was never published
    check_checkpoint(newest)
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")]  # what the kill left

    resumed = run(hybridnorm("train", "--size", "tiny", "--max-steps", "45", "--ckpt_interval=20", "--out",
                             str(out), "--resume"), kjv_cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {newest}" in resumed.stderr
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert not [n for n in names if n.startswith(".tmp")] and "step_000040" in names, names
    check_checkpoint(out / "checkpoints" / "step_000040")


def test_a_lock_rank_0_cannot_take_fails_every_rank_at_once(kjv_cache, tmp_path):
    """rank 0 alone claims the run folder; when another trainer holds it, every rank learns so and stops
    with an error line (DDP's other ranks used to wait for rank 0 until torchrun tore them down)."""
    import subprocess

    out, log = tmp_path / "R", tmp_path / "log"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from hybridnorm.train.checkpoint.lock import "
                               "claim_run_dir\nwith claim_run_dir(sys.argv[1]):\n print('held', flush=True); "
                               "time.sleep(600)", str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = start(torchrun("train", "--size", "tiny", "--parallel=ddp", "--max-steps", "10", "--out", str(out)),
                     kjv_cache, log)
        assert _end(proc, 120) < 120
    finally:
        holder.kill()
    errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
    assert any(f"pid {holder.pid}" in e for e in errors), log.read_text()[-3000:]  # rank 0 names the holder
    # rank 1 learns it from the same all-reduce and says so, unless torchrun, seeing rank 0 exit first,
    # stopped it a moment earlier (then it exits 130): either way it never waits for a rank that left
    assert all(f"pid {holder.pid}" in e or f"rank 1 of 2: claiming out_dir={out} failed on another rank" in e
               for e in errors), errors
    frames = [line for line in log.read_text().splitlines() if line.strip().startswith("File ")]
    assert not any("hybridnorm" in f for f in frames)  # torchrun's own traceback only
