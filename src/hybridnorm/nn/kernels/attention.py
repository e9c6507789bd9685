"""The attention's kernels: Q/K/V norms + RoPE in one Function, and bf16 SDPA on CPU run in fp32 (see
:mod:`hybridnorm.nn.kernels`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridnorm.nn.kernels.common import needs_grad
from hybridnorm.nn.kernels.elementwise import rms_norm_backward, rms_norm_forward, rope_into
from hybridnorm.nn.rope import rope_cos_sin

# -- the attention's Q/K/V norms + RoPE in one Function ----------------------------------------------------

def fused_qkv_range(letters: str, n_heads: int, n_kv_heads: int) -> tuple[int, int] | None:
    """The heads [lo, hi) of the (H + 2·Hkv)-head projection that :class:`QKVPrep` norms for the normed
    ``letters`` (a subset of "QKV" in that order), or None when they are not a contiguous run of Q, K, V
    (Q and V without K). (0, 0): no norm, RoPE only."""
    bounds = {"Q": (0, n_heads), "K": (n_heads, n_heads + n_kv_heads),
              "V": (n_heads + n_kv_heads, n_heads + 2 * n_kv_heads)}
    if not letters:
        return (0, 0)
    if letters not in ("Q", "K", "V", "QK", "KV", "QKV"):
        return None
    return bounds[letters[0]][0], bounds[letters[-1]][1]


def qkv_prep_forward(qkv: Tensor, gain: Tensor | None, cos: Tensor, sin: Tensor, n_heads: int, n_kv_heads: int,
                     lo: int, hi: int, eps: float, keep_xhat: bool = False
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """The forward of :class:`QKVPrep`: q, k, v and the norm's 1/rms and, with ``keep_xhat``, its x̂
    (None without a norm)."""
    H, Hqk = n_heads, n_heads + n_kv_heads
    src, rstd, xhat = qkv, None, None
    if hi > lo:
        normed, rstd, xhat = rms_norm_forward(qkv[:, :, lo:hi], gain, eps, keep_xhat)  # (B, T, hi - lo, D)
        if (lo, hi) == (0, qkv.shape[2]):
            src = normed

    def heads(a: int, b: int) -> Tensor:  # heads [a, b) after the norm, as a view
        if src is qkv and lo <= a and b <= hi:
            return normed[:, :, a - lo:b - lo]
        return src[:, :, a:b]

    B, T, _, D = qkv.shape
    qk = torch.empty((B, T, Hqk, D), dtype=qkv.dtype, device=qkv.device)
    if (lo <= 0 and H <= hi) == (lo <= H and Hqk <= hi):  # Q and K both normed or both not: one pass
        rope_into(heads(0, Hqk), cos, sin, qk)
    else:
        rope_into(heads(0, H), cos, sin, qk[:, :, :H])
        rope_into(heads(H, Hqk), cos, sin, qk[:, :, H:])
    return qk[:, :, :H], qk[:, :, H:], heads(Hqk, Hqk + n_kv_heads), rstd, xhat


class QKVPrep(torch.autograd.Function):
    """(B, T, H + 2·Hkv, D) projection -> q, k, v (B, T, h, D): RMSNorm over the heads [lo, hi) (one
    call; ``gain`` (hi - lo, D) has one row per head), then RoPE on the H + Hkv Q/K heads in one pass.

    Plain twin: in ``Attention.forward`` (``hybridnorm.nn.attention``) the lines ``q, k, v = qkv.split(...)``,
    the V norm, the Q/K norms before RoPE and ``apply_rope`` of q and k, for RMSNorms of scope ``head``
    whose letters form a contiguous run of QKV (see :func:`fused_qkv_range`).

    Forward, in the dtypes of the plain code: the norm in fp32, its output cast back to the input dtype,
    RoPE in that dtype with cos/sin (T, 1, D/2) cast to it. q and k are views of one RoPE output, v a view
    of the normed buffer or of the input. Backward: the RoPE transpose of dq and dk and a copy of dv land
    directly in the (B, T, H + 2·Hkv, D) input gradient, or for the normed heads in a buffer that the norm
    backward then turns into their slice of it; no split/cat.
    """

    @staticmethod
    def forward(ctx, qkv: Tensor, gain: Tensor | None, cos: Tensor, sin: Tensor, n_heads: int,  # type: ignore[override]
                n_kv_heads: int, lo: int, hi: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, rstd, xhat = qkv_prep_forward(qkv, gain, cos, sin, n_heads, n_kv_heads, lo, hi, eps, True)
        ctx.save_for_backward(xhat, rstd, gain, cos, sin)
        ctx.meta = (qkv.shape, qkv.dtype, n_heads, n_kv_heads, lo, hi)
        return q, k, v

    @staticmethod
    def backward(ctx, dq: Tensor | None, dk: Tensor | None, dv: Tensor | None):  # type: ignore[override]
        xhat, rstd, gain, cos, sin = ctx.saved_tensors
        shape, dtype, H, Hkv, lo, hi = ctx.meta
        Hqk = H + Hkv
        dqkv = torch.empty(shape, dtype=dtype, device=cos.device)
        # gradient w.r.t. the norm output (in its dtype, as autograd would have it)
        gnorm = torch.empty((*shape[:2], hi - lo, shape[3]), dtype=dtype, device=cos.device) if hi > lo else None

        def dest(a: int, b: int) -> Tensor:
            if gnorm is not None and lo <= a and b <= hi:
                return gnorm[:, :, a - lo:b - lo]
            return dqkv[:, :, a:b]

        for g, (a, b) in ((dq, (0, H)), (dk, (H, Hqk))):
            if g is None:
                dest(a, b).zero_()
            else:
                rope_into(g, cos, sin, dest(a, b), inverse=True)
        if dv is None:
            dest(Hqk, Hqk + Hkv).zero_()
        else:
            dest(Hqk, Hqk + Hkv).copy_(dv)
        dgain = None
        if gnorm is not None:
            _, dgain = rms_norm_backward(gnorm, xhat, rstd, gain, ctx.needs_input_grad[1], out=dqkv[:, :, lo:hi])
        return dqkv, dgain, None, None, None, None, None, None, None


def fused_qkv(qkv: Tensor, gain: Tensor | None, cos: Tensor, sin: Tensor, n_heads: int, n_kv_heads: int,
              lo: int, hi: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (B, T, h, D) from the (B, T, H + 2·Hkv, D) projection (see :class:`QKVPrep`); cos/sin are
    the (T, D/2) or (B, T, D/2) RoPE rows of these positions."""
    c, s = rope_cos_sin(cos, sin, qkv.dtype)
    args = (qkv, gain, c, s, n_heads, n_kv_heads, lo, hi, eps)
    if needs_grad(qkv, gain):
        return QKVPrep.apply(*args)
    return qkv_prep_forward(*args)[:3]


