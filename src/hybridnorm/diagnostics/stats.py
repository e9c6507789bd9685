"""The statistics behind the diagnostics, as plain functions of tensors (0-dim tensor results, no host sync).

Every function runs in fp32 with autocast off and without autograd, so calling one inside a forward hook
of a bf16-autocast training step neither changes the step's numerics nor records anything for backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

# At most this many tokens of the first sequence enter the pairwise cosine: a fixed-size sample keeps it
# cheap and comparable across sequence lengths.
COS_SIM_TOKENS = 256
# Logits per block of attention_stats (16 MiB of fp32): T = 4096 with 16 heads takes 64 blocks of 64 queries.
ATTN_CHUNK_ELEMENTS = 1 << 22


def _fp32(x: Tensor) -> Tensor:
    return x.detach().float()


@torch.no_grad()
def activation_stats(x: Tensor) -> dict[str, Tensor]:
    """Statistics of a residual stream x (B, T, d) over ALL its elements:

    ``rms``       sqrt(mean(x²))
    ``max_abs``   max |x|
    ``kurtosis``  excess kurtosis E[(x − μ)⁴] / σ⁴ − 3 (0 for a Gaussian, −1.2 uniform, 3 Laplace;
                  large values mean a few huge activations — outlier features / massive activations)
    ``cos_sim``   see :func:`token_cosine`
    """
    with torch.autocast(x.device.type, enabled=False):
        xf = _fp32(x)
        max_abs = torch.linalg.vector_norm(xf, ord=math.inf)
        mean = xf.mean()
        c2 = (xf - mean).square_()  # (x − μ)², one temporary reused for the 4th power
        var = c2.mean()
        fourth = c2.square_().mean()
        rms = (var + mean.square()).sqrt()  # mean(x²) = σ² + μ²: no extra pass over x
        kurtosis = fourth / var.square().clamp_min(torch.finfo(torch.float32).tiny) - 3.0
        return {"rms": rms, "max_abs": max_abs, "kurtosis": kurtosis, "cos_sim": token_cosine(xf)}


@torch.no_grad()
def token_cosine(x: Tensor, max_tokens: int = COS_SIM_TOKENS) -> Tensor:
    """Mean cosine similarity over all pairs i ≠ j of token vectors of the FIRST sequence of x (B, T, d),
    on at most ``max_tokens`` evenly spaced positions: 1 when every token carries the same direction
    (representation collapse), about 0 for unrelated tokens. Deterministic (no RNG is drawn)."""
    with torch.autocast(x.device.type, enabled=False):
        seq = _fp32(x[0])  # (T, d)
        T = seq.shape[0]
        if T > max_tokens:
            seq = seq[torch.linspace(0, T - 1, max_tokens, device=seq.device).round().long()]
        n = seq.shape[0]
        if n < 2:
            return torch.full((), math.nan, device=x.device)
        u = F.normalize(seq, dim=-1)  # (n, d); a zero token stays zero and pairs with nothing
        # sum over all ordered pairs of u_i·u_j = ‖Σ u_i‖²; remove the n diagonal terms ‖u_i‖²
        off_diag = u.sum(0).square().sum() - u.square().sum()
        return off_diag / (n * (n - 1))


@torch.no_grad()
def attention_stats(q: Tensor, k: Tensor, max_elements: int = ATTN_CHUNK_ELEMENTS) -> dict[str, Tensor]:
    """Max causal attention logit and mean attention entropy (nats) of ONE sequence.

    q (1, H, T, D) and k (1, Hkv, T, D) exactly as they enter SDPA (after the Q/K norms and RoPE); with
    GQA (Hkv < H) query head h reads KV head h // (H / Hkv). Logits are q·kᵀ/√D on the causal triangle;
    ``max_logit`` is their maximum over heads and positions, ``entropy`` the entropy of each query's
    softmax averaged over heads and query positions (query 0 sees one key: entropy 0). All heads go at
    once, in blocks of query rows of at most ``max_elements`` logits: few kernels, bounded memory.
    """
    with torch.autocast(q.device.type, enabled=False):
        q, k = _fp32(q[0]), _fp32(k[0])  # (H, T, D), (Hkv, T, D)
        H, T, D = q.shape
        k = k.repeat_interleave(H // k.shape[0], dim=0) if k.shape[0] != H else k  # (H, T, D)
        rows = max(1, max_elements // (H * T))
        pos = torch.arange(T, device=q.device)
        max_logit = torch.full((), -math.inf, device=q.device)
        entropy = torch.zeros((), device=q.device)
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)  # queries [r0, r1) see keys [0, r1) at most
            logits = torch.matmul(q[:, r0:r1], k[:, :r1].transpose(1, 2)).mul_(1 / math.sqrt(D))  # (H, R, r1)
            logits.masked_fill_(pos[None, :r1] > pos[r0:r1, None], -math.inf)  # key after query
            max_logit = torch.maximum(max_logit, logits.amax())
            p = logits.softmax(dim=-1)
            entropy = entropy - torch.special.xlogy(p, p).sum()  # p log p, 0 where p = 0 (masked keys)
        return {"max_logit": max_logit, "entropy": entropy / (H * T)}


@torch.no_grad()
def expert_load_stats(counts: Tensor) -> dict[str, Tensor]:
    """Load of E experts from their assignment counts (E,): ``max`` / ``min`` fraction of the assignments
    (1/E each when balanced) and ``cv``, the coefficient of variation std/mean of the fractions
    (population std; 0 when balanced, sqrt(E − 1) when one expert takes everything)."""
    frac = counts.detach().double() / counts.sum().clamp_min(1)
    return {"max": frac.max().float(), "min": frac.min().float(),
            "cv": (frac.std(correction=0) / frac.mean()).float()}
