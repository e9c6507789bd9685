"""What the ranks of a real ``torchrun`` job must see alike (hybridnorm/train/shared_folders.py), with
the faults of real clusters: two "machines" (two torchrun agents meeting through a c10d rendezvous on
localhost, one process each) whose ``--out R`` is two different folders, as on machine-local disks (each
agent in its own working directory), or one shared folder; and a corpus that takes longer to prepare than
``--dist_timeout``, on a rank that is only busy, frozen, or failing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torchrun_helpers import env, torchrun
from train_helpers import TORCHRUN, kill_tree, read_metrics, run_bounded

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch has no torch.distributed")

TINY = ("train", "--size", "tiny")


@pytest.fixture(scope="module")
def kjv_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hybridnorm.data import prepare_data

    cache = tmp_path_factory.mktemp("kjv_cache")
    prepare_data("kjv", tokenizer="bpe", vocab_size=8192, cache_dir=cache)
    return cache


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_machines(args: list[str], cwds: list[Path], caches: list[Path], timeout: float = 180) -> list[str]:
    """Two torchrun agents, one process each, meeting at a c10d rendezvous on localhost as two machines'
    agents meet; each runs in its own working directory with its own data cache (or a shared one). Returns
    each agent's output (both must end)."""
    port, run_id = _free_port(), f"job{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", run_id,
           "-m", "hybridnorm.cli", *args]
    procs = [subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env(cache)) for cwd, cache in zip(cwds, caches, strict=True)]
    deadline, outs = time.monotonic() + timeout, []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"two-machine job still running after {timeout} s: {' '.join(args)}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)
    return [f"[rc {p.returncode}]\n{out}" for p, out in zip(procs, outs, strict=True)]


def _errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def _no_traceback_of_ours(out: str) -> None:
    assert not [line for line in out.splitlines() if line.strip().startswith("File ") and "hybridnorm" in line], out


def test_two_machines_whose_out_is_not_one_folder_stop_before_training_naming_the_rank(kjv_cache, tmp_path):
    """``--out R`` on two machine-local disks: it once trained to its first checkpoint and failed writing
    it (FSDP), and a resume let each rank pick its own checkpoint (gloo aborted the mismatched job)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    t0 = time.monotonic()
    outs = _two_machines([*TINY, "--parallel=fsdp", "--out", "R"], [a, b], [kjv_cache, kjv_cache])
    assert time.monotonic() - t0 < 120
    for out in outs:
        assert out.startswith("[rc 1]"), out[-3000:]
        errors = _errors(out)
        assert len(errors) == 1, out[-3000:]
        assert "does not see the run folder rank 0 holds" in errors[0] and "storage every machine" in errors[0]
        assert "\nstep " not in out  # nothing trained
        _no_traceback_of_ours(out)
    # the rank that did not see it names its own copy's path: the other machine's folder
    assert any(f"{b / 'R' / 'train.lock'} is missing here" in e or f"{a / 'R' / 'train.lock'} is missing here" in e
               for out in outs for e in _errors(out))
    assert not list(tmp_path.glob("*/R/checkpoints/*"))


def test_two_machines_sharing_the_run_folder_stop_and_resume_as_one_machine_trains(kjv_cache, tmp_path):
    """One shared ``--out`` (an absolute path, as on a network file system) and a data cache of each machine's
    own (the second one starts empty: its rank prepares the data itself): FSDP over two machines stops at
    step 3 and resumes to 6 with each rank's shards, and logs the losses of two processes on one machine
    training 6 steps straight (the same ranks and sums; the thread counts may differ, so not bit for bit)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    out, ref = tmp_path / "shared" / "R", tmp_path / "ref"
    common = [*TINY, "--parallel=fsdp", "--max-steps", "6", "--ckpt_interval=3", "--log_interval=1",
              "--eval_interval=1000"]
    for extra in (["--stop_after_steps=3"], ["--resume"]):
        outs = _two_machines([*common, *extra, "--out", str(out)], [a, b], [kjv_cache, tmp_path / "cache_b"])
        assert all(o.startswith("[rc 0]") for o in outs), "\n".join(o[-2000:] for o in outs)
    assert any(f"resumed from {out / 'checkpoints' / 'step_000003'}" in o for o in outs)
    shards = sorted(p.name for p in (out / "checkpoints" / "step_000006").glob("model-r*.safetensors"))
    assert shards == ["model-r00000.safetensors", "model-r00001.safetensors"]
    one = run_bounded(torchrun(*common, "--out", str(ref)), 300, env=env(kjv_cache))
    assert one.returncode == 0, one.stderr[-3000:]
    got, want = ([(m["step"], m["loss"]) for m in read_metrics(r)] for r in (out, ref))
    assert [s for s, _ in got] == [s for s, _ in want] == [1, 2, 3, 4, 5, 6]
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], rel=1e-5, abs=0)


