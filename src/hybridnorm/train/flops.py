"""Model FLOPs per token and the machine's measured matmul peak, for throughput and MFU.

Training FLOPs per token (PaLM appendix B, causal attention counted once):

    6 · N_matmul  +  6 · L · d · T

N_matmul is every weight that takes part in a matmul for a token: all block weights (for MoE only the
top-k experts' share) plus the LM head (a tied head still multiplies), but not the embedding lookup. The
attention term is QKᵀ and AV: 2 matmuls × 2 FLOPs × (T/2 keys on average under the causal mask) × d,
times 3 for forward + backward (here d = n_heads · head_dim: d_model unless ``attn_head_dim`` is set).
MFU = achieved FLOP/s ÷ the peak measured here with a large matmul in
the run's precision — a peak measured on this machine, not a datasheet number.
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn


def matmul_params(model: nn.Module) -> int:
    cfg = model.config
    n = model.num_params(active=True, exclude_embeddings=True)
    return n + cfg.embedding_size * cfg.d_model  # the head's matmul (tied or not)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    cfg = model.config
    return 6.0 * matmul_params(model) + 6.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


@functools.lru_cache(maxsize=8)
def measured_peak_flops(device: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 2048,
                        reps: int = 5) -> float:
    """Best-of-``reps`` FLOP/s of an n×n @ n×n matmul on ``device`` in ``dtype``."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    a @ b  # warm-up: thread pools, kernels
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best
