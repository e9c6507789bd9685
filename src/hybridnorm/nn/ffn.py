"""The dense SwiGLU feed-forward: W_out( silu(x W_gate) ⊙ x W_up ), gate and up fused in one matmul.

The activation ``silu(gate) ⊙ up`` is one autograd Function (:func:`swiglu`): its backward writes
``d gate = silu'(gate)·up·dh`` and ``d up = silu(gate)·dh`` straight into the two halves of ONE
(..., 2·hidden) gradient, which is what the fused W_in needs, instead of autograd's separate products
and the chunk's backward ``cat``. Same kernels as autograd (``silu_backward``), same rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _SwiGLUAct(torch.autograd.Function):
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
    """silu(gate) ⊙ up for gate_up = [gate | up] along the last dim."""
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return _SwiGLUAct.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.w_in = nn.Linear(d_model, 2 * hidden, bias=False)  # rows [gate; up]
        self.w_out = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_out(swiglu(self.w_in(x)))  # (..., hidden) between the two
