"""What every fast kernel shares: when the kernels run, and the compute dtype of their fp32 work."""

from __future__ import annotations

import torch
from torch import Tensor


def active(fast: bool) -> bool:
    """Whether a module built with ``fast`` (``ModelConfig.fast_kernels``) runs its kernel now: not while
    torch.compile traces it (see the module docstring), where the plain twin is the faster code."""
    return fast and not torch.compiler.is_compiling()


def needs_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def acc_dtype(x: Tensor) -> torch.dtype:
    """The compute dtype of the norms and the loss: fp32 for fp32/bf16/fp16 inputs (fp64 stays fp64)."""
    return torch.promote_types(x.dtype, torch.float32)
