"""A ``HybridNormConfig`` read from a dict (a ``config.json``, keywords) must say each value once, or twice alike.

Our config states the sizes twice: as the standard fields transformers reads (``hidden_size``, ...) and in
``hybridnorm``, the ModelConfig as a dict (``d_model``, ...). After construction the standard fields are the
truth (transformers and its tools assign them: ``from_pretrained(..., num_hidden_layers=...)``,
``resize_token_embeddings``) and the dict is rewritten from them whenever the config is serialized, so a
saved file states both alike. A dict read in whose two statements differ was edited by hand or built wrong:
which of the two the weights were made for is unknown, and letting the standard field win without a word
would build a model other than the one the dict describes. :func:`check` refuses it, naming both fields and
both values. Values equal in a lossless form (2 and 2.0) agree; a value only one of the two states is no
contradiction (a partial dict, the standard fields filling in the rest).
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Mapping
from typing import Any

from hybridnorm.config import ModelConfig, MoEConfig, RopeScaling
from hybridnorm.config_base import coerce, show
from hybridnorm.errors import ConfigError
from hybridnorm.hf.rope_parameters import KEYS, from_rope_parameters

__all__ = ["check"]

_HF_KEY = {ours: hf for hf, ours in KEYS.items()}  # RopeScaling's field -> transformers' rope_parameters key
_UNKNOWN = object()  # a derived value that the dict's other values do not give (a bad size, named later)


def check(cfg: Any, nested: dict[str, Any], standard: Mapping[str, str], moe: Mapping[str, str]) -> None:
    """Raise one ConfigError for the first value that ``cfg``'s standard fields and the ``hybridnorm`` dict
    ``nested`` both state and state differently. ``standard`` / ``moe``: HF field -> ModelConfig (MoEConfig)
    field, for what both name. Called on construction only: a later assignment is the new truth."""
    side = _Dict(cfg, nested, standard)
    for hf_name, name in standard.items():
        top = getattr(cfg, hf_name, None)
        if top is not None and name in nested:
            theirs, shown = side.value(name)
            if theirs is not _UNKNOWN and theirs != top:
                _refuse(hf_name, top, f"hybridnorm.{name}", shown)
    _check_vocab(cfg, side)
    if cfg.tie_word_embeddings is True and "tie_embeddings" in nested and side.value("tie_embeddings")[0] is False:
        # the other way round (false above a tied dict) is how exports before 2026-11 wrote every config.json,
        # read as the dict says (HybridNormConfig.__post_init__)
        _refuse("tie_word_embeddings", True, "hybridnorm.tie_embeddings", "False")
    _check_moe(cfg, side, moe)
    _check_rope(cfg, side)


class _Dict:
    """The ``hybridnorm`` dict's values, each checked against its ModelConfig field's type (a value of the
    wrong kind is a ConfigError naming ``hybridnorm.<field>``) and, where it is None, derived as ModelConfig
    derives it from the model's other values."""

    def __init__(self, cfg: Any, nested: dict[str, Any], standard: Mapping[str, str]) -> None:
        self.cfg, self.nested = cfg, nested
        self.hf_name = {name: hf_name for hf_name, name in standard.items()}

    def value(self, name: str) -> tuple[Any, str]:
        """(the dict's value of ``name``, checked; or what None stands for, _UNKNOWN where that cannot be worked
        out), and how to show it. A None that derives nothing (init_std: the scheme's own σ) stays None."""
        raw = self.nested[name]
        value = coerce(f"hybridnorm.{name}", raw, _hints(ModelConfig)[name])
        if value is not None:
            return value, show(raw)
        try:
            if name == "n_kv_heads":  # None: one kv head per head
                value = self.merged("n_heads")
                return value, f"None (= n_heads, {value})"
            if name == "attn_head_dim":  # None: d_model / n_heads
                value = self.merged("d_model") // self.merged("n_heads")
                return value, f"None (= d_model / n_heads, {value})"
        except (ConfigError, TypeError, ZeroDivisionError):  # a bad size: model_config() names it
            return _UNKNOWN, "None"
        return None, "None"

    def merged(self, name: str) -> Any:
        """The model's value of ``name`` as it is built: the standard field, else the dict, else the default."""
        top = getattr(self.cfg, self.hf_name.get(name, ""), None)
        if top is not None:
            return top
        if name in self.nested:
            return coerce(f"hybridnorm.{name}", self.nested[name], _hints(ModelConfig)[name])
        return getattr(ModelConfig, name)


