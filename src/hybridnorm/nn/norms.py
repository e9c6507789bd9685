"""Norms with learnable gain, statistics in fp32 and the result cast back to the input dtype.

``N`` in every placement equation is one of these. RMSNorm is the default (the paper's); LayerNorm has
a gain and no bias ("no biases" in the paper's init); DyT (arXiv 2503.10622) is the norm-free
stand-in γ·tanh(α·x) + β. ``scale`` multiplies the output (LayerNorm Scaling's 1/√l).

RMSNorm runs as one autograd Function (``rms_norm``) instead of ``F.rms_norm``, whose CPU path is a
composite of ~8 ops forward and more backward (with upcast copies even in fp32). Same math in fp32:
r = rsqrt(mean(x²) + eps), y = (x·r)·g (mean(x²) via one ``vector_norm`` pass, so r may differ from the
composite's in the last bit); the backward is the closed form dx = r·(g_y·g − x̂·mean(g_y·g·x̂)),
dg = Σ g_y·x̂ with x̂ = x·r, and saves only x̂ (fp32) and r.
The same kernels norm the attention's Q/K/V heads in one call (``rms_norm_forward``/``rms_norm_backward``
with a gain per head, see ``hybridnorm.nn.attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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


def _acc_dtype(x: Tensor) -> torch.dtype:
    """The norm's compute dtype: fp32 for fp32/bf16/fp16 inputs (fp64 stays fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm_forward(x: Tensor, gain: Tensor, eps: float,
                     keep_xhat: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """RMSNorm over the last dim in fp32 (x of any float dtype, output cast back to x.dtype).

    Returns (y, r, x̂): r = 1/rms (fp32, keepdim) and, with ``keep_xhat``, x̂ = x·r (fp32) for the
    backward. ``gain`` broadcasts against x's trailing dims: (D,) or e.g. (heads, D). mean(x²) comes
    from one ``vector_norm`` pass (no x² temporary); a bf16 x is upcast ONCE into a private fp32 copy
    that is then scaled in place (CPU type promotion would copy x again in every mixed-dtype op).
    """
    xf = x.to(_acc_dtype(x))
    ms = torch.linalg.vector_norm(xf, 2, dim=-1, keepdim=True).square_().div_(x.shape[-1])
    rstd = ms.add_(eps).rsqrt_()
    xhat = torch.mul(xf, rstd) if xf is x else xf.mul_(rstd)
    if keep_xhat:
        return torch.mul(xhat, gain).to(x.dtype), rstd, xhat  # (x·r)·g
    return xhat.mul_(gain).to(x.dtype), rstd, None


def rms_norm_backward(grad: Tensor, xhat: Tensor, rstd: Tensor, gain: Tensor, need_dgain: bool,
                      out: Tensor | None = None, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
    """Gradients of :func:`rms_norm_forward` w.r.t. x (written into ``out`` if given, else returned in
    ``dtype``) and, if ``need_dgain``, w.r.t. gain (summed over the leading dims gain broadcast over).

    dx = r·(g_y·g − x̂·mean(g_y·g·x̂)),  dg = Σ g_y·x̂; in fp32 (x̂'s dtype), 8 full-size kernels.
    """
    gf = grad.to(xhat.dtype)
    t = gf * xhat  # g_y·x̂
    dgain = t.sum(tuple(range(t.dim() - gain.dim()))).to(gain.dtype) if need_dgain else None
    dot = t.mul_(gain).mean(-1, keepdim=True)  # mean(g_y·g·x̂)
    dx = torch.mul(xhat, dot.neg_(), out=t).addcmul_(gf, gain).mul_(rstd)  # (g_y·g − x̂·dot)·r, in t
    if out is None:
        return dx.to(dtype or xhat.dtype), dgain
    return out.copy_(dx), dgain


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, gain: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        y, rstd, xhat = rms_norm_forward(x, gain, eps, keep_xhat=True)
        ctx.save_for_backward(xhat, rstd, gain)
        ctx.dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        xhat, rstd, gain = ctx.saved_tensors
        dx, dgain = rms_norm_backward(grad, xhat, rstd, gain, ctx.needs_input_grad[1], dtype=ctx.dtype)
        return dx, dgain, None


def rms_norm(x: Tensor, gain: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim: ``F.rms_norm(x.float(), gain, eps).to(x.dtype)`` up to fp32 rounding,
    faster on CPU."""
    if torch.is_grad_enabled() and (x.requires_grad or gain.requires_grad):
        return _RMSNormFn.apply(x, gain, eps)
    return rms_norm_forward(x, gain, eps)[0]


class RMSNorm(Norm):
    """x / sqrt(mean(x²) + eps) · g."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.gain(), self.eps)


class LayerNorm(Norm):
    """(x - mean(x)) / sqrt(var(x) + eps) · g  (no bias)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x.float(), (self.dim,), self.gain(), None, self.eps).to(x.dtype)


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
        y = torch.tanh(self.alpha * x.float()) * self.gain() + self.bias * self.scale
        return y.to(x.dtype)


NORM_TYPES: dict[str, type[Norm]] = {"rms": RMSNorm, "layer": LayerNorm, "dyt": DyT}


def build_norm(kind: str, dim: int, eps: float = 1e-5, scale: float = 1.0) -> Norm:
    return NORM_TYPES[kind](dim, eps, scale)