def test_machines_whose_copies_of_the_corpus_differ_stop_before_training(kjv_cache, tmp_path):
    """``--data.source=corpus.txt`` read on each machine from its own disk, the copies not the same (and no
    shared data cache): the ranks would train on other tokens; the job stops, naming both."""
    for name, lines in (("a", 300), ("b", 310)):
        (tmp_path / name).mkdir()
        text = "\n\n".join(f"and the lord spake unto moses, saying {i}" for i in range(lines))
        (tmp_path / name / "corpus.txt").write_text(text, encoding="utf-8")
    args = [*TINY, "--data.source=corpus.txt", "--data.tokenizer=bytes", "--out", str(tmp_path / "R")]
    outs = _two_machines(args, [tmp_path / "a", tmp_path / "b"], [tmp_path / "cache_a", tmp_path / "cache_b"])
    errors = [e for out in outs for e in _errors(out)]
    assert all(out.startswith("[rc 1]") and "\nstep " not in out for out in outs), "\n".join(outs)
    assert len(errors) == 2 and all("prepared other data than rank 0" in e for e in errors), errors
    assert any(e.startswith("error: rank 0 of 2: comparing its data with rank 0's failed on rank 1") for e in errors)
    for out in outs:
        _no_traceback_of_ours(out)


SLOW_PREPARE = """
import os, runpy, sys, time
from hybridnorm.errors import ConfigError
from hybridnorm.train.config import DataConfig

original, mode, pidfile = DataConfig.prepare, sys.argv[1], sys.argv[2]


def prepare(self):  # rank 0's preparation: slow (a big corpus), frozen mid-way, or failing
    if os.environ["RANK"] == "0":
        with open(pidfile, "w") as f:
            f.write(str(os.getpid()))
        if mode in ("fail", "slow_fail"):
            time.sleep(8 if mode == "slow_fail" else 0)  # slow: the waiting rank polls seconds apart by then
            raise ConfigError("data.source=corpus.txt: line 7 is not UTF-8 (a fault this test sets)")
        time.sleep(12 if mode == "slow" else 600)
    return original(self)


DataConfig.prepare = prepare
sys.argv = ["hybridnorm", *sys.argv[3:]]
runpy.run_module("hybridnorm.cli", run_name="__main__")
"""


def _slow_prepare(tmp_path: Path, mode: str, *args: str) -> tuple[list[str], Path]:
    script, pidfile = tmp_path / "slow_prepare.py", tmp_path / "pid"
    script.write_text(SLOW_PREPARE, encoding="utf-8")
    return [*TORCHRUN, "--nproc_per_node", "2", str(script), mode, str(pidfile), *args], pidfile


def test_data_that_takes_longer_than_dist_timeout_to_prepare_trains(kjv_cache, tmp_path):
    """Rank 0 busy preparing for 12 s, the others waiting, ``--dist_timeout=5``: the wait is bounded by
    rank 0's liveness, not by the timeout (it was: "waited 5 s for another rank, which is stuck")."""
    cmd, _ = _slow_prepare(tmp_path, "slow", *TINY, "--max-steps", "2", "--dist_timeout=5", "--out",
                           str(tmp_path / "R"))
    done = run_bounded(cmd, 300, env=env(kjv_cache))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("final: step 2,") == 1


