"""Causal self-attention with GQA, RoPE and the attention-internal norms of HybridNorm.

Per head (``#`` the letters of ``BlockSpec.qkv_norm``)::

    MHA_#(x) = W_O · concat_h( N_C( softmax( N_Q(q_h) N_K(k_h)ᵀ / √d_h ) N_V(v_h) ) )

with each ``N_*`` present only if its letter is in ``#``. Scope ``head`` (the HybridNorm reference): each
norm acts over d_h with ONE gain of length d_h shared by all heads; with GQA, K and V are normed per KV
head; C is normed per head before the concat and before W_O. Scope ``full`` (OLMo 2): Q/K/V/C are normed
over all their heads at once. Order ``before_rope`` (reference) or ``after_rope`` places the Q/K norms
relative to the rotation. The KV cache stores keys after norm and RoPE; since RoPE rotates by absolute
position this gives the same attention as the reference's cache of pre-RoPE keys.

Fast path (same math, fewer kernels): when the Q/K/V norms are RMSNorms of scope ``head``, normed before
RoPE, and the normed letters are a contiguous run of ``QKV`` (none, Q, K, V, QK, KV or QKV: Pre-Norm,
HybridNorm, QK-norm, ...), everything between the fused projection and SDPA is one autograd Function
(:class:`_QKVPrep`): ONE RMSNorm call over the (B, T, heads, D) view of the normed heads with the per-letter
gains concatenated per head, then ONE RoPE pass over the Q and K heads together; its backward writes the
gradient of the fused projection output directly (no split/chunk/cat). Everything else (scope ``full``,
``after_rope``, LayerNorm/DyT, Q+V without K) runs the general path below. The fast path does not call
the q/k/v norm modules' ``forward`` (so module hooks on them do not fire); set ``Attention.fused_qkv =
False`` to force the general path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridnorm.nn.norms import RMSNorm, build_norm, rms_norm_backward, rms_norm_forward
from hybridnorm.nn.rope import apply_rope, rope_cos_sin, rope_into
from hybridnorm.placements.spec import BlockSpec


class KVCache:
    """Preallocated keys/values for every layer: (B, H_kv, max_len, D) each."""

    def __init__(self, n_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len
        self.pos = 0  # tokens already cached; advanced by the model after all layers ran

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = self.pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; asked to write up to {end}")
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def _has_enable_gqa() -> bool:
    try:
        q, kv = torch.zeros(1, 2, 1, 2), torch.zeros(1, 1, 1, 2)
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)  # torch >= 2.5
        return True
    except TypeError:
        return False


_ENABLE_GQA = _has_enable_gqa()


def _qkv_prep(qkv: Tensor, gain: Tensor | None, cos: Tensor, sin: Tensor, n_heads: int, n_kv_heads: int,
              lo: int, hi: int, eps: float, keep_xhat: bool = False
              ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """The fast path's forward (see :class:`_QKVPrep`): q, k, v and the norm's 1/rms and, with
    ``keep_xhat``, its x̂ (None without a norm)."""
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


class _QKVPrep(torch.autograd.Function):
    """(B, T, H + 2·Hkv, D) projection -> q, k, v (B, T, h, D): RMSNorm over the heads [lo, hi) (one
    call; ``gain`` (hi - lo, D) has one row per head), then RoPE on the H + Hkv Q/K heads in one pass.

    Forward, in the dtypes of the unfused code: the norm in fp32, its output cast back to the input
    dtype, RoPE in that dtype with cos/sin (T, 1, D/2) cast to it. q and k are views of one RoPE output,
    v a view of the normed buffer or of the input. Backward: the RoPE transpose of dq and dk and a copy
    of dv land directly in the (B, T, H + 2·Hkv, D) input gradient, or for the normed heads in a buffer
    that the norm backward then turns into their slice of it; no split/cat.
    """

    @staticmethod
    def forward(ctx, qkv: Tensor, gain: Tensor | None, cos: Tensor, sin: Tensor, n_heads: int,  # type: ignore[override]
                n_kv_heads: int, lo: int, hi: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, rstd, xhat = _qkv_prep(qkv, gain, cos, sin, n_heads, n_kv_heads, lo, hi, eps, True)
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


class Attention(nn.Module):
    # Use the fused Q/K/V norm + RoPE Function where the spec allows it (see the module docstring).
    fused_qkv: bool = True
    # Diagnostics (hybridnorm.diagnostics): when True, forward keeps what SDPA sees for the first sequence.
    probe: bool = False

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, spec: BlockSpec, norm: str,
                 eps: float, norm_scale: float = 1.0, head_dim: int | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d = head_dim or d_model // n_heads
        self.w_qkv = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * d, bias=False)  # rows [q; k; v]
        self.w_o = nn.Linear(n_heads * d, d_model, bias=False)
        self.scope, self.order = spec.qkv_norm_scope, spec.qkv_norm_order

        def maybe(letter: str, heads: int) -> nn.Module | None:
            if not spec.norms(letter):
                return None
            return build_norm(norm, d if self.scope == "head" else heads * d, eps, norm_scale)

        self.q_norm = maybe("Q", n_heads)
        self.k_norm = maybe("K", n_kv_heads)
        self.v_norm = maybe("V", n_kv_heads)
        self.c_norm = maybe("C", n_heads)

        # The fast path's normed head range [lo, hi) of the (H + 2Hkv)-head projection, or None.
        letters = "".join(c for c in "QKV" if spec.norms(c))
        self._fused_range: tuple[int, int] | None = None
        if not letters:
            self._fused_range = (0, 0)
        elif (norm == "rms" and self.scope == "head" and letters in ("Q", "K", "V", "QK", "KV", "QKV")
              and (self.order == "before_rope" or letters == "V")):
            bounds = {"Q": (0, n_heads), "K": (n_heads, n_heads + n_kv_heads),
                      "V": (n_heads + n_kv_heads, n_heads + 2 * n_kv_heads)}
            self._fused_range = (bounds[letters[0]][0], bounds[letters[-1]][1])

    def _fused_gain(self) -> Tensor | None:
        """The per-head gain rows (hi - lo, D) of the fast path: each letter's gain once per its head."""
        parts = [(m, h) for m, h in ((self.q_norm, self.n_heads), (self.k_norm, self.n_kv_heads),
                                     (self.v_norm, self.n_kv_heads)) if m is not None]
        if not parts:
            return None
        return torch.cat([m.gain().expand(h, self.head_dim) for m, h in parts])

    def _can_fuse(self) -> bool:
        if not self.fused_qkv or self._fused_range is None:
            return False
        norms = [m for m in (self.q_norm, self.k_norm, self.v_norm) if m is not None]
        return all(type(m) is RMSNorm for m in norms) and len({m.eps for m in norms}) <= 1

    def _qk_norms(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        if self.q_norm is not None:
            q = self._norm(self.q_norm, q)
        if self.k_norm is not None:
            k = self._norm(self.k_norm, k)
        return q, k

    def _norm(self, norm: nn.Module, x: Tensor) -> Tensor:
        """Norm x (B, T, h, D) per head, or over all h·D features for scope ``full``."""
        if self.scope == "head":
            return norm(x)
        return norm(x.flatten(-2)).view_as(x)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None,
                layer: int = 0, mask: Tensor | None = None) -> Tensor:
        """``mask`` (B, 1, T, S) bool, True = may attend, replaces the causal rule when given (padded
        batches, see :meth:`TransformerLM.forward`); S counts the cached keys too."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.w_qkv(x).view(B, T, H + 2 * Hkv, D)
        if self._can_fuse():
            lo, hi = self._fused_range
            gain = self._fused_gain()
            eps = next((m.eps for m in (self.q_norm, self.k_norm, self.v_norm) if m is not None), 0.0)
            c, s = rope_cos_sin(cos, sin, qkv.dtype)
            args = (qkv, gain, c, s, H, Hkv, lo, hi, eps)
            if torch.is_grad_enabled() and (qkv.requires_grad or (gain is not None and gain.requires_grad)):
                q, k, v = _QKVPrep.apply(*args)  # (B, T, h, D) each
            else:
                q, k, v, _, _ = _qkv_prep(*args)
        else:
            q, k, v = qkv.split((H, Hkv, Hkv), dim=2)  # (B, T, h, D)
            if self.v_norm is not None:
                v = self._norm(self.v_norm, v)
            if self.order == "before_rope":
                q, k = self._qk_norms(q, k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if self.order == "after_rope":
                q, k = self._qk_norms(q, k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, h, T, D)
        if self.probe:  # q (1, H, T, D), k (1, Hkv, T, D) exactly as they enter SDPA
            self.probed = (q[:1].detach(), k[:1].detach())

        start = 0
        if cache is not None:
            start = cache.pos
            k, v = cache.update(layer, k, v)  # (B, Hkv, start + T, D)
        causal = mask is None and start == 0 and T > 1
        if mask is None and start > 0 and T > 1:  # a chunk after a cached prefix: query i sees keys <= start + i
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
        if Hkv != H and not _ENABLE_GQA:
            k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
        kw = {"enable_gqa": True} if Hkv != H and _ENABLE_GQA else {}
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **kw)  # (B, H, T, D)
        y = y.transpose(1, 2)  # (B, T, H, D)
        if self.c_norm is not None:
            y = self._norm(self.c_norm, y)
        return self.w_o(y.reshape(B, T, H * D))
