"""A model whose weights are bf16 or fp16 (``model.to(torch.bfloat16)``, transformers'
``from_pretrained(..., dtype=torch.bfloat16)``), not fp32 weights under autocast as the trainer keeps them.

Every norm kind computes in fp32 whatever its gain's dtype (SCHEMES.md: "N ... computed in fp32"), so such
a model runs, forward and backward, for every norm kind with the fast kernels and the plain math. Before,
a LayerNorm model failed on the CPU ("mixed dtype (CPU): expect parameter to have scalar type of Float":
an fp32 input with a bf16 gain), through transformers' own ``test_eager_matches_sdpa_inference`` too.

Oracle: the same model in fp32 with the same, already rounded weights; the low-precision run differs only
by rounding its activations between ops. Measured worst max|low − ref| / max|ref| over these cases:
bf16 0.015, fp16 0.0018 (over every preset: bf16 0.034). The bounds, 0.08 and 0.01, are still far below
what a missing or misplaced norm does (O(1); a gain off by 1.5 gives more, below). MoE models are left
out of the closeness check: a bf16-rounded input can route a token to another expert (measured 0.12 on a
tiny model), which is a discrete change, not an error.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybridnorm import ModelConfig, TransformerLM
from hybridnorm.nn.norms import LayerNorm

TOL = {torch.bfloat16: 8e-2, torch.float16: 1e-2}
PLACEMENTS = ["hybridnorm_star", "post", "peri", "resi_dual", "lns"]


def tiny(placement: str, norm: str, fast: bool, **kw) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(**{**dict(vocab_size=101, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                                                ffn_hidden_size=48, max_seq_len=32, placement=placement, norm=norm,
                                                fast_kernels=fast), **kw}))


def ids() -> torch.Tensor:
    return torch.randint(0, 101, (2, 10), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("norm", ["rms", "layer", "dyt"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_model_cast_to_low_precision_runs_and_matches_fp32_math(placement: str, norm: str, fast: bool,
                                                                   dtype: torch.dtype) -> None:
    low = tiny(placement, norm, fast).to(dtype)
    ref = copy.deepcopy(low).float()  # the same rounded weights, fp32 math
    logits = low(ids())
    assert logits.dtype == dtype
    with torch.no_grad():
        expected = ref(ids())
    err = ((logits.float() - expected).abs().max() / expected.abs().max()).item()
    assert err <= TOL[dtype], f"{placement}/{norm}: {err:.3g}"
    logits.float().square().mean().backward()
    for name, p in low.named_parameters():
        assert p.grad is not None and p.grad.dtype == dtype and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("norm", ["rms", "layer", "dyt"])
def test_a_low_precision_moe_runs_forward_and_backward(norm: str) -> None:
    low = tiny("hybridnorm", norm, True, moe=dict(num_experts=4, top_k=2), tie_embeddings=False)
    low = low.to(torch.bfloat16)
    logits = low(ids())
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    logits.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in low.parameters() if p.grad is not None)


def test_the_comparison_can_fail() -> None:
    """A LayerNorm that drops its gain in the low-precision model is caught at these tolerances."""
    low = tiny("hybridnorm_star", "layer", True).to(torch.bfloat16)
    ref = copy.deepcopy(low).float()
    with torch.no_grad():
        for m in low.modules():
            if isinstance(m, LayerNorm):
                m.weight.mul_(1.5)
        err = ((low(ids()).float() - ref(ids())).abs().max() / ref(ids()).abs().max()).item()
    assert err > TOL[torch.bfloat16]
