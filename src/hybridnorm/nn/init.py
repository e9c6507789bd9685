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


def _tn(t: Tensor, std: float) -> None:
    nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3 * std, b=3 * std)


def deepnorm_beta(n_layers: int) -> float:
    return (8 * n_layers) ** -0.25


@torch.no_grad()
def init_weights(model: nn.Module, scheme: str, std: float) -> None:
    """Initialize a :class:`~hybridnorm.nn.model.TransformerLM` in place."""
    n_layers = len(model.blocks)
    d_model = model.embed.weight.shape[1]
    beta = deepnorm_beta(n_layers) if scheme == "deepnorm" else 1.0
    _tn(model.embed.weight, std)
    for depth, block in enumerate(model.blocks, start=1):
        out_std = {
            "normal": std,
            "megatron": std / math.sqrt(2 * n_layers),
            "depth_scaled": std / math.sqrt(2 * depth),
            "deepnorm": std * beta,
        }[scheme]
        attn = block.attn
        _tn(attn.w_qkv.weight, std)
        # a loader that marks the tensors it filled (transformers' `_is_hf_initialized`, honoured by its guarded
        # nn.init functions) must not see the V rows re-drawn: they are a view, which the mark does not reach
        if beta != 1.0 and not getattr(attn.w_qkv.weight, "_is_hf_initialized", False):
            v_rows = attn.w_qkv.weight[(attn.n_heads + attn.n_kv_heads) * attn.head_dim:]
            _tn(v_rows, std * beta)
        _tn(attn.w_o.weight, out_std)
        ffn = block.ffn
        if hasattr(ffn, "router"):  # MoE: stacked expert weights
            _tn(ffn.router.weight, std)
            _tn(ffn.w_in, std * beta)
            _tn(ffn.w_out, out_std)
        else:
            _tn(ffn.w_in.weight, std * beta)
            _tn(ffn.w_out.weight, out_std)
    if model.lm_head is not None:
        _tn(model.lm_head.weight, 1 / math.sqrt(d_model) if scheme in ("megatron", "depth_scaled") else std)
    for m in model.modules():
        if isinstance(m, Norm):
            m.reset_parameters()
