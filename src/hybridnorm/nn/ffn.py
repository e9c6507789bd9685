"""The dense SwiGLU feed-forward: W_out( silu(x W_gate) ⊙ x W_up ), gate and up fused in one matmul."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.w_in = nn.Linear(d_model, 2 * hidden, bias=False)  # rows [gate; up]
        self.w_out = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w_in(x).chunk(2, dim=-1)  # (..., hidden) each
        return self.w_out(F.silu(gate) * up)
