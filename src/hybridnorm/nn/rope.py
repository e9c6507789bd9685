"""Rotary position embedding, in the "rotate half" layout that HF Llama/Qwen3/OLMo-2 use."""

from __future__ import annotations

import torch
from torch import Tensor


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (max_len, head_dim // 2), fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, T, H, D) by position; cos/sin are (T, D/2) rows for exactly those positions."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)  # (T, 1, D/2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
