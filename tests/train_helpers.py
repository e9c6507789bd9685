"""Helpers shared by the training tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hybridnorm.config import SIZES
from hybridnorm.nn.block import Block


def _torchrun() -> list[str]:
    """torchrun of the interpreter running the tests (``torchrun`` on PATH may belong to another Python with
    another torch: a test in a venv then compared its own torch with the system's, and failed on their numbers),
    as a user types it. On one machine torch 2.13's torchrun meets at a free port (c10d at ``localhost:0``) where
    older ones (2.11) take the fixed port 29500, on which two pytest workers' runs collided (EADDRINUSE): there
    it gets ``--standalone``, the free-port rendezvous that 2.13 uses by default."""
    import inspect

    import torch.distributed.run as launcher

    free_port_by_default = inspect.getsource(launcher.run).count('"localhost:0"') >= 2  # and under --standalone
    return [sys.executable, "-m", "torch.distributed.run", *([] if free_port_by_default else ["--standalone"])]


TORCHRUN = _torchrun()

WORDS = ("the lord said unto moses and aaron go forth into a land of milk and honey where the people shall "
         "keep my law by day and by night for they are my people and i am their god behold the river ran "
         "dry and the city was built upon a hill with seven gates of brass").split()


def write_corpus(folder: Path, n_docs: int = 8, n_lines: int = 60, seed: int = 0) -> Path:
    """``n_docs`` .txt files of English-like lines (~3 KB each)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
                 for _ in range(n_lines)]
        (folder / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def tiny_overrides(corpus: Path, cache: Path, out_dir: Path) -> list[str]:
    model = [f"--model.{k}={v}" for k, v in SIZES["tiny"].items() if k != "vocab_size"]
    return [*model, f"--data.source={corpus}", "--data.tokenizer=bytes", f"--data.cache_dir={cache}",
            "--seq_len=32", "--batch_size=4", "--log_interval=1", "--eval_interval=1000", "--eval_batches=2",
            "--ckpt_interval=1000", "--optim.warmup_steps=2", "--optim.lr=2e-3", "--precision=fp32",
            "--device=cpu", f"--out_dir={out_dir}"]


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    """Records of ``metrics.jsonl`` of one kind (a torn last line of a killed run is skipped)."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == kind:
            out.append(rec)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> None:
    """The environment torchrun gives rank ``rank`` of ``world`` on this machine (gloo rendezvous at ``port``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def spawn_ranks(worker, world: int, args: tuple, timeout_s: float, what: str) -> None:
    """Run ``worker(rank, world, port, *args)`` in ``world`` spawned processes and wait for all of them. A
    run that does not finish in ``timeout_s`` (a deadlock) is killed and fails the test instead of hanging it."""
    ctx = mp.start_processes(worker, args=(world, _free_port(), *args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what} did not finish in {timeout_s}s (deadlock?)")


def _ddp_worker(rank: int, world: int, port: int, overrides: list[str], report_dir: str) -> None:
    rank_env(rank, world, port)
    import hybridnorm.train.trainer as trainer
    from hybridnorm.train.config import TrainConfig, apply_overrides

    trainer.measured_peak_flops = lambda *a, **k: 1e12  # skip the slow matmul benchmark
    try:
        result = trainer.train(TrainConfig.from_dict(apply_overrides({}, overrides)))
        report = {"pid": os.getpid(), "step": result.step, "train_loss": result.train_loss,
                  "val_loss": result.val_loss}
        Path(report_dir, f"rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_ddp(overrides: list[str], report_dir: Path, world: int = 2, timeout_s: float = 240) -> list[dict]:
    """Train ``overrides`` in ``world`` gloo processes on this machine; each rank's TrainResult as a dict
    (``rank<r>.json`` in ``report_dir``). A run that does not finish in ``timeout_s`` (a deadlock) fails
    the test instead of hanging it. Callers clear RANK/WORLD_SIZE/... from their own environment."""
    report_dir.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_ddp_worker, world, (overrides, str(report_dir)), timeout_s, "DDP run")
    return [json.loads((report_dir / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(world)]


def poison_weight_at(monkeypatch, layer: int, train_forward: int) -> None:
    """Set blocks.<layer>.attn.w_o to NaN right before that block's ``train_forward``-th training forward."""
    original, calls = Block.forward, [0]

    def forward(self, x, *args, **kwargs):
        if self.layer == layer and self.training and torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] == train_forward:
                with torch.no_grad():
                    self.attn.w_o.weight.fill_(math.nan)
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(Block, "forward", forward)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun puts its workers in sessions of their own: no group kill)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return out
    for task in tasks:
        try:
            kids = [int(p) for p in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        for kid in kids:
            out += [kid, *_descendants(kid)]
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process under it."""
    for pid in [*_descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run_bounded(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)``, but a command still running after
    ``timeout`` seconds is killed with every process under it (a hung torchrun's workers too), and the test
    fails saying so instead of leaving processes behind."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        proc.communicate()
        pytest.fail(f"still running after {timeout} s, killed: {' '.join(cmd)}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def cli_in_process(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    """``hybridnorm ARGS`` through the command line's own ``main`` in this process (no interpreter start-up,
    seconds each), with its exit status and what it printed; asserts it succeeded (``ok``) or failed. The
    same commands in a real process: tests/test_cli.py and the README command tests."""
    import io

    from hybridnorm import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    assert (code == 0) == ok, err.getvalue()[-3000:]
    return subprocess.CompletedProcess(["hybridnorm", *args], code, out.getvalue(), err.getvalue())
