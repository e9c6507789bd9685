"""Every placement as a Hugging Face ``transformers`` model: ``HybridNormModel`` (``AutoModel``) and
``HybridNormForCausalLM`` (``AutoModelForCausalLM``); the task heads over the same decoder are in
:mod:`hybridnorm.hf.heads`.

Both hold the training code's own :class:`hybridnorm.TransformerLM` as ``model``, so a folder's weights are
a TransformerLM state dict under a ``model.`` prefix (the names every export has had) and the placement's
math is the code that trained it. What a transformers model owes its callers comes from transformers' own
parts, plugged in at our seams (:mod:`hybridnorm.hf.attention`): its caches (dynamic, static, ...), its mask
builder (2-D padding masks, 4-D masks, static-cache lengths, packed sequences), its attention backends
(``attn_implementation``: eager, sdpa), its loss conventions (``num_items_in_batch``,
``shift_labels``). Importing ``hybridnorm.hf`` registers the classes with the Auto factories
(:mod:`hybridnorm.hf.auto`)::

    import hybridnorm.hf  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exported/")        # a local folder
    out = model.generate(**AutoTokenizer.from_pretrained("exported/")("In the beginning", return_tensors="pt"))
"""

from __future__ import annotations

import copy
import functools
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.initialization import guard_torch_init_functions
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
)

from hybridnorm.hf import remote_code
from hybridnorm.hf.attention import AttentionCall, CacheView, HFKernel
from hybridnorm.hf.compat import CACHE_FIELD, cache_arg, causal_mask, default_positions, with_cache
from hybridnorm.hf.configuration import MODEL_TYPE, HybridNormConfig
from hybridnorm.hf.loss import causal_lm_loss
from hybridnorm.hf.tied_head import TiedHead
from hybridnorm.nn.block import Block
from hybridnorm.nn.init import head_std, trunc_normal
from hybridnorm.nn.model import TransformerLM
from hybridnorm.nn.moe import MoEFFN, recorded_router_losses

__all__ = ["MODEL_TYPE", "HybridNormConfig", "HybridNormForCausalLM", "HybridNormModel"]


class HybridNormDecoderLayer(Block, GradientCheckpointingLayer):
    """Our :class:`~hybridnorm.nn.block.Block` (the same computation and weights) as a transformers
    ``GradientCheckpointingLayer``: ``gradient_checkpointing_enable()`` checkpoints each one the way it
    checkpoints Llama's layers."""


