"""The spike detector (synthetic series and a real tiny run's losses) and the non-finite post-mortem."""

from __future__ import annotations

import math

import pytest
import torch
from train_helpers import read_metrics

from hybridnorm import ModelConfig, TransformerLM, lm_loss
from hybridnorm.diagnostics import SpikeDetector, divergence_report, first_nonfinite_module, first_nonfinite_param
from hybridnorm.train.trainer import train


def _feed(det: SpikeDetector, losses, grad_norms) -> list[tuple[int, str]]:
    return [(i, e.metric) for i, (lo, g) in enumerate(zip(losses, grad_norms, strict=True))
            if (e := det.check(lo, g)) is not None]


def test_fires_on_an_injected_spike_only_after_ten_values():
    losses = [3.0 - 0.01 * i + 0.005 * math.sin(i) for i in range(40)]
    norms = [1.0 + 0.05 * math.cos(i) for i in range(40)]
    assert _feed(SpikeDetector(), losses, norms) == []
    spiky = list(losses)
    spiky[25] = 6.0
    assert _feed(SpikeDetector(), spiky, norms) == [(25, "loss")]
    g = list(norms)
    g[30] = 20.0
    det = SpikeDetector(window=50, zscore=6.0)
    fired = [det.check(lo, gn) for lo, gn in zip(losses, g, strict=True)]
    event = fired[30]
    assert [i for i, e in enumerate(fired) if e] == [30]
    assert event.metric == "grad_norm" and event.value == 20.0 and event.zscore > 6
    assert event.to_dict().keys() == {"metric", "value", "mean", "std", "zscore"}
    early = [1.0] * 9 + [100.0]  # 9 values of history: too few to judge
    assert _feed(SpikeDetector(), early, early) == []
    assert _feed(SpikeDetector(), [1.0 + 0.01 * (i % 3) for i in range(10)] + [100.0], [1.0] * 11) == [(10, "loss")]


def test_drops_nonfinite_and_off_are_never_spikes():
    det = SpikeDetector()
    base = [2.0 + 0.01 * (i % 5) for i in range(20)]
    assert _feed(det, [*base, 0.1, math.nan, math.inf], [1.0] * 23) == []
    assert len(det.history["loss"]) == 21  # the non-finite values did not enter the window
    off = SpikeDetector(zscore=0)
    assert _feed(off, [*base, 1e6], [1.0] * 21) == []
    assert list(off.history["loss"]) == [*base, 1e6]  # still the record of recent losses


def test_window_rolls_and_state_roundtrips():
    det = SpikeDetector(window=12)
    for i in range(30):
        det.check(float(i), 1.0)
    assert list(det.history["loss"]) == [float(i) for i in range(18, 30)]
    other = SpikeDetector(window=12)
    other.load_state_dict(det.state_dict())
    assert other.state_dict() == det.state_dict()
    assert (det.check(100.0, 1.0) is None) == (other.check(100.0, 1.0) is None)


def test_clean_tiny_run_has_no_spike_and_an_injected_one_fires(make_cfg, tmp_path):
    run = tmp_path / "clean"
    train(make_cfg(run, "--max_steps=40"))
    assert read_metrics(run, "event") == []  # the trainer's own detector stayed quiet
    recs = read_metrics(run)
    losses, norms = [r["loss"] for r in recs], [r["grad_norm"] for r in recs]
    assert _feed(SpikeDetector(), losses, norms) == []
    # a spike sized from the window it is scored against (the 30 losses before it: the run's descent is in
    # there, and how steep it is differs between torch builds): 7 population stds above the mean fires,
    # 5 does not (the threshold is 6)
    window = losses[:30]
    mean = sum(window) / 30
    std = (sum((v - mean) ** 2 for v in window) / 30) ** 0.5
    for sigmas, fired in ((7, [(30, "loss")]), (5, [])):
        spiky = list(losses)
        spiky[30] = mean + sigmas * std
        assert _feed(SpikeDetector(), spiky, norms) == fired


def test_first_nonfinite_module_names_the_innermost_first_module():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.from_preset("tiny", n_layers=3, placement="pre"))
    ids = torch.randint(0, 256, (2, 8))
    batch = [(ids[:, :-1], ids[:, 1:])]

    def loss_fn(x, y):
        return lm_loss(model(x), y)

    assert first_nonfinite_module(model, batch, loss_fn) is None
    with torch.no_grad():
        model.blocks[1].ffn.w_out.weight[0, 0] = math.nan
    # its parents (blocks.1.ffn, blocks.1, the model) and everything after it also go non-finite
    assert first_nonfinite_module(model, batch, loss_fn) == "blocks.1.ffn.w_out"
    assert first_nonfinite_param(model, grad=False) == "blocks.1.ffn.w_out.weight"
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0  # hooks removed
    assert first_nonfinite_module(model, [], loss_fn) is None


def test_nonfinite_loss_with_finite_modules_is_reported_as_loss():
    model = TransformerLM(ModelConfig.from_preset("tiny", n_layers=1))
    ids = torch.randint(0, 256, (1, 8))
    assert first_nonfinite_module(model, [(ids, ids)], lambda x, y: model(x).sum() * math.inf) == "loss"


@pytest.mark.parametrize("with_grad", [True, False])
def test_first_nonfinite_param_grad(with_grad):
    model = TransformerLM(ModelConfig.from_preset("tiny", n_layers=2))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    if with_grad:
        model.blocks[1].attn.w_qkv.weight.grad[0, 0] = math.inf
    assert first_nonfinite_param(model, grad=True) == ("blocks.1.attn.w_qkv.weight" if with_grad else None)


@pytest.mark.parametrize("norm", ["q_norm", "k_norm", "v_norm"])
@pytest.mark.parametrize("fast", [True, False])
def test_divergence_report_names_the_qkv_norm_that_goes_nonfinite_first(norm, fast):
    # With fast kernels the Q/K/V norms run fused inside the attention unless a hook is on them: the
    # post-mortem's hooks switch that path off, so the norm itself is named, not blocks.1.attn.
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.from_preset("tiny", n_layers=3, placement="hybridnorm", fast_kernels=fast))
    assert model.blocks[1].attn._use_fused() == fast
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        getattr(model.blocks[1].attn, norm).weight[0] = math.nan
    report = divergence_report(step=3, loss=math.nan, grad_norm=math.nan, model=model,
                               batches=[(ids[:, :-1], ids[:, 1:])], loss_fn=lambda x, y: lm_loss(model(x), y),
                               recent_losses=[], last_diagnostics=None, last_checkpoint=None)
    assert (report["first_nonfinite"], report["first_nonfinite_from"]) == (f"blocks.1.attn.{norm}", "forward")
    assert report["first_nonfinite_param"] == f"blocks.1.attn.{norm}.weight"
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0