def _check_vocab(cfg: Any, side: _Dict) -> None:
    """HF's vocab_size counts embedding rows: the dict's vocab_size rounded up to its pad_vocab_multiple."""
    if cfg.vocab_size is None or "vocab_size" not in side.nested:
        return
    vocab = side.value("vocab_size")[0]
    pad = side.value("pad_vocab_multiple")[0] if "pad_vocab_multiple" in side.nested else 1
    if not isinstance(pad, int) or pad < 1:
        return  # model_config() refuses it by name
    rows = -(-vocab // pad) * pad
    if rows != cfg.vocab_size:
        why = f" (rounded up to hybridnorm.pad_vocab_multiple={pad}: {rows} embedding rows)" if pad != 1 else ""
        _refuse("vocab_size", cfg.vocab_size, "hybridnorm.vocab_size", f"{vocab}{why}")


def _check_moe(cfg: Any, side: _Dict, moe: Mapping[str, str]) -> None:
    given = {hf_name: getattr(cfg, hf_name) for hf_name in moe if getattr(cfg, hf_name, None) is not None}
    if not given or "moe" not in side.nested:
        return
    section = side.nested["moe"]
    if section is None:  # the dict's model is dense: MoE fields above it would make it an MoE unasked
        hf_name, value = next(iter(given.items()))
        _refuse(hf_name, value, "hybridnorm.moe", "None (a dense FFN)")
    if not isinstance(section, dict):
        return  # model_config() refuses it by name
    hints = _hints(MoEConfig)
    for hf_name, top in given.items():
        name = moe[hf_name]
        if name not in section:
            continue
        try:  # not a dataclass field, so unchecked so far: a value of the wrong kind is model_config()'s to name
            top = coerce(hf_name, top, hints[name])
        except ConfigError:
            continue
        raw = section[name]
        theirs = coerce(f"hybridnorm.moe.{name}", raw, hints[name])
        shown = show(raw)
        if theirs is None and name == "expert_hidden_size":  # None: the dense FFN's hidden size
            theirs = side.merged("ffn_hidden_size")
            shown = f"None (= ffn_hidden_size, {theirs})"
        if theirs != top:
            _refuse(hf_name, top, f"hybridnorm.moe.{name}", shown)


def _check_rope(cfg: Any, side: _Dict) -> None:
    """``rope_parameters`` (transformers' one RoPE dict) against the dict's rope_theta and rope_scaling."""
    if cfg.rope_parameters is None:
        return
    theta, scaling = from_rope_parameters(cfg.rope_parameters)
    if theta is not None and "rope_theta" in side.nested:
        theirs = side.value("rope_theta")[0]
        if theirs != theta:
            _refuse("rope_parameters['rope_theta']", theta, "hybridnorm.rope_theta", show(side.nested["rope_theta"]))
    if "rope_scaling" not in side.nested:
        return
    raw = side.nested["rope_scaling"]
    theirs = None if raw is None else RopeScaling.from_dict(raw).to_dict()  # every key, as scaling has
    if theirs == scaling:
        return
    kind = "default" if scaling is None else scaling["type"]
    if theirs is None or theirs["type"] != kind:
        _refuse("rope_parameters['rope_type']", kind, "hybridnorm.rope_scaling",
                "None (plain RoPE)" if theirs is None else f"{{'type': {theirs['type']!r}, ...}}")
    name = next(k for k in scaling if scaling[k] != theirs.get(k))  # the first key of the type that differs
    _refuse(f"rope_parameters[{_HF_KEY.get(name, name)!r}]", scaling[name], f"hybridnorm.rope_scaling.{name}",
            show(theirs[name]))


def _refuse(hf_name: str, top: Any, nested_name: str, shown: str) -> typing.NoReturn:
    raise ConfigError(f"{hf_name}={show(top)} and {nested_name}={shown} disagree: the standard field and the "
                      "hybridnorm dict state one setting of the model differently, and which one is meant is "
                      "unknown; make them equal (or give only one)")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)