class HybridNormPreTrainedModel(PreTrainedModel):
    config_class = HybridNormConfig
    config: HybridNormConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["HybridNormDecoderLayer"]
    _skip_keys_device_placement: ClassVar[list[str]] = ["past_key_values", "cache"]
    # eager and sdpa are the backends tested here. flash attention needs a GPU; flex attention on the CPU (torch
    # 2.13) gives sdpa's logits forward but has no backward, and its decode kernel fails to compile in
    # generate() -- for stock Llama too (measured 2026-11-27) -- so neither could be tested here and
    # transformers refuses both for this class rather than run them untested
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_compile_fullgraph = True

    def __init__(self, config: HybridNormConfig) -> None:
        super().__init__(config)
        self.model = TransformerLM(self.config.model_config(), HybridNormDecoderLayer)
        self.model.rope_beyond_max_seq_len = True  # as transformers' models: max_position_embeddings is no limit
        for block in self.model.blocks:  # transformers' backends in the attention-kernel slot
            a = block.attn
            block.attn.inner = HFKernel(self.config, a.n_heads, a.n_kv_heads, a.head_dim, a.layer_idx)
        self.gradient_checkpointing = False  # set with the layers' by gradient_checkpointing_enable()
        # each subclass calls post_init() once its own modules exist (a head is drawn there)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func: Any = checkpoint,
                                    *args: Any, **kwargs: Any) -> None:
        # always non-reentrant, whatever use_reentrant asks: an MoE block's router losses leave it beside its
        # output, and only the non-reentrant checkpoint gives them gradients (the numbers are the same)
        func = functools.partial(gradient_checkpointing_func, use_reentrant=False)
        super()._set_gradient_checkpointing(enable, func, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: torch.nn.Module) -> None:
        # The placement's own scheme (per-depth scales, untied head), which is model-level: drawn once for the
        # whole TransformerLM. The nn.init calls are guarded as transformers' own init functions are, so a loaded
        # weight is never redrawn, also by a later model.apply(model._init_weights) (a no-op on a loaded Llama).
        with guard_torch_init_functions():
            if isinstance(module, TransformerLM):
                module.reset_parameters()
                # the tables are computed, never loaded: they must hold numbers even where the embedding is still
                # on the meta device after loading (a device_map that offloads it), or accelerate cannot place them
                module.reset_rope(torch.device("cpu") if module.embed.weight.is_meta else None)
            elif isinstance(module, (torch.nn.Embedding, torch.nn.Linear)) and "model" in self._modules \
                    and all(module.weight is not p for p in self.model.parameters()):
                # a weight outside the model: resize_token_embeddings(mean_resizing=False)'s new embedding or head,
                # drawn as the scheme draws the LM head (torch's default would be N(0, 1)); a task head draws its
                # own (hybridnorm.hf.heads); not tied_head, whose weight is the embedding's
                mc = self.model.config
                std = mc.std if isinstance(module, torch.nn.Embedding) \
                    else head_std(mc.resolved_init(), mc.std, mc.d_model)
                trunc_normal(module.weight, std)
                if getattr(module, "bias", None) is not None:
                    torch.nn.init.zeros_(module.bias)

    @classmethod
    def register_for_auto_class(cls, auto_class: Any = "AutoModel") -> None:
        """Nothing, as for the config: no source file copied on saving (hybridnorm.hf.remote_code)."""

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> None:
        ours = remote_code.is_ours(getattr(self.config, "auto_map", None))
        if ours:  # an older export's map grows to today's: the shim written below gives every class it names
            self.config.auto_map = dict(remote_code.AUTO_MAP)
        super().save_pretrained(save_directory, *args, **kwargs)
        if ours and kwargs.get("is_main_process", True):
            remote_code.write_shim(save_directory)  # the module config.json's auto_map names

    @property
    def base_model(self) -> HybridNormBackbone:
        # transformers' contract: the decoder without its head, as a backbone (Llama's: its LlamaModel). TRL's
        # trainers run it, then the head; the inherited property would give the bare TransformerLM. One view
        # for as long as the model holds this TransformerLM, so that get_decoder() is get_decoder() and a hook
        # on it fires (forward calls it); kept outside _modules, so nothing is held twice
        view = self.__dict__.get("_backbone")
        if view is None or view.decoder is not self.model:
            view = self.__dict__["_backbone"] = HybridNormBackbone(self)
        return view

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: torch.nn.Embedding) -> None:
        self.model.embed = value

    def _decode(self, input_ids: Tensor | None, attention_mask: Tensor | None, position_ids: Tensor | None,
                cache: Any, inputs_embeds: Tensor | None, use_cache: bool | None, output_attentions: bool | None,
                output_hidden_states: bool | None, record_router: bool = False,
                attention_kwargs: dict[str, Any] | None = None) -> BaseModelOutputWithPast:
        """The final-normed hidden states (B, T, d), with the cache and what the flags ask to record;
        ``record_router`` on an MoE: a ``MoeModelOutputWithPast`` whose ``router_logits`` holds each layer's
        router logits (B*T, E) fp32, as Mixtral's / OLMoE's do. ``attention_kwargs``: the forward's other
        keyword arguments, handed to the cache's update and the attention function (as transformers'
        models hand theirs down): continuous batching's paged cache and its indices arrive so."""
        cfg = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        use_cache = cfg.use_cache if use_cache is None else use_cache
        # a checkpointed block recomputed in backward would write its keys into a cache twice. Without
        # gradients nothing is recomputed (generating from a model left in training mode): the cache is kept
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            if cache is not None and cache.get_seq_length() > 0:  # stock classes drop it, computing without it
                raise ValueError("a KV cache holding keys (PEFT prefix tuning, a continued sequence) cannot be "
                                 "attended to while gradient checkpointing trains: the recomputed blocks would "
                                 "write their keys into it twice; turn gradient checkpointing off")
            use_cache, cache = False, None
        output_attentions = cfg.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
        lm = self.model
        x = lm.embed(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, d)
        # a cache passed in is attended to and extended whatever use_cache says, as in transformers' models:
        # PEFT's prefix tuning hands its learned keys in as one, with the config's use_cache often False
        if use_cache and cache is None:
            cache = DynamicCache(config=cfg)
        if position_ids is None:
            position_ids = default_positions(x.shape[1], attention_mask, cache, x.device)
        mask = causal_mask(cfg, x, attention_mask, cache, position_ids)  # None, or (B, 1, T, S)
        # past max_position_embeddings, as transformers' models: rows computed there (dynamic NTK: for this call).
        # Compiled (a static cache) the tables are what they are: max_position_embeddings is the limit there
        cos, sin = lm.rope_at(position_ids, check=not torch.compiler.is_compiling())  # (B or 1, T, D/2)
        kernels = [b.attn.inner for b in lm.blocks]
        routers = [b.ffn for b in lm.blocks if isinstance(b.ffn, MoEFFN)]
        attentions: list[Tensor] | None = [] if output_attentions else None
        hidden: list[Tensor] | None = [] if output_hidden_states else None
        router: list[Tensor] | None = [] if record_router and routers else None
        call = AttentionCall(attention_kwargs or {})
        for k in kernels:
            k.record, k.call = attentions, call
        for r in routers:
            r.record = router
        try:
            x = lm.trunk(x, cos, sin, CacheView(cache, call) if cache is not None else None, mask, hidden)  # (B, T, d)
        finally:
            for k in kernels:
                k.record, k.call = None, None
            for r in routers:
                r.record = None
        if hidden is not None:
            hidden.append(x)  # as in transformers: the last entry is the final-normed output
        if attentions is not None:  # only the eager backend computes the weights (as in transformers: none else)
            attentions = [w for w in attentions if w is not None]
        # the cache is returned when use_cache asks, as transformers documents (its models return a passed one
        # always, and generate(use_cache=False) then hands that back with the whole sequence: a prefix-tuned
        # model attended to its prefix and its tokens twice from the second step on)
        fields = dict(last_hidden_state=x, hidden_states=tuple(hidden) if hidden is not None else None,
                      attentions=tuple(attentions) if attentions is not None else None,
                      **with_cache(cache if use_cache else None))
        if router is not None:
            return MoeModelOutputWithPast(**fields, router_logits=tuple(router))
        return BaseModelOutputWithPast(**fields)

    def _router_flag(self, output_router_logits: bool | None) -> bool:
        """Whether to return router logits: the argument, else the config's flag; only an MoE has them."""
        flag = getattr(self.config, "output_router_logits", False) if output_router_logits is None \
            else output_router_logits  # the config has the flag only on an MoE
        return bool(flag) and self.model.is_moe

    def _router_losses(self, router_logits: tuple[Tensor, ...], attention_mask: Tensor | None) -> dict[str, Tensor]:
        """The MoE router losses of one forward from its ``router_logits`` (each (B*T, E)), counting only the
        real tokens of a 2-D padding ``attention_mask`` (B, S) (its last T columns; as Mixtral's
        ``load_balancing_loss_func`` does); without one, every token, which gives the training loop's numbers.
        Returns ``lb_loss``, ``z_loss`` (layer means, unweighted) and ``aux_loss``, their weighted sum
        (:func:`hybridnorm.nn.moe.recorded_router_losses`, as ``TransformerLM(..., return_aux=True)``'s)."""
        weight = None
        if attention_mask is not None and attention_mask.dim() == 2:
            T = router_logits[0].shape[0] // attention_mask.shape[0]  # the new tokens: the mask's last T columns
            weight = attention_mask[:, attention_mask.shape[1] - T:].reshape(-1)  # (B*T,)
        return recorded_router_losses(list(router_logits), self.model.config.moe, weight)


