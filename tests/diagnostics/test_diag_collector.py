"""The Diagnostics collector's contract: which steps it collects, no hooks outside collection steps (none at
all when off), the metric keys it returns, and the switches."""

from __future__ import annotations

import pytest
import torch

from hybridnorm import ModelConfig, TransformerLM, lm_loss
from hybridnorm.diagnostics import Diagnostics, DiagnosticsConfig
from hybridnorm.nn.attention import SDPA


def _model(**kw) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(ModelConfig.from_preset("tiny", **kw))


def _n_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _step(model: TransformerLM, diag: Diagnostics, step: int, opt: torch.optim.Optimizer) -> tuple[dict, int]:
    """One training step through the collector; returns its metrics and the hooks seen during forward."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
    with diag.capture(step):
        hooks = _n_hooks(model)
        logits, aux = model(ids, return_aux=True)
        (lm_loss(logits[:, :-1], ids[:, 1:]) + (aux["aux_loss"] if aux else 0)).backward()
    diag.after_backward()
    diag.before_update()
    opt.step()
    diag.after_update()
    opt.zero_grad()
    return diag.pop_metrics(), hooks


def test_schedule_is_step_one_and_every_nth():
    diag = Diagnostics(_model(), DiagnosticsConfig(every=3))
    assert [s for s in range(1, 13) if diag.should_collect(s)] == [1, 3, 6, 9, 12]
    assert not any(Diagnostics(_model(), DiagnosticsConfig(every=0)).should_collect(s) for s in range(1, 20))
    assert not Diagnostics(_model(), DiagnosticsConfig(every=1), enabled=False).should_collect(1)


@pytest.mark.parametrize("cfg", [DiagnosticsConfig(every=0), DiagnosticsConfig(every=5)], ids=["off", "every5"])
def test_no_hooks_no_metrics_off_schedule(cfg, monkeypatch):
    model = _model()
    seen_hooks = []
    monkeypatch.setattr(SDPA, "forward", _spy(SDPA.forward, seen_hooks))
    diag = Diagnostics(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics, hooks = _step(model, diag, 2, opt)
    assert (metrics, hooks) == ({}, 0)
    assert seen_hooks and not any(seen_hooks)  # the attention kernel ran, never with a hook on it
    assert diag._updates is None or diag._updates._before is None  # no parameter copy either
    if not cfg.enabled:
        assert diag._updates is None


def _spy(forward, seen: list):
    def wrapped(self, *a, **k):
        seen.append(bool(self._forward_pre_hooks or self._forward_hooks))
        return forward(self, *a, **k)
    return wrapped


def test_collection_step_hooks_are_removed_and_keys_complete():
    model = _model(n_layers=3)
    diag = Diagnostics(model, DiagnosticsConfig(every=10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics, hooks = _step(model, diag, 10, opt)
    assert hooks == 1 + 3 + 3  # the embedding, each block and each block's attention kernel (SDPA)
    assert _n_hooks(model) == 0
    kinds = {k.split("/")[0] for k in metrics}
    assert kinds == {"grad_norm", "update_norm", "weight_norm", "act_rms", "act_max_abs", "act_kurtosis",
                     "cos_sim", "attn_max_logit", "attn_entropy"}
    for i in range(3):
        for key in ("grad_norm/blocks.{i}.attn", "act_rms/blocks.{i}", "attn_max_logit/blocks.{i}",
                    "attn_entropy/blocks.{i}", "cos_sim/blocks.{i}", "update_norm/blocks.{i}",
                    "weight_norm/blocks.{i}"):
            assert key.format(i=i) in metrics
    assert all(isinstance(v, float) for v in metrics.values())
    assert diag.last == {"step": 10, **metrics}
    assert _step(model, diag, 11, opt)[0] == {}  # the next step is not collected


def test_switches_and_forward_probes_off():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = _step(model, Diagnostics(model, DiagnosticsConfig(every=1, activations=False)), 1, opt)[0]
    assert not any(k.startswith(("act_", "cos_sim")) for k in m) and "attn_entropy/blocks.0" in m
    m, hooks = _step(model, Diagnostics(model, DiagnosticsConfig(every=1, attention=False)), 1, opt)
    assert not any(k.startswith("attn_") for k in m) and "act_rms/blocks.0" in m
    assert hooks == 1 + 2  # no hook on the attention kernels
    m, hooks = _step(model, Diagnostics(model, DiagnosticsConfig(every=1), forward_probes=False), 1, opt)
    assert hooks == 0 and {k.split("/")[0] for k in m} == {"grad_norm", "update_norm", "weight_norm"}


class _OtherKernel(torch.nn.Module):
    def forward(self, q, k, v, mask=None, causal=False):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                                enable_gqa=True)


def test_attention_without_sdpa_module_is_skipped_gracefully():
    # a block whose attention kernel is some other module: its attention metrics are left out, nothing fails
    model = _model()
    model.blocks[0].attn.inner = _OtherKernel()
    m = _step(model, Diagnostics(model, DiagnosticsConfig(every=1)), 1, torch.optim.SGD(model.parameters(), lr=0.1))[0]
    assert "attn_entropy/blocks.1" in m and "attn_entropy/blocks.0" not in m and "act_rms/blocks.0" in m


def test_skipped_update_has_no_update_norms():
    model = _model()
    diag = Diagnostics(model, DiagnosticsConfig(every=1))
    with diag.capture(1):
        model(torch.randint(0, 256, (2, 8))).sum().backward()
    diag.after_backward()
    m = diag.pop_metrics()  # no before/after_update: the step's update was skipped
    assert "grad_norm/blocks.0" in m and not any(k.startswith(("update_norm", "weight_norm")) for k in m)


def test_moe_expert_load_from_the_first_micro_batch():
    model = _model(placement="hybridnorm", moe=dict(num_experts=4, top_k=2), ffn_hidden_size=32,
                   tie_embeddings=False)
    diag = Diagnostics(model, DiagnosticsConfig(every=1))
    counts = []
    with diag.capture(1):
        model(torch.randint(0, 256, (2, 16)))
        counts = [b.ffn.expert_counts.clone() for b in model.blocks]
        model(torch.randint(0, 256, (2, 16)))  # a second micro-batch does not overwrite the sample
    m = diag.pop_metrics()
    for i, c in enumerate(counts):
        frac = c.double() / c.sum()
        assert m[f"expert_load_max/blocks.{i}"] == pytest.approx(float(frac.max()))
        assert m[f"expert_load_min/blocks.{i}"] == pytest.approx(float(frac.min()))
        assert m[f"expert_load_cv/blocks.{i}"] == pytest.approx(float(frac.std(correction=0) / frac.mean()), rel=1e-5)
