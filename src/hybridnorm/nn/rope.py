"""Rotary position embedding, in the "rotate half" layout that HF Llama/Qwen3/OLMo-2 use.

For x = [x1 | x2] (the two halves of the head dim) at position t, with c = cos(t·θ), s = sin(t·θ)::

    rope(x) = [x1·c − x2·s | x2·c + x1·s]

:func:`apply_rope` is that line; its fast twin (``ModelConfig.fast_kernels``) is
:func:`hybridnorm.nn.kernels.rope`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (max_len, head_dim // 2), fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def rope_cos_sin(cos: Tensor, sin: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(T, D/2) tables -> (T, 1, D/2) in ``dtype``, ready to broadcast over (B, T, H, D/2); per-sequence
    tables (B, T, D/2) (left-padded batches) -> (B, T, 1, D/2)."""
    return cos.unsqueeze(-2).to(dtype), sin.unsqueeze(-2).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, T, H, D) by position; cos/sin are (T, D/2) or (B, T, D/2) rows for those positions."""
    cos, sin = rope_cos_sin(cos, sin, x.dtype)  # (T, 1, D/2) or (B, T, 1, D/2)
    x1, x2 = x.chunk(2, dim=-1)  # (B, T, H, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (B, T, H, D)
