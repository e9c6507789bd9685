"""The elementwise kernels of a block: RMSNorm, RoPE and the SwiGLU activation (see :mod:`hybridnorm.nn.kernels`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridnorm.nn.kernels.common import acc_dtype, needs_grad
from hybridnorm.nn.rope import apply_rope, rope_cos_sin

# -- RMSNorm -----------------------------------------------------------------------------------------------

def rms_norm_forward(x: Tensor, gain: Tensor, eps: float,
                     keep_xhat: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """RMSNorm over the last dim in fp32 (x of any float dtype, output cast back to x.dtype).

    Returns (y, r, x̂): r = 1/rms (fp32, keepdim) and, with ``keep_xhat``, x̂ = x·r (fp32) for the
    backward. ``gain`` broadcasts against x's trailing dims: (D,) or e.g. (heads, D). mean(x²) comes
    from one ``vector_norm`` pass (no x² temporary, so r may differ from the plain twin's in the last
    bit); a bf16 x is upcast ONCE into a private fp32 copy that is then scaled in place (CPU type
    promotion would copy x again in every mixed-dtype op).
    """
    xf = x.to(acc_dtype(x))
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


class RMSNormFn(torch.autograd.Function):
    """y = x·r·g with r = 1/sqrt(mean(x²) + eps) over the last dim, in fp32, cast back to x's dtype.

    Plain twin: ``RMSNorm.forward`` with ``fast=False`` (``hybridnorm.nn.norms``). Instead of autograd's
    composite it saves only x̂ (fp32) and r and runs the closed-form backward :func:`rms_norm_backward`.
    ``gain`` (D,) or (heads, D) broadcasts over x's leading dims; its gradient is computed only when needed.
    """

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
    """RMSNorm over the last dim (see :class:`RMSNormFn`)."""
    if needs_grad(x, gain):
        return RMSNormFn.apply(x, gain, eps)
    return rms_norm_forward(x, gain, eps)[0]


# -- RoPE --------------------------------------------------------------------------------------------------

def rope_into(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor, inverse: bool = False) -> Tensor:
    """Write rope(x) (or, with ``inverse``, its transpose = the backward) into ``out`` and return it.

    x, out: (B, T, H, D) of one dtype, any strides, ``out`` must not overlap x; cos/sin: (T, 1, D/2) or
    (B, T, 1, D/2) in that dtype (a differing ``out`` dtype would cost CPU type promotion a temporary and a
    copy per op). Four elementwise kernels, no chunk/neg/cat temporaries.
    """
    h = x.shape[-1] // 2
    x1, x2, o1, o2 = x[..., :h], x[..., h:], out[..., :h], out[..., h:]
    sign = -1 if inverse else 1
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-sign)  # x1·c − x2·s   (inverse: g1·c + g2·s)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin, value=sign)   # x2·c + x1·s   (inverse: g2·c − g1·s)
    return out


class RopeFn(torch.autograd.Function):
    """rope(x) = [x1·c − x2·s | x2·c + x1·s] for x (B, T, H, D), cos/sin (T, 1, D/2) in x's dtype.

    Plain twin: :func:`hybridnorm.nn.rope.apply_rope`. RoPE is linear in x, so the backward is the
    transposed rotation ``[g1·c + g2·s | g2·c − g1·s]`` (:func:`rope_into` with ``inverse``) and saves no
    activations. The tables get no gradient (they are buffers; :func:`rope` sends learned ones to the twin).
    """

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return rope_into(x, cos, sin, torch.empty(x.shape, dtype=x.dtype, device=x.device))

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return rope_into(g, cos, sin, torch.empty(g.shape, dtype=g.dtype, device=g.device), inverse=True), None, None


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`~hybridnorm.nn.rope.apply_rope` through :class:`RopeFn`: x (B, T, H, D), tables (T, D/2) or
    (B, T, D/2)."""
    if cos.requires_grad or sin.requires_grad:  # learned tables: let autograd differentiate them too
        return apply_rope(x, cos, sin)
    cos, sin = rope_cos_sin(cos, sin, x.dtype)  # (T, 1, D/2) or (B, T, 1, D/2)
    if needs_grad(x):
        return RopeFn.apply(x, cos, sin)
    return rope_into(x, cos, sin, torch.empty(x.shape, dtype=x.dtype, device=x.device))


# -- SwiGLU ------------------------------------------------------------------------------------------------

class SwiGLUFn(torch.autograd.Function):
    """silu(gate) ⊙ up for gate_up = [gate | up] along the last dim.

    Plain twin: ``gate, up = gate_up.chunk(2, -1); F.silu(gate) * up`` in ``SwiGLU.forward``
    (``hybridnorm.nn.ffn``). The backward writes ``d gate = silu'(gate)·up·dh`` and ``d up = silu(gate)·dh``
    straight into the two halves of ONE (..., 2·hidden) gradient, which is what the fused W_in needs,
    instead of autograd's separate products and the chunk's backward ``cat``. Same kernels as autograd
    (``silu_backward``), same rounding.
    """

    @staticmethod
    def forward(ctx, gate_up: Tensor) -> Tensor:  # type: ignore[override]
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(gate_up, act)
        return act * up

    @staticmethod
    def backward(ctx, dh: Tensor) -> Tensor:  # type: ignore[override]
        gate_up, act = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
        d_gate, d_up = grad.chunk(2, dim=-1)
        torch.mul(dh, up, out=d_gate)  # d act
        torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)
        torch.mul(dh, act, out=d_up)
        return grad


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(gate) ⊙ up for gate_up = [gate | up] along the last dim (see :class:`SwiGLUFn`)."""
    if needs_grad(gate_up):
        return SwiGLUFn.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

