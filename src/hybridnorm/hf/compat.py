"""The few places where the supported ``transformers`` releases (``pyproject.toml``'s range) differ.

transformers 5.23 renamed the cache argument and output field ``past_key_values`` to ``cache`` (the old name
is accepted with a deprecation warning until 5.40); earlier 5.x releases know only ``past_key_values``. Our
``forward`` accepts both names; everything we hand to transformers uses the name the installed release
expects, found once here by looking at its own signatures rather than by parsing version strings. Also the
conventions our forward shares with transformers' models whatever the release (the default positions).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import torch
from torch import Tensor
from transformers import masking_utils
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

# the name transformers' outputs (and generate's model kwargs) use for the KV cache
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
# the name create_causal_mask takes it by
_MASK_CACHE_ARG = "cache" if "cache" in inspect.signature(masking_utils.create_causal_mask).parameters \
    else "past_key_values"


def causal_mask(config: Any, inputs_embeds: Tensor, attention_mask: Tensor | None, cache: Any,
                position_ids: Tensor) -> Any:
    """transformers' ``create_causal_mask``: the mask in the form ``config._attn_implementation`` expects
    (a bool (B, 1, T, S) tensor for sdpa, an additive float one for eager, None where sdpa's ``is_causal``
    suffices), for a 2-D padding mask, a prepared 4-D mask, a static cache's full length, packed sequences."""
    return masking_utils.create_causal_mask(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                            position_ids=position_ids, **{_MASK_CACHE_ARG: cache})


def with_cache(cache: Any) -> dict[str, Any]:
    """``{<the installed release's cache field>: cache}``, for an output dataclass."""
    return {CACHE_FIELD: cache}


def cache_arg(cache: Any, kwargs: dict[str, Any]) -> Any:
    """The KV cache, passed as ``cache`` (transformers >= 5.23) or ``past_key_values`` (earlier, and still
    accepted by those releases with a deprecation warning, as their own models do).

    Before 5.23 continuous batching passes its paged cache as ``cache`` beside the KV cache's name, for the
    ``paged|...`` attention functions to update: there a ``cache`` that is no transformers ``Cache`` is left in
    ``kwargs``, which reach those functions."""
    if CACHE_FIELD == "past_key_values" and cache is not None and not isinstance(cache, Cache):
        kwargs["cache"], cache = cache, None
    legacy = kwargs.pop("past_key_values", None)
    if legacy is not None and cache is not None and legacy is not cache:  # said, as transformers' models say it
        warnings.warn("both `cache` and `past_key_values` given: using `cache`, ignoring `past_key_values`",
                      FutureWarning, stacklevel=3)
    elif legacy is not None and CACHE_FIELD == "cache":
        warnings.warn("`past_key_values` is deprecated: pass the KV cache as `cache`", FutureWarning, stacklevel=3)
    return cache if cache is not None else legacy


def default_positions(T: int, attention_mask: Tensor | None, cache: Any, device: torch.device) -> Tensor:
    """Positions of the T new tokens: with a 2-D padding mask they count real tokens only, so a left-padded
    row computes what it computes alone (B, T); else they follow the cached ones (1, T)."""
    if attention_mask is not None and attention_mask.dim() == 2:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
    past = cache.get_seq_length() if cache is not None else 0
    return (torch.arange(T, device=device) + past).unsqueeze(0)
