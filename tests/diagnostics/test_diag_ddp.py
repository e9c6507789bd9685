"""Diagnostics under DDP (2 gloo processes): nothing deadlocks, only rank 0 logs diag records, and the
per-layer gradient norms (read after DDP averaged the gradients) equal one process with the double batch."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from train_helpers import read_metrics, tiny_overrides

STEPS = 4
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, overrides: list[str], report_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import hybridnorm.train.trainer as trainer
    from hybridnorm.train.config import TrainConfig, apply_overrides

    trainer.measured_peak_flops = lambda *a, **k: 1e12
    try:
        result = trainer.train(TrainConfig.from_dict(apply_overrides({}, overrides)))
        Path(report_dir, f"rank{rank}.json").write_text(json.dumps({"step": result.step}), encoding="utf-8")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _spawn(overrides: list[str], reports: Path) -> None:
    ctx = mp.start_processes(_worker, args=(2, _free_port(), overrides, str(reports)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"DDP run with diagnostics did not finish in {TIMEOUT_S}s (deadlock?)")


def test_ddp_with_diagnostics(corpus, cache_dir, make_cfg, tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    common = [f"--max_steps={STEPS}", "--grad_accum=2", "--diagnostics.every=2", "--eval_interval=2"]

    from hybridnorm.train.trainer import train

    train(make_cfg(tmp_path / "single", *common, "--batch_size=4"))
    ddp_dir, reports = tmp_path / "ddp", tmp_path / "reports"
    reports.mkdir()
    _spawn([*tiny_overrides(corpus, cache_dir, ddp_dir), *common, "--batch_size=2"], reports)

    assert [json.loads((reports / f"rank{r}.json").read_text())["step"] for r in (0, 1)] == [STEPS, STEPS]
    diag = read_metrics(ddp_dir, "diag")
    assert [r["step"] for r in diag] == [1, 2, 4]  # once per collection step: rank 1 logged nothing
    single = read_metrics(tmp_path / "single", "diag")
    for a, b in zip(single, diag, strict=True):
        assert {k for k in a if "/" in k} == {k for k in b if "/" in k}
        for k in a:
            if k.startswith(("grad_norm/", "update_norm/", "weight_norm/")):
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), k
    assert "attn_entropy/blocks.1" in diag[0] and "act_kurtosis/blocks.0" in diag[0]
