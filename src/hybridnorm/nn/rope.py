"""Rotary position embedding, in the "rotate half" layout that HF Llama/Qwen3/OLMo-2 use.

For x = [x1 | x2] (the two halves of the head dim) at position t, with c = cos(t·θ), s = sin(t·θ)::

    rope(x) = [x1·c − x2·s | x2·c + x1·s]

:func:`apply_rope` is that line; its fast twin (``ModelConfig.fast_kernels``) is
:func:`hybridnorm.nn.kernels.rope`. θ of pair i is ``rope_theta ** (-2i / D)``, or that stretched for a
longer context (``ModelConfig.rope_scaling``, :func:`inv_frequencies`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def inv_frequencies(head_dim: int, theta: float, scaling: Any = None, context: int | None = None,
                    seq_len: int | None = None) -> tuple[Tensor, float]:
    """θ of each pair of dims (head_dim // 2,), float64, and the factor cos and sin are multiplied by
    (1 but for YaRN). ``scaling``: a :class:`hybridnorm.config.RopeScaling` (not imported: nn sits below the
    config) or None; ``context``: the model's max_seq_len (pre-training's context where ``original_max_seq_len``
    is unset); ``seq_len``: for dynamic NTK, the longest sequence the frequencies must reach."""
    if scaling is not None and scaling.type == "dynamic":
        # dynamic NTK: θ unchanged up to the context, then its base grown with the sequence (as transformers')
        if context is None:
            raise ValueError("dynamic rope_scaling needs the model's context")
        grown = scaling.factor * max(seq_len or context, context) / context - (scaling.factor - 1)
        return inv_frequencies(head_dim, theta * grown ** (head_dim / (head_dim - 2)))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (D/2,)
    if scaling is None:
        return inv_freq, 1.0
    factor = scaling.factor
    if scaling.type == "linear":  # Position Interpolation (arXiv 2306.15595): every angle shrunk by the factor
        return inv_freq / factor, 1.0
    original = scaling.original_max_seq_len or context
    if original is None:
        raise ValueError(f"rope_scaling type {scaling.type!r} needs original_max_seq_len or the model's context")
    if scaling.type == "llama3":
        # Llama 3.1: a pair turning fewer than low_freq_factor times over the original context is stretched by the
        # factor, one turning more than high_freq_factor times is kept, and the ones between are blended linearly
        turns = original * inv_freq / (2 * math.pi)  # (D/2,) turns over the original context
        keep = ((turns - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0, 1)
        return keep * inv_freq + (1 - keep) * inv_freq / factor, 1.0

    # YaRN (arXiv 2309.00071): the same blend by turns, with its ends at beta_fast and beta_slow turns located as
    # (fractional) pair indices, then cos and sin scaled up by attention_factor (their §3.4 "temperature")
    def pair_of(turns: float) -> float:
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = pair_of(scaling.beta_fast), pair_of(scaling.beta_slow)
    if scaling.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001  # as the reference code: a ramp of one pair
    stretch = ((torch.arange(head_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)  # (D/2,)
    inv_freq = stretch * inv_freq / factor + (1 - stretch) * inv_freq
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_tables(head_dim: int, max_len: int, theta: float, scaling: Any = None, context: int | None = None,
                seq_len: int | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (max_len, head_dim // 2), fp32. ``context``: the model's max_seq_len (default
    ``max_len``); ``seq_len``: see :func:`inv_frequencies`."""
    inv_freq, attention_factor = inv_frequencies(head_dim, theta, scaling, context or max_len, seq_len)  # (D/2,)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # (max_len, D/2)
    # in place: the peak stays the one train.preflight.rope_bytes counts
    return angles.cos().mul_(attention_factor).float(), angles.sin().mul_(attention_factor).float()


def rope_cos_sin(cos: Tensor, sin: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(T, D/2) tables -> (T, 1, D/2) in ``dtype``, ready to broadcast over (B, T, H, D/2); per-sequence
    tables (B, T, D/2) (left-padded batches) -> (B, T, 1, D/2)."""
    return cos.unsqueeze(-2).to(dtype), sin.unsqueeze(-2).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, T, H, D) by position; cos/sin are (T, D/2) or (B, T, D/2) rows for those positions."""
    cos, sin = rope_cos_sin(cos, sin, x.dtype)  # (T, 1, D/2) or (B, T, 1, D/2)
    x1, x2 = x.chunk(2, dim=-1)  # (B, T, H, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (B, T, H, D)
