"""Every placement as a Hugging Face ``transformers`` causal LM: ``HybridNormConfig`` + ``HybridNormForCausalLM``.

The HF class is a thin shell around :class:`hybridnorm.TransformerLM` (the ``model`` attribute), so what
``save_pretrained`` writes is our own state dict under a ``model.`` prefix and the numbers are those of
the training code, not of a re-implementation. Importing ``hybridnorm.hf`` registers both classes with
``AutoConfig`` / ``AutoModelForCausalLM`` (model type ``"hybridnorm"``)::

    import hybridnorm.hf  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exported/")        # a local folder
    out = model.generate(**AutoTokenizer.from_pretrained("exported/")("In the beginning", return_tensors="pt"))

The config stores the whole :class:`hybridnorm.ModelConfig` with the placement spelled out as data
(``config.hybridnorm``), so a folder loads the same model even if a registry preset changes later. The
usual size attributes (``hidden_size``, ``num_hidden_layers``, ...) are derived from it for tools that
read them (generation caches, lm-eval's HFLM, memory estimators).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from hybridnorm.config import ModelConfig
from hybridnorm.nn.model import TransformerLM

MODEL_TYPE = "hybridnorm"


class HybridNormConfig(PretrainedConfig):
    """``hybridnorm``: the full :class:`hybridnorm.ModelConfig` as a dict (placement as data). Every
    other size field is derived from it and overwritten, so the two can never disagree."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    hybridnorm: dict | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int | None = None
    placement: str | None = None
    use_cache: bool = True
    tie_word_embeddings: bool = False  # TransformerLM ties by itself: HF must not tie (or untie) anything
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        mc = self.model_config()
        self.hybridnorm = _plain(mc.to_dict())
        self.vocab_size = mc.embedding_size
        self.hidden_size, self.intermediate_size = mc.d_model, mc.ffn_hidden_size
        self.num_hidden_layers, self.num_attention_heads = mc.n_layers, mc.n_heads
        self.num_key_value_heads, self.head_dim = mc.kv_heads, mc.head_dim
        self.max_position_embeddings = mc.max_seq_len
        self.placement = mc.resolved_placement().name
        self.tie_word_embeddings = False
        super().__post_init__(**kwargs)

    def model_config(self) -> ModelConfig:
        """The hybridnorm config, with the placement resolved to a dict (self-contained)."""
        mc = ModelConfig.from_dict(dict(self.hybridnorm)) if self.hybridnorm else ModelConfig()
        mc.placement = mc.resolved_placement().to_dict()
        return mc

    @classmethod
    def from_model_config(cls, mc: ModelConfig, **kwargs: Any) -> HybridNormConfig:
        return cls(hybridnorm=mc.to_dict(), **kwargs)


def _plain(x: Any) -> Any:
    """Tuples -> lists, recursively: the dict must survive a JSON round trip unchanged."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


class _CacheView:
    """A transformers :class:`Cache` seen through :class:`hybridnorm.nn.attention.KVCache`'s interface
    (``pos``, ``update(layer, k, v)``); keys/values are (B, H_kv, T, D) in both."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache
        self.pos = cache.get_seq_length()

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache.update(k, v, layer)


class HybridNormPreTrainedModel(PreTrainedModel):
    config_class = HybridNormConfig
    config: HybridNormConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules: ClassVar[list[str]] = ["Block"]
    _skip_keys_device_placement: ClassVar[list[str]] = ["past_key_values"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: torch.nn.Module) -> None:
        # Weights come from TransformerLM's own init (or the checkpoint); HF's generic init would
        # overwrite the placement's scheme. Only the RoPE tables, non-persistent buffers that a
        # meta-device load leaves empty, are rebuilt here.
        if isinstance(module, TransformerLM):
            module.reset_rope()


class HybridNormForCausalLM(HybridNormPreTrainedModel, GenerationMixin):
    """Causal LM head over any placement; ``forward`` follows the HF conventions (``labels`` shifted
    inside, ``attention_mask`` for padded batches, ``past_key_values`` a transformers Cache)."""

    def __init__(self, config: HybridNormConfig) -> None:
        super().__init__(config)
        self.model = TransformerLM(config.model_config())
        self.post_init()

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: torch.nn.Embedding) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> torch.nn.Linear | None:
        return self.model.lm_head  # None when tied: TransformerLM reuses embed.weight itself

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: Tensor | None = None, labels: Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int | Tensor = 0, **kwargs: Any) -> CausalLMOutputWithPast:
        if inputs_embeds is not None:
            raise ValueError("HybridNormForCausalLM takes input_ids, not inputs_embeds")
        if input_ids is None:
            raise ValueError("input_ids is required")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None and not self.training:
            past_key_values = DynamicCache(config=self.config)
        cache = _CacheView(past_key_values) if use_cache and past_key_values is not None else None
        logits = self.model(input_ids, cache=cache, attention_mask=attention_mask,
                            position_ids=position_ids)  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
            if self.model.is_moe:
                loss = loss + self.model.aux_losses()["aux_loss"]
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, Tensor):
            logits = logits[:, logits_to_keep]
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=past_key_values if use_cache else None)


def register() -> None:
    """Register the classes with the Auto factories (idempotent; done on ``import hybridnorm.hf``)."""
    try:
        AutoConfig.register(MODEL_TYPE, HybridNormConfig)
    except ValueError:  # already registered
        pass
    try:
        AutoModelForCausalLM.register(HybridNormConfig, HybridNormForCausalLM)
    except ValueError:
        pass