# -- attention: low-precision SDPA on CPU at small head dims ----------------------------------------------

UPCAST_ATTENTION_BELOW_HEAD_DIM = 64


def upcasts_attention(q: Tensor) -> bool:
    """Whether :func:`sdpa_in_fp32` is the faster kernel for ``q`` (B, H, T, D): a bf16/fp16 q on CPU with
    D < 64. There torch's flash-for-CPU backward in bf16 measured 1.3-2.5x slower than the same kernel in
    fp32 plus the casts (benchmarks/README.md); from D = 64 the bf16 kernel is as fast or faster."""
    return (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] < UPCAST_ATTENTION_BELOW_HEAD_DIM)


def sdpa_in_fp32(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """softmax(q kᵀ/√D + mask) v computed in fp32 (fp64 stays fp64), returned in q's dtype; gradients flow
    back through the casts in the inputs' dtypes. Plain twin: ``F.scaled_dot_product_attention`` on the
    inputs as they are (``SDPA.forward`` with ``fast=False``); the flash-for-CPU kernel accumulates a bf16
    input in fp32 too, so the two differ only by the rounding of the scores and of the backward's
    intermediates."""
    wide = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast("cpu", enabled=False):  # keep autocast from casting the fp32 copies back down
        y = F.scaled_dot_product_attention(q.to(wide), k.to(wide), v.to(wide), attn_mask=mask, is_causal=causal,
                                           enable_gqa=k.shape[1] != q.shape[1])
    return y.to(q.dtype)
