"""Causal self-attention with GQA, RoPE and the attention-internal norms of HybridNorm.

Per head (``#`` the letters of ``BlockSpec.qkv_norm``)::

    MHA_#(x) = W_O · concat_h( N_C( softmax( N_Q(q_h) N_K(k_h)ᵀ / √d_h ) N_V(v_h) ) )

with each ``N_*`` present only if its letter is in ``#``. Scope ``head`` (the HybridNorm reference): each
norm acts over d_h with ONE gain of length d_h shared by all heads; with GQA, K and V are normed per KV
head; C is normed per head before the concat and before W_O. Scope ``full`` (OLMo 2): Q/K/V/C are normed
over all their heads at once. Order ``before_rope`` (reference) or ``after_rope`` places the Q/K norms
relative to the rotation. The KV cache stores keys after norm and RoPE; since RoPE rotates by absolute
position this gives the same attention as the reference's cache of pre-RoPE keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridnorm.nn.norms import build_norm
from hybridnorm.nn.rope import apply_rope
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


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, spec: BlockSpec, norm: str,
                 eps: float, norm_scale: float = 1.0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d = d_model // n_heads
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
                layer: int = 0) -> Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.w_qkv(x).view(B, T, H + 2 * Hkv, D)
        q, k, v = qkv.split((H, Hkv, Hkv), dim=2)  # (B, T, h, D)
        if self.v_norm is not None:
            v = self._norm(self.v_norm, v)
        if self.order == "before_rope":
            q, k = self._qk_norms(q, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.order == "after_rope":
            q, k = self._qk_norms(q, k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, h, T, D)

        start = 0
        if cache is not None:
            start = cache.pos
            k, v = cache.update(layer, k, v)  # (B, Hkv, start + T, D)
        mask, causal = None, start == 0 and T > 1
        if start > 0 and T > 1:  # a chunk after a cached prefix: query i sees keys <= start + i
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
        if Hkv != H and not _ENABLE_GQA:
            k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
        kw = {"enable_gqa": True} if Hkv != H and _ENABLE_GQA else {}
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **kw)  # (B, H, T, D)
        y = y.transpose(1, 2)  # (B, T, H, D)
        if self.c_norm is not None:
            y = self._norm(self.c_norm, y)
        return self.w_o(y.reshape(B, T, H * D))
