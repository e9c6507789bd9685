"""Norms with learnable gain, statistics in fp32 and the result cast back to the input dtype.

``N`` in every placement equation is one of these. RMSNorm is the default (the paper's); LayerNorm has
a gain and no bias ("no biases" in the paper's init); DyT (arXiv 2503.10622) is the norm-free
stand-in γ·tanh(α·x) + β. ``scale`` multiplies the output (LayerNorm Scaling's 1/√l).

``RMSNorm.forward`` spells out the equation; with ``ModelConfig.fast_kernels`` (the default) it runs
:func:`hybridnorm.nn.kernels.rms_norm` instead, one autograd Function with a closed-form backward (the
plain composite costs ~8 ops forward and more backward on CPU, with upcast copies even in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridnorm.nn import kernels


def _fp32(x: Tensor) -> Tensor:
    """x in the norms' compute dtype: fp32 for fp32/bf16/fp16 (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class Norm(nn.Module):
    """Base of every norm with a learnable gain (RMSNorm, LayerNorm, DyT): the optimizer and init find them by it."""

    def __init__(self, dim: int, eps: float = 1e-5, scale: float = 1.0) -> None:
        super().__init__()
        self.dim, self.eps, self.scale = dim, eps, scale
        self.weight = nn.Parameter(torch.ones(dim))

    def gain(self) -> Tensor:
        return self.weight if self.scale == 1.0 else self.weight * self.scale

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}" + (f", scale={self.scale:.4g}" if self.scale != 1.0 else "")


class RMSNorm(Norm):
    """x / sqrt(mean(x²) + eps) · g, in fp32 (fp64 stays fp64); ``fast``: :func:`hybridnorm.nn.kernels.rms_norm`."""

    def __init__(self, dim: int, eps: float = 1e-5, scale: float = 1.0, fast: bool = True) -> None:
        super().__init__(dim, eps, scale)
        self.fast = fast

    def forward(self, x: Tensor) -> Tensor:
        if kernels.active(self.fast):
            return kernels.rms_norm(x, self.gain(), self.eps)
        xf = _fp32(x)  # (..., dim)
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * self.gain()
        return y.to(x.dtype)


class LayerNorm(Norm):
    """(x - mean(x)) / sqrt(var(x) + eps) · g  (no bias)."""

    def forward(self, x: Tensor) -> Tensor:
        xf = _fp32(x)  # (..., dim)
        # the gain in the compute dtype too (exact for bf16/fp16): a model cast to bf16 keeps bf16 gains, and
        # the CPU kernel refuses an fp32 input with a bf16 weight
        return F.layer_norm(xf, (self.dim,), self.gain().to(xf.dtype), None, self.eps).to(x.dtype)


class DyT(Norm):
    """Dynamic Tanh: γ·tanh(α·x) + β, α a learnable scalar (init 0.5)."""

    def __init__(self, dim: int, eps: float = 1e-5, scale: float = 1.0, alpha0: float = 0.5) -> None:
        super().__init__(dim, eps, scale)
        self.alpha0 = alpha0
        self.alpha = nn.Parameter(torch.full((), alpha0))
        self.bias = nn.Parameter(torch.zeros(dim))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.constant_(self.alpha, self.alpha0)
        nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(self.alpha * _fp32(x)) * self.gain() + self.bias * self.scale
        return y.to(x.dtype)


NORM_TYPES: dict[str, type[Norm]] = {"rms": RMSNorm, "layer": LayerNorm, "dyt": DyT}


def build_norm(kind: str, dim: int, eps: float = 1e-5, scale: float = 1.0, fast: bool = True) -> Norm:
    """A norm of ``kind`` (see :data:`NORM_TYPES`); ``fast`` picks RMSNorm's fast kernel (the others have none)."""
    if kind == "rms":
        return RMSNorm(dim, eps, scale, fast=fast)
    return NORM_TYPES[kind](dim, eps, scale)
