"""The dense SwiGLU feed-forward: W_out( silu(x W_gate) ⊙ x W_up ), gate and up fused in one matmul.

With ``ModelConfig.fast_kernels`` (the default) the activation ``silu(gate) ⊙ up`` runs as
:func:`hybridnorm.nn.kernels.swiglu`, whose backward writes the gradient of the fused W_in output in one
buffer (no chunk-backward ``cat``); same kernels and rounding as the plain line below.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from hybridnorm.nn import kernels


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int, fast: bool = True) -> None:
        super().__init__()
        self.hidden, self.fast = hidden, fast
        self.w_in = nn.Linear(d_model, 2 * hidden, bias=False)  # rows [gate; up]
        self.w_out = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.w_in(x)  # (..., 2·hidden)
        if kernels.active(self.fast):
            h = kernels.swiglu(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # (..., hidden) each
            h = F.silu(gate) * up  # (..., hidden)
        return self.w_out(h)  # (..., d_model)
