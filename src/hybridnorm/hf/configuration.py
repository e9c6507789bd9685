"""``HybridNormConfig``: a transformers config that carries a whole :class:`hybridnorm.ModelConfig`.

The standard fields (``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ...) are what transformers and
every tool around it read and write (generation caches, ``resize_token_embeddings``, lm-eval, memory
estimators, transformers' own model tests), so they are the truth for the sizes they name. Everything else
our model needs (the placement written out as data, norm kind, init, MoE, ...) lives in ``hybridnorm``, the
ModelConfig as a dict. :meth:`HybridNormConfig.model_config` merges the two at the moment a model is built,
and the dict is brought in line with the standard fields whenever the config is serialized, so the two
never disagree in a saved ``config.json``; a dict or file read in where they do is refused
(:mod:`hybridnorm.hf.config_agreement`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from typing import Any, ClassVar

import torch
from transformers import PretrainedConfig

from hybridnorm import placements
from hybridnorm.config import ModelConfig
from hybridnorm.config_base import coerce
from hybridnorm.errors import ConfigError
from hybridnorm.hf import config_agreement
from hybridnorm.hf.rope_parameters import from_rope_parameters, to_rope_parameters

MODEL_TYPE = "hybridnorm"

# HF field -> ModelConfig field, for what both name (vocab_size is handled apart: HF's counts rows).
# initializer_range is the σ of every scheme's truncated normal (None: the default 1/sqrt(2.5 d)); transformers'
# own code and tests read it (``_config_zero_init`` shrinks it to check that every random draw scales with it)
_STANDARD_FIELDS = {"hidden_size": "d_model", "intermediate_size": "ffn_hidden_size",
                    "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                    "num_key_value_heads": "n_kv_heads", "head_dim": "attn_head_dim",
                    "max_position_embeddings": "max_seq_len", "rms_norm_eps": "norm_eps", "rope_theta": "rope_theta",
                    "initializer_range": "init_std"}
# ... and the MoE FFN's, under OLMoE's / Qwen-MoE's names (None on a dense model): ModelConfig.moe's fields
_MOE_FIELDS = {"num_experts": "num_experts", "num_experts_per_tok": "top_k",
               "moe_intermediate_size": "expert_hidden_size", "norm_topk_prob": "normalize_topk",
               "router_aux_loss_coef": "lb_loss_weight", "router_z_loss_coef": "z_loss_weight"}
MOE_ONLY = (*_MOE_FIELDS, "output_router_logits")  # attributes of an MoE config only
# Other model types' fields that a config of ours may carry (a Llama or Qwen3 config's dict given to this class,
# a keyword) and that would change the function if honoured: anything but the value our model computes is refused
# rather than ignored. (name, the one value that fits, what the model does)
_FIXED = (("hidden_act", "silu", "the FFN is SwiGLU, whose gate is silu"),
          ("attention_bias", False, "the attention projections have no bias"),
          ("mlp_bias", False, "the FFN projections have no bias"),
          ("use_sliding_window", False, "every layer attends to the whole context (no sliding window)"))
_HF_NAME = {name: hf_name for hf_name, name in _STANDARD_FIELDS.items() if hf_name != name} | {
    f"moe.{name}": hf_name for hf_name, name in _MOE_FIELDS.items()} | {"tie_embeddings": "tie_word_embeddings"}


class UnbuildableConfigError(ConfigError, NotImplementedError):
    """A config whose values describe no model (``hidden_size=0``, heads that do not divide it, ...): refused
    when it is made, not when a model is built from it. A :class:`ConfigError` (a ValueError) as every config
    error, and a NotImplementedError: the type transformers' ``ConfigTester`` accepts from a config class that
    cannot take a value it tries on a common property (it builds ``Config(hidden_size=0)``, which a stock
    config without that check accepts and no model can be built from)."""


class HybridNormConfig(PretrainedConfig):
    """``hybridnorm``: the :class:`hybridnorm.ModelConfig` as a dict (placement as data); the standard
    size fields and ``tie_word_embeddings`` given beside it must say what it says (a ConfigError naming both
    otherwise), and set later they override it. ``placement`` names a preset or
    grammar name for a config built from standard fields alone (``HybridNormConfig(hidden_size=64, ...,
    placement="hybridnorm_star")``); a config with a ``hybridnorm`` dict keeps the dict's placement and
    shows its name here. ``num_experts`` (with ``num_experts_per_tok``, ...) makes the FFN an MoE."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values", "cache"]

    hybridnorm: dict | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int | None = None
    rms_norm_eps: float | None = None
    rope_theta: float | None = None
    # transformers' one dict for RoPE (hybridnorm.hf.rope_parameters): rope_type (default, linear, llama3, yarn),
    # rope_theta and the type's keys; the truth for ModelConfig.rope_scaling, and rope_theta's other spelling
    rope_parameters: dict | None = None
    initializer_range: float | None = None
    # The MoE fields (_MOE_FIELDS, and output_router_logits: as Mixtral's / OLMoE's, forward returns each layer's
    # router logits and the load-balancing loss) are no dataclass fields: they are attributes of an MoE config
    # only, as OLMoE's config has them all and Llama's none. Tools tell an MoE by their presence: TRL's
    # trainers add a router loss to any config that has output_router_logits, weighted by router_aux_loss_coef
    placement: str | None = None
    attention_dropout: float = 0.0
    use_cache: bool = True
    # TransformerLM ties the head itself (no lm_head module when tied), so transformers has nothing to tie;
    # like the size fields, this one is the truth for ModelConfig.tie_embeddings
    tie_word_embeddings: bool | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        legacy = kwargs.pop("rope_scaling", None)  # rope_parameters' older name (a config.json, a keyword)
        if legacy is not None:
            if self.rope_parameters is not None and self.rope_parameters != legacy:
                raise ConfigError(f"rope_scaling={legacy!r} and rope_parameters={self.rope_parameters!r} are two "
                                  "names of one setting and disagree: give rope_parameters only")
            self.rope_parameters = dict(legacy)
        for name in MOE_ONLY:  # given (a keyword, a config.json): read by _sync, which keeps them on an MoE
            if name in kwargs:
                setattr(self, name, kwargs.pop(name))
        if isinstance(self.hybridnorm, dict) and self.hybridnorm:
            # read in (a config.json, keywords), the standard fields and the dict must say each value alike
            # (config_agreement); assigned later, a standard field is the truth and the dict follows it (_sync)
            config_agreement.check(self, self.hybridnorm, _STANDARD_FIELDS, _MOE_FIELDS)
        if isinstance(self.hybridnorm, dict) and self.hybridnorm and self.tie_word_embeddings is not None \
                and self.tie_word_embeddings != self.hybridnorm.get("tie_embeddings", ModelConfig.tie_embeddings):
            # config.json of exports before 2026-11 always said false (that class never let transformers tie):
            # where the two disagree on reading, the dict, which built the weights, is the truth
            self.tie_word_embeddings = None
        self._sync()
        super().__post_init__(**kwargs)
        _check_fixed(self)  # the keywords no field of ours names are attributes only from here on

    def __setattr__(self, name: str, value: Any) -> None:
        # every field holds what its type hint says, from construction (config.json, keywords) and assignment
        # (from_pretrained(..., use_cache=...) sets its keywords so) on: "false" is no boolean and "0" no token
        # id, which would otherwise load and act as true / fail deep inside generate (as LlamaConfig refuses them)
        hint = _field_hints(type(self)).get(name)
        super().__setattr__(name, value if hint is None else _checked(name, value, hint))

    @classmethod
    def register_for_auto_class(cls, auto_class: Any = "AutoConfig") -> None:
        """Nothing: transformers calls this for a class loaded with trust_remote_code, and saving would then
        copy this file into the folder (hybridnorm.hf.remote_code says why not, and what is written)."""

    def model_config(self) -> ModelConfig:
        """The ModelConfig this config describes: the ``hybridnorm`` dict with the standard size fields
        applied, the placement resolved to a dict (self-contained). Raises ConfigError naming a bad field."""
        _check_fixed(self)
        if self.hybridnorm is not None and not isinstance(self.hybridnorm, dict):
            raise ConfigError(f"hybridnorm must be a dict of hybridnorm.ModelConfig fields (model.*), got "
                              f"{type(self.hybridnorm).__name__}")
        if self.hybridnorm:
            d = dict(self.hybridnorm)
        else:  # built from the standard fields alone: the ModelConfig defaults fill the rest
            d = {"placement": self.placement or ModelConfig.placement}
        if self.tie_word_embeddings is not None:
            d["tie_embeddings"] = self.tie_word_embeddings
        for hf_name, name in _STANDARD_FIELDS.items():
            if getattr(self, hf_name, None) is not None:
                d[name] = getattr(self, hf_name)
        given = {hf_name: getattr(self, hf_name) for hf_name in _MOE_FIELDS if getattr(self, hf_name, None) is not None}
        if given and not d.get("moe") and "num_experts" not in given:  # never a silent dense model, nor 64 experts
            raise ConfigError(f"{', '.join(given)} given for a dense model: set num_experts too (the number of "
                              "experts) for an MoE FFN")
        if given:
            d["moe"] = {**(d.get("moe") or {}), **{_MOE_FIELDS[k]: v for k, v in given.items()}}
        if self.rope_parameters is not None:
            theta, d["rope_scaling"] = from_rope_parameters(self.rope_parameters)
            if theta is not None and theta != d.get("rope_theta", ModelConfig.rope_theta):
                d["rope_theta"] = self._rope_theta_of_two(d.get("rope_theta", ModelConfig.rope_theta), theta)
        try:
            mc = ModelConfig.from_dict(d)
            if self.vocab_size is not None and self.vocab_size != mc.embedding_size:
                # HF's vocab_size counts embedding rows (resize_token_embeddings sets it): no padding on top
                mc = ModelConfig.from_dict({**d, "vocab_size": self.vocab_size, "pad_vocab_multiple": 1})
        except ConfigError as e:  # name the field as the caller of this class spelled it, too
            raise UnbuildableConfigError(re.sub(r"\bmodel\.((?:moe\.)?\w+)", _both_names, str(e))) from None
        if self.hybridnorm and self.placement is not None:
            _check_placement_name(self.placement, mc)
        mc.placement = mc.resolved_placement().to_dict()
        return mc

    def _sync(self) -> None:
        """Every field from one ModelConfig: the dict and the standard fields agree from here on."""
        mc = self.model_config()
        self.hybridnorm = _plain(mc.to_dict())
        self.vocab_size = mc.embedding_size
        self.hidden_size, self.intermediate_size = mc.d_model, mc.ffn_hidden_size
        self.num_hidden_layers, self.num_attention_heads = mc.n_layers, mc.n_heads
        self.num_key_value_heads, self.head_dim = mc.kv_heads, mc.head_dim
        self.max_position_embeddings = mc.max_seq_len
        self.rms_norm_eps, self.rope_theta = mc.norm_eps, mc.rope_theta
        self.rope_parameters = to_rope_parameters(mc)
        vars(self)["_synced_rope_theta"] = mc.rope_theta  # what both spellings said last (_rope_theta_of_two)
        self.initializer_range = mc.init_std
        if mc.moe is not None:
            for hf_name, name in _MOE_FIELDS.items():
                setattr(self, hf_name, getattr(mc.moe, name))
            self.output_router_logits = bool(getattr(self, "output_router_logits", False))
        else:  # a dense model has none of them (a dense config.json's output_router_logits: ignored, as Llama does)
            for name in MOE_ONLY:
                vars(self).pop(name, None)
        self.placement = mc.resolved_placement().name
        self.tie_word_embeddings = mc.tie_embeddings

    def _rope_theta_of_two(self, field: float, in_parameters: float) -> float:
        """rope_theta and rope_parameters["rope_theta"] disagree: the one set since they last agreed wins (a
        ``from_pretrained(..., rope_theta=...)`` or ``config.rope_parameters = {...}``); both, or both given
        at once: an error."""
        last = vars(self).get("_synced_rope_theta")
        if last is not None and in_parameters == last:
            return field
        if last is not None and field == last:
            return in_parameters
        if last is None and self.rope_theta is None:
            return in_parameters
        raise ConfigError(f"rope_theta={field:g} and rope_parameters['rope_theta']={in_parameters:g} are two names "
                          "of one setting and disagree: set one")

    def to_dict(self) -> dict[str, Any]:
        self._sync()  # a size changed after construction (resize_token_embeddings) reaches the dict too
        out = super().to_dict()
        out.pop("_synced_rope_theta", None)
        return out

    @classmethod
    def from_model_config(cls, mc: ModelConfig, **kwargs: Any) -> HybridNormConfig:
        return cls(hybridnorm=mc.to_dict(), **kwargs)


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    """The type hint of each dataclass field of a config class, transformers' base fields included. Read class
    by class: a release whose hints name something not importable here leaves that class's fields unchecked."""
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        try:
            hints.update(inspect.get_annotations(klass, eval_str=True, locals={"torch": torch}))
        except Exception:  # a hint this release spells with names we cannot resolve
            continue
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name in hints}


