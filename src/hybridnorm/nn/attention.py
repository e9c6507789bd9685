"""Causal self-attention with GQA, RoPE and the attention-internal norms of HybridNorm.

Per head (``#`` the letters of ``BlockSpec.qkv_norm``)::

    MHA_#(x) = W_O · concat_h( N_C( softmax( N_Q(q_h) N_K(k_h)ᵀ / √d_h ) N_V(v_h) ) )

with each ``N_*`` present only if its letter is in ``#``. Scope ``head`` (the HybridNorm reference): each
norm acts over d_h with ONE gain of length d_h shared by all heads; with GQA, K and V are normed per KV
head; C is normed per head before the concat and before W_O. Scope ``full`` (OLMo 2): Q/K/V/C are normed
over all their heads at once. Order ``before_rope`` (reference) or ``after_rope`` places the Q/K norms
relative to the rotation. The KV cache stores keys after norm and RoPE; since RoPE rotates by absolute
position this gives the same attention as the reference's cache of pre-RoPE keys.

The attention kernel softmax(q kᵀ/√d_h + mask) v is the parameter-free module :class:`SDPA`
(``Attention.inner``, torchtitan's "inner attention"): a forward (pre-)hook on it sees q (B, H, T, D) and
k, v (B, Hkv, S, D) exactly as they enter ``scaled_dot_product_attention``.

Fast kernels (``ModelConfig.fast_kernels``, the default; see :mod:`hybridnorm.nn.kernels`): RoPE runs as
``kernels.rope``, and where the Q/K/V norms are RMSNorms of scope ``head`` normed before RoPE whose letters
are a contiguous run of ``QKV`` (none, Q, K, V, QK, KV or QKV: Pre-Norm, HybridNorm, QK-norm, ...), the
lines from the split to RoPE run as ONE autograd Function (``kernels.QKVPrep``: one RMSNorm call over all
normed heads, one RoPE pass, a backward that writes the projection's gradient directly). That Function does
not call the q/k/v norm modules, so it is taken only while none of them has a hook or a replaced forward
(accelerate's offloading) and no global module hook is registered; otherwise the same math runs through
the modules (and their hooks fire).
"""

from __future__ import annotations

import contextlib
import typing
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from hybridnorm.nn import kernels
from hybridnorm.nn.norms import RMSNorm, build_norm
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

    def keep_rows(self, rows: Tensor) -> None:
        """Keep only the batch rows ``rows`` (1-d indices, in that order): a batch whose finished rows leave."""
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def has_hooks(*modules: nn.Module) -> bool:
    """Whether calling any of ``modules`` would run more than its class's forward: its own forward /
    pre-forward / backward hooks, a global module hook (the test ``nn.Module.__call__`` makes before skipping
    its hook machinery), or a ``forward`` replaced on the instance — how accelerate attaches its hooks
    (``device_map`` offloading loads a module's weights only inside its forward, leaving them on the meta
    device elsewhere, where a kernel reading them would compute with garbage)."""
    return (any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                or "forward" in vars(m) for m in modules)
            or any(getattr(torch_module, name, None) for name in _GLOBAL_HOOKS))


# TrainConfig.attention: which kernel F.scaled_dot_product_attention tries first (names of torch's SDPBackend)
AttentionBackend = Literal["auto", "cudnn", "flash", "efficient", "math"]
ATTENTION_BACKENDS: tuple[str, ...] = typing.get_args(AttentionBackend)


def attention_backend(name: str) -> contextlib.AbstractContextManager:
    """The scaled-dot-product kernels :class:`SDPA` may run while the context is held: ``auto``, torch's own
    order (on CUDA FlashAttention-2 first, cuDNN last); ``cudnn`` / ``flash`` / ``efficient``, that kernel first
    wherever it can run the inputs, then torch's order (a priority, so bf16-only kernels leave fp32 to the
    others; on the CPU, where torch picks its flash kernel whenever it can, a priority changes nothing);
    ``math``, torch's plain composite only (the twin the fused kernels are checked against)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "auto":
        return contextlib.nullcontext()
    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
    if chosen == SDPBackend.MATH:
        return sdpa_kernel([chosen])
    rest = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]
    return sdpa_kernel([chosen, *(b for b in rest if b != chosen)], set_priority=True)


def set_attention_backend(model: nn.Module, name: str) -> None:
    """Every :class:`SDPA` of ``model`` runs under :func:`attention_backend` ``name`` (``TrainConfig.attention``;
    before compiling: dynamo guards on it)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {ATTENTION_BACKENDS}")
    for module in model.modules():
        if isinstance(module, SDPA):
            module.backend = name


