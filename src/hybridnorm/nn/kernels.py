"""The fast kernels: hand-written autograd Functions for the model's hot elementwise work, all in this file.

Each one computes exactly what a few lines of plain PyTorch in its module compute (its *plain twin*, named
in its docstring), with fewer kernels and fewer temporaries on CPU. ``ModelConfig.fast_kernels`` (default
true) picks them; ``fast_kernels=False`` runs the plain twins, which are the readable definition and what
the tests compare these against (``tests/nn/test_kernels.py``: gradcheck of every Function in float64,
and fast vs plain logits and gradients for every placement).

=====================  ====================================================================================
``rms_norm``           :class:`RMSNormFn`; twin ``RMSNorm.forward`` (``hybridnorm.nn.norms``)
``rope``               :class:`RopeFn`; twin :func:`hybridnorm.nn.rope.apply_rope`
``swiglu``             :class:`SwiGLUFn`; twin the ``silu(gate) * up`` line of ``SwiGLU.forward`` (``nn.ffn``)
``fused_qkv``          :class:`QKVPrep`; twin the split / Q-K-V norms / RoPE lines of ``Attention.forward``
``sdpa_in_fp32``       bf16 attention on CPU at head dim < 64 in fp32; twin ``SDPA.forward`` (``nn.attention``)
``cross_entropy``      :class:`CrossEntropyFn`; twin ``lm_loss(..., fast=False)`` (``hybridnorm.nn.model``)
=====================  ====================================================================================

Without autograd (``torch.no_grad()`` or inputs that need no gradient) each entry point runs the same
forward helper without the Function (nothing is saved for backward).

Under ``torch.compile`` the modules run their plain twins instead (:func:`active`): the compiler fuses the
plain elementwise math itself, and these Functions' ``out=`` writes into strided views would break its graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridnorm.nn.rope import apply_rope, rope_cos_sin


def active(fast: bool) -> bool:
    """Whether a module built with ``fast`` (``ModelConfig.fast_kernels``) runs its kernel now: not while
    torch.compile traces it (see the module docstring), where the plain twin is the faster code."""
    return fast and not torch.compiler.is_compiling()


def _needs_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# -- RMSNorm -----------------------------------------------------------------------------------------------

def _acc_dtype(x: Tensor) -> torch.dtype:
    """The norm's compute dtype: fp32 for fp32/bf16/fp16 inputs (fp64 stays fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm_forward(x: Tensor, gain: Tensor, eps: float,
                     keep_xhat: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """RMSNorm over the last dim in fp32 (x of any float dtype, output cast back to x.dtype).

    Returns (y, r, x̂): r = 1/rms (fp32, keepdim) and, with ``keep_xhat``, x̂ = x·r (fp32) for the
    backward. ``gain`` broadcasts against x's trailing dims: (D,) or e.g. (heads, D). mean(x²) comes
    from one ``vector_norm`` pass (no x² temporary, so r may differ from the plain twin's in the last
    bit); a bf16 x is upcast ONCE into a private fp32 copy that is then scaled in place (CPU type
    promotion would copy x again in every mixed-dtype op).
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
    if _needs_grad(x, gain):
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
    if _needs_grad(x):
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
    if _needs_grad(gate_up):
        return SwiGLUFn.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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
    if _needs_grad(qkv, gain):
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


# -- cross-entropy: the LM loss without an fp32 log-softmax of every logit -------------------------------

CE_CHUNK_ELEMENTS = 2**21  # rows per chunk x vocab: one fp32 chunk of 8 MiB stays in cache-friendly sizes


def _ce_rows(targets: Tensor, ignore_index: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(valid (N,) 0/1 in ``dtype``, targets clamped into range (N, 1), count of valid rows, 0-d ``dtype``)."""
    valid = targets.ne(ignore_index)
    return valid.to(dtype), torch.where(valid, targets, 0)[:, None], valid.sum().to(dtype)


def _ce_chunks(logits: Tensor) -> range:
    """The first row of each chunk of ~CE_CHUNK_ELEMENTS elements of logits (N, V); ``.step`` rows each."""
    return range(0, logits.shape[0], max(1, CE_CHUNK_ELEMENTS // logits.shape[1]))


class CrossEntropyFn(torch.autograd.Function):
    """Mean of −log softmax(logits)[target] over the rows whose target is not ``ignore_index``, in fp32 for
    fp32/bf16/fp16 logits (fp64 stays fp64). Plain twin: ``F.cross_entropy`` on the logits in that dtype
    (``hybridnorm.nn.model.lm_loss`` with ``fast=False``).

    Where the twin makes full-size fp32 copies and log-softmaxes, this saves the logits as they are and the
    row logsumexp, and goes through ~8 MiB fp32 chunks of rows: a logsumexp each forward, (softmax − onehot)·w
    each backward, written into the gradient. 1.3-3x faster on CPU (benchmarks/README.md); no host sync."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:  # type: ignore[override]
        loss, lse = cross_entropy_forward(logits, targets, ignore_index)
        ctx.save_for_backward(logits, targets, lse)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, targets, lse = ctx.saved_tensors
        acc = lse.dtype
        valid, tgt, count = _ce_rows(targets, ctx.ignore_index, acc)
        weight = valid.mul_(grad.to(acc) / count)  # (N,) d loss / d row: g / count, 0 if ignored
        out = torch.empty_like(logits)
        chunks = _ce_chunks(logits)
        for s in chunks:
            rows = slice(s, s + chunks.step)
            w = weight[rows, None]  # (n, 1)
            p = logits[rows].to(acc, copy=True).sub_(lse[rows, None]).exp_().mul_(w)  # softmax·w, (n, V)
            out[rows] = p.scatter_add_(1, tgt[rows], w.neg())  # − onehot·w
        return out, None, None


def cross_entropy_forward(logits: Tensor, targets: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(mean loss, per-row logsumexp (N,) in the compute dtype) of :class:`CrossEntropyFn`; logits (N, V)."""
    acc = _acc_dtype(logits)
    valid, tgt, count = _ce_rows(targets, ignore_index, acc)
    lse = torch.empty(logits.shape[0], dtype=acc, device=logits.device)
    chunks = _ce_chunks(logits)
    for s in chunks:
        rows = slice(s, s + chunks.step)
        torch.logsumexp(logits[rows].to(acc), -1, out=lse[rows])
    picked = logits.gather(1, tgt).squeeze(1).to(acc)  # (N,) the target's logit
    return ((lse - picked) * valid).sum() / count, lse


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of logits (N, V) against targets (N,) (see :class:`CrossEntropyFn`)."""
    if _needs_grad(logits):
        return CrossEntropyFn.apply(logits, targets, ignore_index)
    return cross_entropy_forward(logits, targets, ignore_index)[0]
