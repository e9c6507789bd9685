"""Module hooks see the attention's pieces on every path: hooks on the Q/K/V norms fire with the fast kernels
on (the fused Q/K/V Function steps aside while one is registered), and the attention kernel is its own
module (``Attention.inner``, an SDPA) whose hooks see q, k, v as they enter it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hybridnorm as hn
from hybridnorm.nn.attention import SDPA

NORMS = ("q_norm", "k_norm", "v_norm")


def _model(placement: str, fast: bool = True, **kw) -> hn.TransformerLM:
    torch.manual_seed(0)
    return hn.TransformerLM(hn.ModelConfig.from_preset("tiny", placement=placement, fast_kernels=fast, **kw))


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward"])
@pytest.mark.parametrize("placement", ["hybridnorm", "KV-Post", "qk_norm", "olmo2"])
def test_hooks_on_qkv_norms_fire_with_fast_kernels(placement, kind):
    model = _model(placement)
    ids = _ids()
    attn = model.blocks[1].attn
    before = model(ids).detach()
    norms = [n for n in NORMS if getattr(attn, n) is not None]
    assert norms
    fired: list[str] = []

    def hook_for(name: str):
        def hook(module, *args):  # (module, args) / (module, args, out) / (module, grad_in, grad_out)
            fired.append(name)
        return hook

    handles = [getattr(getattr(attn, n), f"register_{kind}_hook")(hook_for(n)) for n in norms]
    assert not attn._use_fused()  # while hooked, the norms run as modules
    out = model(ids)
    if kind == "full_backward":
        out.sum().backward()
    assert sorted(fired) == sorted(norms)
    # same math either way: the hooked (module) path and the fused path agree to fp32 rounding
    torch.testing.assert_close(out.detach(), before, rtol=1e-5, atol=1e-5)
    for h in handles:
        h.remove()
    assert attn._use_fused() == (placement != "olmo2")  # olmo2 (full-width norms) never fuses


def test_a_global_module_hook_also_switches_the_fused_path_off():
    model = _model("hybridnorm")
    seen: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, o: seen.append(type(m).__name__))
    try:
        model(_ids())
    finally:
        handle.remove()
    assert seen.count("RMSNorm") > 0 and "SDPA" in seen


@pytest.mark.parametrize("fast", [True, False])
def test_sdpa_module_sees_q_k_v_as_they_enter_the_kernel(fast):
    model = _model("hybridnorm_star", fast=fast)
    cfg = model.config
    seen = []
    for block in model.blocks:
        assert isinstance(block.attn.inner, SDPA)
        block.attn.inner.register_forward_hook(lambda m, args, out: seen.append((args, out)))
    model(_ids())
    assert len(seen) == cfg.n_layers
    (q, k, v, mask, causal), out = seen[0]
    D = cfg.head_dim
    assert q.shape == (2, cfg.n_heads, 10, D) and k.shape == v.shape == (2, cfg.kv_heads, 10, D)
    assert mask is None and causal is True
    assert out.shape == (2, cfg.n_heads, 10, D)


def test_nn_has_no_diagnostics_side_channel():
    src = Path(hn.__file__).parent / "nn"
    offenders = [p.name for p in src.glob("*.py") if "probe" in p.read_text(encoding="utf-8")]
    assert offenders == []