def test_a_rank_frozen_while_preparing_the_data_ends_the_job_at_the_timeout_naming_it(kjv_cache, tmp_path):
    log = tmp_path / "log"
    cmd, pidfile = _slow_prepare(tmp_path, "freeze", *TINY, "--max-steps", "2", "--dist_timeout=5", "--out",
                                 str(tmp_path / "R"))
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(kjv_cache))
    frozen = None
    try:
        deadline = time.monotonic() + 120
        while not (pidfile.is_file() and pidfile.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        frozen = int(pidfile.read_text())
        os.kill(frozen, signal.SIGSTOP)
        t0 = time.monotonic()
        while not _errors(log.read_text()):  # then torchrun takes its own time to tear the frozen one down
            assert proc.poll() is None and time.monotonic() - t0 < 60, log.read_text()[-3000:]
            time.sleep(0.2)
        assert time.monotonic() - t0 < 30  # 5 s without a heartbeat, and the rank's exit
    finally:
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGKILL)
        kill_tree(proc)
    errors = _errors(log.read_text())
    assert errors and "rank 1 of 2" in errors[0] and "waited 5 s (dist_timeout) for rank 0 preparing the data" \
        in errors[0], log.read_text()[-3000:]


@pytest.mark.parametrize("mode", ["fail", "slow_fail"])
def test_a_failure_preparing_the_data_on_rank_0_is_one_error_on_every_rank(kjv_cache, tmp_path, mode):
    """Also after a slow start (slow_fail), when the waiting rank sleeps seconds between its reads: rank 0
    once left at once, torchrun stopped rank 1 in its sleep, and rank 1 printed no error."""
    cmd, _ = _slow_prepare(tmp_path, mode, *TINY, "--max-steps", "2", "--out", str(tmp_path / "R"))
    done = run_bounded(cmd, 300, env=env(kjv_cache))
    assert done.returncode != 0
    errors = _errors(done.stderr)
    assert len(errors) == 2, done.stderr[-3000:]
    assert all("line 7 is not UTF-8" in e for e in errors)
    assert any(e.startswith("error: rank 1 of 2: preparing the data failed on rank 0: ") for e in errors)
    _no_traceback_of_ours(done.stderr)


def test_mfu_of_a_torchrun_job_is_against_every_process_peak(kjv_cache, tmp_path):
    """tokens/s counts both processes' tokens, so the peak is both processes' (on a CPU each measured at its
    own thread count): a CPU job once divided by one process's peak and read twice its MFU. The per-machine
    peak cache is filled here with known values (a peak per thread count), so nothing is timed."""
    from hybridnorm.loading import load_run
    from hybridnorm.train.flops import PEAK_SAMPLES, flops_per_token, machine_key

    threads, peaks = torch.get_num_threads(), {}
    try:
        for t in range(1, (os.cpu_count() or 1) + 1):
            torch.set_num_threads(t)
            peaks[machine_key("cpu", torch.float32)] = [1e10 * t] * PEAK_SAMPLES  # full: nothing measured
    finally:
        torch.set_num_threads(threads)
    cache = tmp_path / "peaks.json"
    cache.write_text(json.dumps(peaks), encoding="utf-8")
    out = tmp_path / "R"
    done = run_bounded(torchrun(*TINY, "--max-steps", "4", "--log_interval=2", "--precision=fp32", "--out", str(out)),
                       300, env={**env(kjv_cache), "HYBRIDNORM_PEAK_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr[-3000:]
    meta = read_metrics(out, "meta")[-1]
    per_process = 1e10 * meta["hardware"]["threads"]
    assert meta["hardware"]["processes"] == 2 and meta["matmul_peak_flops"] == 2 * per_process
    fpt = flops_per_token(load_run(out).model, 128)  # tiny's seq_len
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [2, 4]
    assert all(r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / (2 * per_process), rel=1e-9) for r in rows)