class SDPA(nn.Module):
    """softmax(q kᵀ/√D + mask) v per head: q (B, H, T, D), k and v (B, Hkv, S, D) -> (B, H, T, D).

    With GQA (Hkv < H) query head h reads KV head h // (H / Hkv). ``mask`` (B or 1, 1, T, S) bool, True =
    may attend; ``causal``: query i sees keys <= i (T == S, no mask). With ``fast`` (the fast kernels), a
    bf16 q on CPU with D < 64 runs the same kernel in fp32 (``kernels.sdpa_in_fp32``: faster there).
    ``backend`` (:data:`ATTENTION_BACKENDS`, set by :func:`set_attention_backend`): the kernel torch tries
    first, held inside the forward, so a compiled block calls it too (torchtitan's way)."""

    def __init__(self, fast: bool = True) -> None:
        super().__init__()
        self.fast = fast
        self.backend = "auto"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        if self.backend != "auto":
            with attention_backend(self.backend):
                return self._attend(q, k, v, mask, causal)
        return self._attend(q, k, v, mask, causal)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        if kernels.active(self.fast) and kernels.upcasts_attention(q):
            return kernels.sdpa_in_fp32(q, k, v, mask, causal)
        gqa = k.shape[1] != q.shape[1]  # torch >= 2.5 maps query heads onto KV heads itself
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, spec: BlockSpec, norm: str,
                 eps: float, norm_scale: float = 1.0, head_dim: int | None = None, fast: bool = True,
                 layer_idx: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.layer_idx = layer_idx  # this layer's slot in a KVCache (HF's layer_idx); read only with a cache
        self.head_dim = d = head_dim or d_model // n_heads
        self.w_qkv = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * d, bias=False)  # rows [q; k; v]
        self.w_o = nn.Linear(n_heads * d, d_model, bias=False)
        self.scope, self.order = spec.qkv_norm_scope, spec.qkv_norm_order
        self.fast = fast

        def maybe(letter: str, heads: int) -> nn.Module | None:
            if not spec.norms(letter):
                return None
            return build_norm(norm, d if self.scope == "head" else heads * d, eps, norm_scale, fast)

        self.q_norm = maybe("Q", n_heads)
        self.k_norm = maybe("K", n_kv_heads)
        self.v_norm = maybe("V", n_kv_heads)
        self.c_norm = maybe("C", n_heads)
        self.inner = SDPA(fast)

        # The heads [lo, hi) of the projection that kernels.QKVPrep norms, or None: no fused path.
        letters = "".join(c for c in "QKV" if spec.norms(c))
        self._fused_range = None
        if fast and (not letters or (norm == "rms" and self.scope == "head"
                                     and (self.order == "before_rope" or letters == "V"))):
            self._fused_range = kernels.fused_qkv_range(letters, n_heads, n_kv_heads)

    def _qkv_norms(self) -> list[tuple[nn.Module, int]]:
        """The Q, K, V norms that exist, each with its number of heads."""
        return [(m, h) for m, h in ((self.q_norm, self.n_heads), (self.k_norm, self.n_kv_heads),
                                    (self.v_norm, self.n_kv_heads)) if m is not None]

    def _use_fused(self) -> bool:
        if self._fused_range is None or not kernels.active(self.fast):
            return False
        norms = [m for m in (self.q_norm, self.k_norm, self.v_norm) if m is not None]
        return (not has_hooks(*norms) and all(type(m) is RMSNorm for m in norms)
                and len({m.eps for m in norms}) <= 1)

    def _fused_qkv(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The general path's split, Q/K/V norms and RoPE as one ``kernels.QKVPrep`` (same math): the
        per-head gain rows (hi - lo, D) are each letter's gain once per its head."""
        parts = self._qkv_norms()
        gain = torch.cat([m.gain().expand(h, self.head_dim) for m, h in parts]) if parts else None
        eps = parts[0][0].eps if parts else 0.0
        return kernels.fused_qkv(qkv, gain, cos, sin, self.n_heads, self.n_kv_heads, *self._fused_range, eps)

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
                mask: Tensor | None = None) -> Tensor:
        """``mask`` (B, 1, T, S) bool, True = may attend, replaces the causal rule when given (padded
        batches, see :meth:`TransformerLM.forward`); S counts the cached keys too."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.w_qkv(x).view(B, T, H + 2 * Hkv, D)  # (B, T, H + 2·Hkv, D)
        if self._use_fused():
            q, k, v = self._fused_qkv(qkv, cos, sin)  # the lines of the else branch in one Function
        else:
            rope = kernels.rope if kernels.active(self.fast) else apply_rope
            q, k, v = qkv.split((H, Hkv, Hkv), dim=2)  # (B, T, H, D), (B, T, Hkv, D), (B, T, Hkv, D)
            if self.v_norm is not None:
                v = self._norm(self.v_norm, v)
            if self.order == "before_rope":
                q, k = self._qk_norms(q, k)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            if self.order == "after_rope":
                q, k = self._qk_norms(q, k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, h, T, D)

        start = 0  # the cached keys before these: needed only where no mask says what each query sees
        if cache is not None:
            start = cache.pos if mask is None else 0
            k, v = cache.update(self.layer_idx, k, v)  # (B, Hkv, S, D): S counts the cached keys too
        causal = mask is None and start == 0 and T > 1
        if mask is None and start > 0 and T > 1:  # a chunk after a cached prefix: query i sees keys <= start + i
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
        y = self.inner(q, k, v, mask, causal)  # (B, H, T, D)
        y = y.transpose(1, 2)  # (B, T, H, D)
        if self.c_norm is not None:
            y = self._norm(self.c_norm, y)
        return self.w_o(y.reshape(B, T, H * D))  # (B, T, d_model)