def _checked(name: str, value: Any, hint: Any) -> Any:
    """``value`` as the field's hint says (hybridnorm's one config check: a lossless conversion such as 2.0 -> 2,
    else a ConfigError naming the field); a hint that check does not read (``torch.dtype``) is transformers'."""
    ours = _STANDARD_FIELDS.get(name, "tie_embeddings" if name == "tie_word_embeddings" else None)
    try:  # a standard field named as the ModelConfig names it too, as model_config()'s errors do
        return coerce(name if ours is None else f"{name} (model.{ours})", value, hint)
    except TypeError:
        return value


def _check_fixed(cfg: PretrainedConfig) -> None:
    """Fields of ours that ModelConfig does not check, and other architectures' fields (_FIXED)."""
    for name, fits, why in _FIXED:
        if getattr(cfg, name, fits) not in (fits, None):
            raise ConfigError(f"{name}={getattr(cfg, name)!r} is not supported: {why} (only {fits!r})")
    p = getattr(cfg, "attention_dropout", 0.0)  # read by each attention call in training
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ConfigError(f"attention_dropout={p!r} must be a number in [0, 1)")
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        raise ConfigError(f"sliding_window={cfg.sliding_window!r} is not supported: every layer attends to the "
                          "whole context (only null)")


def _check_placement_name(name: Any, mc: ModelConfig) -> None:
    """``placement`` beside a ``hybridnorm`` dict only names the dict's placement: one that names another
    (a config.json edited, a ``from_pretrained(..., placement=...)``) would be ignored, so it is refused."""
    have = mc.resolved_placement()
    if name == have.name:
        return
    try:
        asked = placements.get(name) if isinstance(name, str) else None
    except ConfigError as e:
        raise ConfigError(f"placement={name!r}: {e}") from None
    # what it is called and described as is no part of the model: 'pre' names the grammar's 'Pre-Pre' (another
    # summary and source) and a spec of one's own with Pre-Norm's blocks; it was refused as another model. Nor
    # is the init it draws fresh weights with by default: loaded weights were drawn already (as on resume). Nor how
    # its blocks are written: compared as built (mix_ln's ⌊0.25·L⌋ Post-Norm blocks are none at L < 4: Pre-Norm)
    if asked is None or asked.built(mc.n_layers) != have.built(mc.n_layers):
        raise ConfigError(f"placement={name!r} is not the model's placement: hybridnorm.placement ({have.name!r}) "
                          "is, and the weights were made for it; edit that (a model of another placement), or "
                          "drop placement")


def _both_names(m: re.Match) -> str:
    """``model.d_model`` -> ``hidden_size (model.d_model)`` for a field with a standard name (also
    ``model.moe.top_k`` -> ``num_experts_per_tok (model.moe.top_k)``)."""
    return f"{_HF_NAME[m[1]]} ({m[0]})" if m[1] in _HF_NAME else m[0]


def _plain(x: Any) -> Any:
    """Tuples -> lists, recursively: the dict must survive a JSON round trip unchanged."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x
