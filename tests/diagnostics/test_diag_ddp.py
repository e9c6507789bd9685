"""Diagnostics under DDP (2 gloo processes): nothing deadlocks, only rank 0 logs diag records, and the
per-layer gradient norms (read after DDP averaged the gradients) equal one process with the double batch."""

from __future__ import annotations

import pytest
from train_helpers import read_metrics, run_ddp, tiny_overrides

STEPS = 4


def test_ddp_with_diagnostics(corpus, cache_dir, make_cfg, tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    common = [f"--max_steps={STEPS}", "--grad_accum=2", "--diagnostics.every=2", "--eval_interval=2"]

    from hybridnorm.train.trainer import train

    train(make_cfg(tmp_path / "single", *common, "--batch_size=4"))
    ddp_dir = tmp_path / "ddp"
    reports = run_ddp([*tiny_overrides(corpus, cache_dir, ddp_dir), *common, "--batch_size=2"], tmp_path / "reports")
    assert [r["step"] for r in reports] == [STEPS, STEPS]  # neither rank deadlocked in a diagnostics collective
    diag = read_metrics(ddp_dir, "diag")
    assert [r["step"] for r in diag] == [1, 2, 4]  # once per collection step: rank 1 logged nothing
    single = read_metrics(tmp_path / "single", "diag")
    for a, b in zip(single, diag, strict=True):
        assert {k for k in a if "/" in k} == {k for k in b if "/" in k}
        for k in a:
            if k.startswith(("grad_norm/", "update_norm/", "weight_norm/")):
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), k
    assert "attn_entropy/blocks.1" in diag[0] and "act_kurtosis/blocks.0" in diag[0]
