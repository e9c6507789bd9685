"""transformers' attention backends and caches, plugged into our attention at its two seams.

:class:`hybridnorm.nn.attention.Attention` computes q, k, v (with the placement's Q/K/V norms and RoPE) and
hands them to a parameter-free kernel module, ``Attention.inner``, and to ``cache.update``. The HF classes
replace ``inner`` with :class:`HFKernel`, which calls the function that ``config._attn_implementation``
names in transformers' ``ALL_ATTENTION_FUNCTIONS`` ("sdpa", or any backend the class allows,
or :func:`eager_attention`, the plain equation, which also returns the attention weights), and wrap any
transformers :class:`~transformers.Cache` (dynamic, static, offloaded, paged, ...) in :class:`CacheView`. So
the placement's math is the training code's, and masks, caches and kernels are transformers' own. The
keyword arguments a forward passes on to transformers' caches and attention functions (as its own models
pass their ``**kwargs`` down: continuous batching's indices into a paged cache) travel in one
:class:`AttentionCall`, shared by the cache view and the kernels of that forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def eager_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    scaling: float, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ · scaling + mask) v, written out: q (B, H, T, D), k and v (B, Hkv, S, D); ``attention_mask``
    additive (float, transformers' eager form) or bool (True = may attend), broadcast over (B, H, T, S).
    Returns the output (B, T, H, D) and the weights (B, H, T, S), as every transformers backend does."""
    groups = query.shape[1] // key.shape[1]  # GQA: query head h reads KV head h // groups
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)  # (B, H, S, D)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, S)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask[..., : key.shape[2]]
    # fp32 at least (transformers' eager backends: fp32), fp64 kept for the float64 parity tests
    weights = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights  # (B, T, H, D), (B, H, T, S)


class HFKernel(nn.Module):
    """Stands in ``Attention.inner`` of a HF model: softmax(q kᵀ/√D + mask) v by the backend the config names.

    Same interface as :class:`hybridnorm.nn.attention.SDPA`: q (B, H, T, D), k and v (B, Hkv, S, D) -> (B, H, T,
    D). ``mask`` is transformers' prepared mask (or None where the backend's own causal rule applies), which our
    ``Attention`` passes through unchanged; its own ``causal`` flag is therefore not needed. With ``record`` set
    to a list, the eager backend's weights (B, H, T, S) are appended to it (``output_attentions``)."""

    is_causal = True  # read by transformers' backends: no mask means causal

    def __init__(self, config: Any, n_heads: int, n_kv_heads: int, head_dim: int, layer_idx: int) -> None:
        super().__init__()
        self.config = config  # read per call: set_attn_implementation() changes it on a built model
        self.layer_idx = layer_idx
        self.num_key_value_groups = n_heads // n_kv_heads
        self.scaling = head_dim ** -0.5
        self.record: list[Tensor] | None = None
        self.call: AttentionCall | None = None  # set by the HF forward for its duration

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        impl = self.config._attn_implementation
        if impl in (None, "eager"):
            fn = eager_attention
            if mask is None and causal:  # only a call from outside the HF forward, which always builds eager a mask
                T, S = q.shape[2], k.shape[2]
                mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        else:  # the others read `is_causal` (above) when there is no mask
            fn = ALL_ATTENTION_FUNCTIONS[impl]
        dropout = self.config.attention_dropout if self.training else 0.0
        extra = self.call.of(self.layer_idx) if self.call is not None else {}
        out, weights = fn(self, q, k, v, mask, scaling=self.scaling, dropout=dropout, **extra)  # (B, T, H, D)
        if self.record is not None:
            self.record.append(weights)
        return out.transpose(1, 2)  # (B, H, T, D)


class AttentionCall:
    """The keyword arguments of one HF forward that transformers' caches and attention functions read, as its
    own models hand their ``**kwargs`` to ``cache.update`` and to the attention function of every layer
    (continuous batching's ``read_index`` / ``write_index`` / ``cu_seq_lens_k``, ...). A cache may rewrite
    them for its layer, in place (the paged cache picks the entries of the layer's group), so each layer
    gets a copy of its own, read by that layer's cache update and then its kernel."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.kwargs = kwargs
        self.layers: dict[int, dict[str, Any]] = {}

    def of(self, layer: int) -> dict[str, Any]:
        return self.layers.setdefault(layer, dict(self.kwargs))


class CacheView:
    """A transformers :class:`~transformers.Cache` seen through :class:`hybridnorm.nn.attention.KVCache`'s
    interface (``pos``, ``update(layer, k, v)``); keys and values are (B, Hkv, T, D) in both. The cache counts
    its own tokens, so ``pos`` (read by our attention only when no mask is given) is what it has seen; a paged
    cache (continuous batching) counts none, and always comes with a mask."""

    def __init__(self, cache: Any, call: AttentionCall) -> None:
        self.cache = cache
        self.call = call
        # counted before the first layer writes: the tokens cached before this forward
        self._pos = cache.get_seq_length() if hasattr(cache, "get_seq_length") else None

    @property
    def pos(self) -> int:
        if self._pos is None:
            raise ValueError(f"{type(self.cache).__name__} counts no tokens: it needs an attention mask")
        return self._pos

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if not self.call.kwargs:  # the three-argument call every release's caches take
            return self.cache.update(k, v, layer)
        return self.cache.update(k, v, layer, self.call.of(layer))