class HybridNormModel(HybridNormPreTrainedModel):
    """The decoder without its head (``AutoModel``): ``last_hidden_state`` is the final-normed stream that
    the head reads. The untied head's weight, if any, stays in ``model.lm_head`` so that weight names are
    those of every export (a HybridNormForCausalLM folder loads here, and back, without renaming)."""

    def __init__(self, config: HybridNormConfig) -> None:
        super().__init__(config)
        self.post_init()

    @property
    def base_model(self) -> HybridNormModel:
        # transformers' contract: a backbone is its own base model (LlamaModel's is itself), not the bare
        # TransformerLM held as ``model``, which the inherited property would give
        return self

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: Any = None, inputs_embeds: Tensor | None = None,
                use_cache: bool | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                output_router_logits: bool | None = None, **kwargs: Any) -> BaseModelOutputWithPast | tuple:
        out = self._decode(input_ids, attention_mask, position_ids, cache_arg(cache, kwargs), inputs_embeds,
                           use_cache, output_attentions, output_hidden_states, self._router_flag(output_router_logits),
                           kwargs)
        return out if _return_dict(self.config, return_dict) else out.to_tuple()


class HybridNormForCausalLM(HybridNormPreTrainedModel, GenerationMixin):
    """Causal LM over any placement. ``labels`` are shifted inside (or ``shift_labels`` given already
    shifted); with ``num_items_in_batch`` the loss is the sum over this batch's scored tokens divided by it
    (what ``Trainer`` passes under gradient accumulation), else their mean; an MoE's weighted router losses
    are added in training mode (not in eval mode, where ``loss`` is the cross-entropy alone), scaled by this
    batch's share of the scored tokens so that accumulated micro-batches add up to one batch's."""

    def __init__(self, config: HybridNormConfig) -> None:
        super().__init__(config)
        if self.model.lm_head is None:  # tied: TransformerLM reads embed.weight itself
            self.tied_head = TiedHead(self)
        self.post_init()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head if self.model.lm_head is not None else self.tied_head

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``generate``, less LayerSkip's ``assistant_early_exit``, refused with its reason:
        transformers shortens a model by writing ``num_hidden_layers`` into its base model's config, for us
        the TransformerLM's ModelConfig. ``assistant_model`` or ``prompt_lookup_num_tokens`` assist instead."""
        config = kwargs.get("generation_config", args[1] if len(args) > 1 else None) or self.generation_config
        if kwargs.get("assistant_early_exit", getattr(config, "assistant_early_exit", None)) is not None:
            raise ValueError("assistant_early_exit (LayerSkip's self-speculative decoding) is not supported by "
                             f"{type(self).__name__}: use assistant_model= (a smaller model with the same "
                             "tokenizer) or prompt_lookup_num_tokens= for assisted decoding")
        return super().generate(*args, **kwargs)

    def set_output_embeddings(self, value: torch.nn.Module) -> None:
        if isinstance(value, TiedHead) and value.owner is self:
            return  # handed back unchanged (resize_token_embeddings does, after resizing the embedding)
        self.model.lm_head = value  # a head of its own: no longer tied
        self._modules.pop("tied_head", None)
        # and said so in both configs: a saved config.json that still said tied would rebuild the model without
        # this head on loading, and the weight saved for it would be dropped as unexpected
        self.config.tie_word_embeddings = False
        self.model.config.tie_embeddings = False

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: Any = None, inputs_embeds: Tensor | None = None,
                labels: Tensor | None = None, use_cache: bool | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                logits_to_keep: int | Tensor = 0, output_router_logits: bool | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast | MoeCausalLMOutputWithPast | tuple:
        want_router = self._router_flag(output_router_logits)
        wants_loss = labels is not None or kwargs.get("shift_labels") is not None
        # through the decoder (get_decoder()), as Llama's forward calls its LlamaModel: hooks on it fire
        out = self.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                              output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                              return_dict=True,
                              output_router_logits=want_router or (wants_loss and self.model.is_moe and self.training),
                              **kwargs)
        x = out.last_hidden_state  # (B, T, d)
        if isinstance(logits_to_keep, int):
            x = x[:, -logits_to_keep:] if logits_to_keep > 0 else x
        else:
            x = x[:, logits_to_keep]
        logits = self.get_output_embeddings()(x)  # (B, T', V): the head module, tied or not (its hooks fire)
        router = self._router_losses(out.router_logits, attention_mask) \
            if isinstance(out, MoeModelOutputWithPast) else None
        loss = None
        if wants_loss:
            loss, scored = causal_lm_loss(logits, labels, kwargs.get("num_items_in_batch"), kwargs.get("shift_labels"))
            # the objective in training mode; in eval mode the LM loss alone, so that Trainer.evaluate's
            # eval_loss is the cross-entropy our trainer reports and exp() of it the perplexity
            if router is not None and self.training:
                share = scored / kwargs["num_items_in_batch"] if kwargs.get("num_items_in_batch") is not None else 1.0
                loss = loss + router["aux_loss"] * share
        fields = dict(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions,
                      **with_cache(getattr(out, CACHE_FIELD)))
        if want_router:  # as Mixtral's: aux_loss is the load-balancing loss that router_aux_loss_coef weights
            result = MoeCausalLMOutputWithPast(**fields, aux_loss=router["lb_loss"], router_logits=out.router_logits)
        else:
            result = CausalLMOutputWithPast(**fields)
        return result if _return_dict(self.config, return_dict) else result.to_tuple()


