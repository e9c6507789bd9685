"""Two CPU processes (gloo) with batch B each train exactly like one process with batch 2B; only rank 0
writes metrics, TensorBoard events and checkpoints."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import read_metrics, run_ddp, tiny_overrides

STEPS = 4


def test_two_ranks_match_one_process_with_double_batch(corpus, cache_dir, make_cfg, tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    # grad_accum=2 also exercises DDP's no_sync on the first micro-batch
    common = [f"--max_steps={STEPS}", "--ckpt_interval=2", "--eval_interval=2", "--grad_accum=2"]

    from hybridnorm.train.trainer import train

    single = train(make_cfg(tmp_path / "single", *common, "--batch_size=4"))

    ddp_dir = tmp_path / "ddp"
    r0, r1 = run_ddp([*tiny_overrides(corpus, cache_dir, ddp_dir), *common, "--batch_size=2"], tmp_path / "reports")
    assert r0["step"] == r1["step"] == STEPS
    assert r0["train_loss"] == r1["train_loss"]  # the loss is all-reduced: every rank reports the same
    assert r0["val_loss"] == pytest.approx(single.val_loss, rel=1e-5)

    a, b = read_metrics(tmp_path / "single"), read_metrics(ddp_dir)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))  # one record per step: rank 1 logged nothing
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]  # global tokens per step: 2 ranks x 2 x 2 x 32
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-5), key
    assert [r["lr"] for r in a] == [r["lr"] for r in b]
    assert [r["val_loss"] for r in read_metrics(ddp_dir, "eval")] == \
        pytest.approx([r["val_loss"] for r in read_metrics(tmp_path / "single", "eval")], rel=1e-5)

    wa = load_file(tmp_path / "single" / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors")
    wb = load_file(ddp_dir / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6)

    # only rank 0 wrote: checkpoints, no leftover temp folder of rank 1, TensorBoard events of rank 0's pid
    ckpts = sorted(p.name for p in (ddp_dir / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000004"]
    events = [p.name for p in (ddp_dir / "tb").iterdir()]
    assert len(events) == 1 and f".{r0['pid']}." in events[0] and f".{r1['pid']}." not in events[0]
