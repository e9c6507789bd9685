"""Initialization schemes (HybridNorm paper §5.4, Table 10; DeepNet for ``deepnorm``).

All weights are truncated normal at ±3σ with σ = ``ModelConfig.std`` (default 1/√(2.5·d), "SmallInit").

=============  ==============================================================================
scheme         output projections (attention W_O, FFN / expert down-projection) of block l
=============  ==============================================================================
normal         σ
megatron       σ/√(2L)
depth_scaled   σ/√(2l)
deepnorm       σ·β with β = (8L)^-¼, also on V (the V rows of W_qkv) and the FFN/expert up-projections
=============  ==============================================================================

Every other linear layer, the router and the embedding get σ. An untied LM head gets σ under
``normal``/``deepnorm`` and 1/√d under ``megatron``/``depth_scaled``. Norm gains start at 1.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from hybridnorm.nn.norms import Norm


def trunc_normal(t: Tensor, std: float) -> None:
    """Fill ``t`` in place with N(0, σ²) truncated at ±3σ, the draw of every scheme."""
    nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3 * std, b=3 * std)


def head_std(scheme: str, std: float, d_model: int) -> float:
    """σ of an untied LM head: 1/√d under ``megatron``/``depth_scaled``, else σ."""
    return 1 / math.sqrt(d_model) if scheme in ("megatron", "depth_scaled") else std


def deepnorm_beta(n_layers: int) -> float:
    return (8 * n_layers) ** -0.25


@torch.no_grad()
def init_weights(model: nn.Module, scheme: str, std: float) -> None:
    """Initialize a :class:`~hybridnorm.nn.model.TransformerLM` in place."""
    n_layers = len(model.blocks)
    d_model = model.embed.weight.shape[1]
    beta = deepnorm_beta(n_layers) if scheme == "deepnorm" else 1.0
    trunc_normal(model.embed.weight, std)
    for depth, block in enumerate(model.blocks, start=1):
        out_std = {
            "normal": std,
            "megatron": std / math.sqrt(2 * n_layers),
            "depth_scaled": std / math.sqrt(2 * depth),
            "deepnorm": std * beta,
        }[scheme]
        attn = block.attn
        trunc_normal(attn.w_qkv.weight, std)
        # a loader that marks the tensors it filled (transformers' `_is_hf_initialized`, honoured by its guarded
        # nn.init functions) must not see the V rows re-drawn: they are a view, which the mark does not reach
        if beta != 1.0 and not getattr(attn.w_qkv.weight, "_is_hf_initialized", False):
            v_rows = attn.w_qkv.weight[(attn.n_heads + attn.n_kv_heads) * attn.head_dim:]
            trunc_normal(v_rows, std * beta)
        trunc_normal(attn.w_o.weight, out_std)
        ffn = block.ffn
        if hasattr(ffn, "router"):  # MoE: stacked expert weights
            trunc_normal(ffn.router.weight, std)
            trunc_normal(ffn.w_in, std * beta)
            trunc_normal(ffn.w_out, out_std)
        else:
            trunc_normal(ffn.w_in.weight, std * beta)
            trunc_normal(ffn.w_out.weight, out_std)
    if model.lm_head is not None:
        trunc_normal(model.lm_head.weight, head_std(scheme, std, d_model))
    for m in model.modules():
        if isinstance(m, Norm):
            m.reset_parameters()