class HybridNormBackbone(torch.nn.Module):
    """``base_model`` of the LM and the task heads, and the LM's ``get_decoder()``: the decoder without its
    head, called as ``HybridNormModel`` is, so ``head(last_hidden_state)`` is the LM's logits. A view made on
    each access, whose one child is the model's TransformerLM (nothing held twice; the model does not hold
    it). That child is ``decoder``, never ``model``: transformers' ``unwrap_peft_model`` takes a base model
    with a ``model`` for a PEFT wrapper and would unwrap the model to the bare TransformerLM."""

    _tp_plan = _pp_plan = None  # read by supports_tp_plan / supports_pp_plan: none declared, as on the LM

    def __init__(self, lm: HybridNormPreTrainedModel) -> None:
        super().__init__()
        self.decoder = lm.model
        object.__setattr__(self, "owner", lm)  # a reference, not a child module

    @property
    def config(self) -> HybridNormConfig:
        return self.owner.config

    @property
    def device(self) -> torch.device:
        return self.owner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.owner.dtype

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> None:
        """Saved as ``HybridNormModel`` (its class in ``config.json``, the ``model.`` weight names), from these
        weights without a copy, so the folder loads with ``AutoModel`` and into the LM or any task head (their
        head drawn), as a stock model's ``base_model.save_pretrained`` folder does."""
        with torch.device("meta"):  # a shell: its TransformerLM is replaced by this one's before saving
            backbone = HybridNormModel(copy.deepcopy(self.config))
        backbone.model = self.decoder
        backbone.save_pretrained(save_directory, *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> BaseModelOutputWithPast | tuple:
        # HybridNormModel's forward on the LM itself: it reads only what both classes have (config, _decode),
        # and so follows the LM's flags (gradient checkpointing, training) and any module PEFT swapped in
        return HybridNormModel.forward(self.owner, *args, **kwargs)

    def get_decoder(self) -> HybridNormBackbone:
        return self

    def set_decoder(self, decoder: torch.nn.Module) -> None:
        """transformers' ``set_decoder``: the model's TransformerLM becomes ``decoder``'s (a backbone view,
        a ``HybridNormModel``, or a TransformerLM), so ``set_decoder(get_decoder())`` changes nothing."""
        lm = decoder.decoder if isinstance(decoder, HybridNormBackbone) else \
            decoder.model if isinstance(decoder, HybridNormModel) else decoder
        if not isinstance(lm, TransformerLM):
            raise TypeError(f"set_decoder takes a HybridNormModel, another model's get_decoder() or a hybridnorm "
                            f"TransformerLM, not {type(decoder).__name__}")
        self.owner.model = lm


def _return_dict(config: HybridNormConfig, return_dict: bool | None) -> bool:
    return config.return_dict if return_dict is None else return_dict
