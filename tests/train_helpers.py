"""Helpers shared by the training tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import json
import os
import random
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hybridnorm.config import SIZES

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


def _ddp_worker(rank: int, world: int, port: int, overrides: list[str], report_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
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
    ctx = mp.start_processes(_ddp_worker, args=(world, _free_port(), overrides, str(report_dir)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"DDP run did not finish in {timeout_s}s (deadlock?)")
    return [json.loads((report_dir / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(world)]
