"""transformers' ``rope_parameters`` dict <-> ``ModelConfig.rope_theta`` and ``ModelConfig.rope_scaling``.

transformers names a model's RoPE in one dict: ``{"rope_type": "default", "rope_theta": 10000.0}``, or a
stretched one such as Llama 3.1's ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
"high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_theta": 500000.0}``. Older
configs call it ``rope_scaling`` and its type ``type``. ``linear``, ``dynamic``, ``llama3`` and ``yarn`` are
:class:`hybridnorm.config.RopeScaling`; ``longrope`` is refused by name (:data:`UNSUPPORTED`), never run as
another.
"""

from __future__ import annotations

import math
import re
from typing import Any

from hybridnorm.config import ModelConfig, RopeScaling
from hybridnorm.config_base import show
from hybridnorm.errors import ConfigError

TYPES = ("default", *RopeScaling.FIELDS)
# transformers' key -> RopeScaling's field
KEYS = {"factor": "factor", "original_max_position_embeddings": "original_max_seq_len",
        "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor", "beta_fast": "beta_fast",
        "beta_slow": "beta_slow", "truncate": "truncate", "attention_factor": "attention_factor",
        "mscale": "mscale", "mscale_all_dim": "mscale_all_dim"}
_HF_KEY = {ours: hf for hf, ours in KEYS.items()}
UNSUPPORTED = {
    "longrope": "LongRoPE's two frequency sets (short_factor, long_factor per pair) are not implemented",
}
# read by transformers' standardization for some types and written by others beside any type: the pre-training
# context, informational where the type does not read it (transformers' own tests put it beside "default")
INFORMATIONAL = ("original_max_position_embeddings",)


def to_rope_parameters(mc: ModelConfig) -> dict[str, Any]:
    """``mc``'s RoPE as transformers' ``rope_parameters`` (only the keys its type reads, unset ones left out)."""
    s = mc.rope_scaling
    out: dict[str, Any] = {"rope_type": "default" if s is None else s.type, "rope_theta": float(mc.rope_theta)}
    if s is not None:
        out.update({_HF_KEY[name]: getattr(s, name) for name in RopeScaling.FIELDS[s.type]
                    if getattr(s, name) is not None})
    return out


def from_rope_parameters(rp: Any, where: str = "rope_parameters") -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta or None where absent, RopeScaling as a dict or None) from transformers' dict. Raises
    ConfigError naming the key (``where.key``) for an unsupported type, an unknown key, or a bad value."""
    if not isinstance(rp, dict):
        raise ConfigError(f"{where} must be a dict (rope_type, rope_theta, ...), got {type(rp).__name__} {show(rp)}")
    if any(isinstance(v, dict) for v in rp.values()):
        nested = ", ".join(k for k, v in rp.items() if isinstance(v, dict))
        raise ConfigError(f"{where}: one RoPE per layer type ({nested}) is not supported: every layer of this "
                          "model rotates alike")
    kind = rp.get("rope_type", rp.get("type", "default"))
    if not isinstance(kind, str) or kind not in TYPES:
        why = f" ({UNSUPPORTED[kind]})" if isinstance(kind, str) and kind in UNSUPPORTED else ""
        raise ConfigError(f"{where}.rope_type={show(kind)} is not supported{why}; valid: "
                          f"{', '.join(map(repr, TYPES))}")
    theta = rp.get("rope_theta")
    if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float))
                              or not 0 < theta < math.inf):
        raise ConfigError(f"{where}.rope_theta={show(theta)} must be a finite number > 0")
    reads = RopeScaling.FIELDS.get(kind, ())
    given: dict[str, Any] = {}
    for key, value in rp.items():
        if key in ("rope_type", "type", "rope_theta") or value is None:
            continue
        if key == "partial_rotary_factor":
            if value != 1:
                raise ConfigError(f"{where}.partial_rotary_factor={show(value)}: RoPE on part of a head is not "
                                  "supported (only 1.0, every dim rotated)")
        elif KEYS.get(key) in reads:
            given[KEYS[key]] = value
        elif key in INFORMATIONAL:
            continue
        else:
            raise ConfigError(f"{where}.{key}={show(value)} does nothing with rope_type={kind!r}, which reads "
                              f"{', '.join(_HF_KEY[n] for n in reads) or 'rope_theta only'}")
    if kind == "default":
        return (None if theta is None else float(theta)), None
    try:
        scaling = RopeScaling.from_dict({"type": kind, **given})
    except ConfigError as e:  # name the key as transformers spells it
        raise ConfigError(re.sub(r"model\.rope_scaling\.(\w+)",
                                 lambda m: f"{where}.{_HF_KEY.get(m[1], 'rope_type' if m[1] == 'type' else m[1])}",
                                 str(e))) from None
    return (None if theta is None else float(theta)), scaling.to_dict()
