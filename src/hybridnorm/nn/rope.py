"""Rotary position embedding, in the "rotate half" layout that HF Llama/Qwen3/OLMo-2 use.

For x = [x1 | x2] (the two halves of the head dim) at position t, with c = cos(t·θ), s = sin(t·θ)::

    rope(x) = [x1·c − x2·s | x2·c + x1·s]

It is linear in x, so the backward is the transposed rotation ``[g1·c + g2·s | g2·c − g1·s]`` and needs
no saved activations. Both directions run as four elementwise kernels writing into one preallocated
output (no chunk/neg/cat temporaries): ``rope_into``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (max_len, head_dim // 2), fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def rope_into(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor, inverse: bool = False) -> Tensor:
    """Write rope(x) (or, with ``inverse``, its transpose = the backward) into ``out`` and return it.

    x, out: (B, T, H, D) of one dtype, any strides, ``out`` must not overlap x; cos/sin: (T, 1, D/2) in
    that dtype (a differing ``out`` dtype would cost CPU type promotion a temporary and a copy per op).
    """
    h = x.shape[-1] // 2
    x1, x2, o1, o2 = x[..., :h], x[..., h:], out[..., :h], out[..., h:]
    sign = -1 if inverse else 1
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-sign)  # x1·c − x2·s   (inverse: g1·c + g2·s)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin, value=sign)   # x2·c + x1·s   (inverse: g2·c − g1·s)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return rope_into(x, cos, sin, torch.empty(x.shape, dtype=x.dtype, device=x.device))

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return rope_into(g, cos, sin, torch.empty(g.shape, dtype=g.dtype, device=g.device), inverse=True), None, None


def rope_cos_sin(cos: Tensor, sin: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(T, D/2) tables -> (T, 1, D/2) in ``dtype``, ready to broadcast over (B, T, H, D/2); per-sequence
    tables (B, T, D/2) (left-padded batches) -> (B, T, 1, D/2)."""
    return cos.unsqueeze(-2).to(dtype), sin.unsqueeze(-2).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, T, H, D) by position; cos/sin are (T, D/2) or (B, T, D/2) rows for those positions."""
    cos, sin = rope_cos_sin(cos, sin, x.dtype)  # (T, 1, D/2) or (B, T, 1, D/2)
    if cos.requires_grad or sin.requires_grad:  # learned tables: let autograd differentiate them too
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, cos, sin)
    return rope_into(x, cos, sin, torch.empty(x.shape, dtype=x.dtype, device=x.device))
