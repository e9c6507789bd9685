"""Task heads over every placement, as transformers' ``Auto`` classes load them:
``HybridNormForSequenceClassification`` (classifiers, regressors, and TRL's reward models: ``RewardTrainer``,
GRPO's / RLOO's ``reward_funcs``), ``HybridNormForTokenClassification``, ``HybridNormForQuestionAnswering``.

Each holds the decoder as the LM classes do (our TransformerLM as ``model``, the weight names of every
export), so an exported LM folder loads into any of them: the trunk is the LM's, the new head is drawn
(``from_pretrained`` names it), and an untied LM head is left out (named as unused). The head reads the
final-normed hidden states the LM head reads. Pooling, dropout, biases and losses are transformers' own
conventions (its generic heads, which ``LlamaForSequenceClassification`` and the rest are; they are the
oracle in tests/hf/test_hf_heads.py), with two differences in what is trained (docs/huggingface.md lists
the others: positions under left padding, the pad token's embedding, loading an LM folder's trunk into QA):

- **Gradient accumulation.** ``Trainer`` hands ``num_items_in_batch`` to any forward with ``**kwargs`` and then
  leaves the loss undivided by the accumulation steps; transformers' generic classification heads drop it
  and return their micro-batch mean, so the loss and gradients come out that many times too large
  (transformers issue #47688, open: measured 4x at 4 steps for LlamaForSequenceClassification 5.24). Ours
  take it: the loss is the micro-batch's sum over the items transformers' loss averages, divided by it, so
  accumulated micro-batches give one batch's loss exactly, of any sizes, for every ``problem_type``.
- **An MoE's router losses** are not added (as Mixtral's heads: a task loss only); a fine-tune that wants
  load balancing adds ``aux_loss`` from ``HybridNormForCausalLM`` itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.initialization import guard_torch_init_functions
from transformers.modeling_outputs import (
    QuestionAnsweringModelOutput,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)
from transformers.utils import logging

from hybridnorm.hf.compat import CACHE_FIELD, cache_arg, with_cache
from hybridnorm.hf.configuration import HybridNormConfig
from hybridnorm.hf.modeling import HybridNormPreTrainedModel, _return_dict
from hybridnorm.nn.init import trunc_normal

__all__ = ["HybridNormForQuestionAnswering", "HybridNormForSequenceClassification",
           "HybridNormForTokenClassification"]

logger = logging.get_logger(__name__)


class _HeadModel(HybridNormPreTrainedModel):
    """The decoder for a task head: no LM head (an untied one would be a vocabulary-sized weight that no loss
    reaches: DDP without ``find_unused_parameters`` refuses such a model). Each head adds its own modules,
    then calls ``post_init()``."""

    def __init__(self, config: HybridNormConfig) -> None:
        super().__init__(config)
        self.model.lm_head = None

    @torch.no_grad()
    def _init_weights(self, module: torch.nn.Module) -> None:
        # A task head (score, qa_outputs) is drawn with the scheme's σ, which initializer_range sets, as
        # transformers' heads are drawn with initializer_range. Not with the LM head's σ: under megatron that is
        # 1/√d whatever initializer_range says (HybridNorm's Table 10, about the LM head), so a classifier loaded
        # with ignore_mismatched_sizes (or built) under a vanishing initializer_range kept random weights, where
        # transformers' model tests (_config_zero_init) ask every random draw to scale with it.
        if isinstance(module, torch.nn.Linear) and any(module is m for k, m in self.named_children() if k != "model"):
            with guard_torch_init_functions():  # a loaded weight is never redrawn
                trunc_normal(module.weight, self.model.config.std)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
            return
        super()._init_weights(module)

    def _hidden(self, input_ids: Tensor | None, attention_mask: Tensor | None, position_ids: Tensor | None,
                cache: Any, inputs_embeds: Tensor | None, use_cache: bool | None, output_attentions: bool | None,
                output_hidden_states: bool | None, kwargs: dict[str, Any]) -> Any:
        return self._decode(input_ids, attention_mask, position_ids, cache_arg(cache, kwargs), inputs_embeds,
                            use_cache, output_attentions, output_hidden_states)


def _mean_to_share(loss: Tensor, averaged_over: Tensor | int, num_items_in_batch: Any) -> Tensor:
    """A mean over ``averaged_over`` items as this micro-batch's share of a batch of ``num_items_in_batch``
    (Trainer's count over all accumulated micro-batches): sum / num_items_in_batch."""
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss * averaged_over / num_items_in_batch


class HybridNormForSequenceClassification(_HeadModel):
    """One score vector per sequence (``num_labels``; 1 for a reward model): the ``score`` of the last token
    that is not ``pad_token_id`` in each row (left or right padding), as transformers' generic head picks it."""

    def __init__(self, config: HybridNormConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.score = torch.nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: Any = None, inputs_embeds: Tensor | None = None,
                labels: Tensor | None = None, use_cache: bool | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                **kwargs: Any) -> SequenceClassifierOutputWithPast | tuple:
        out = self._hidden(input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache,
                           output_attentions, output_hidden_states, kwargs)
        logits = self.score(out.last_hidden_state)  # (B, T, L)
        B = logits.shape[0]
        pad = self.config.pad_token_id
        if pad is None and B != 1:
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined: set the config's "
                             "pad_token_id (the row's score is read at its last token that is not padding)")
        last = torch.full((B,), -1, device=logits.device)  # each row's last position (B,)
        if pad is not None and input_ids is not None:  # the rightmost token that is not padding (either side)
            t = torch.arange(input_ids.shape[-1], device=logits.device)
            last = (t * (input_ids.to(logits.device) != pad)).argmax(-1)
        elif pad is not None:
            logger.warning_once(f"{type(self).__name__} will not detect padding tokens in `inputs_embeds`: "
                                "each row's score is read at its last position")
        pooled = logits[torch.arange(B, device=logits.device), last]  # (B, L)
        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=pooled, config=self.config)  # a mean
            single = self.config.problem_type == "single_label_classification"
            averaged_over = (labels != -100).sum() if single else labels.numel()
            loss = _mean_to_share(loss, averaged_over, kwargs.get("num_items_in_batch"))
        result = SequenceClassifierOutputWithPast(loss=loss, logits=pooled, hidden_states=out.hidden_states,
                                                  attentions=out.attentions, **with_cache(getattr(out, CACHE_FIELD)))
        return result if _return_dict(self.config, return_dict) else result.to_tuple()


class HybridNormForTokenClassification(_HeadModel):
    """One score vector per token: ``score(dropout(hidden))``, dropout ``classifier_dropout`` (else
    ``hidden_dropout``, else 0.1) and a bias unless ``token_classification_bias=False``, as transformers'."""

    def __init__(self, config: HybridNormConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        p = next((v for v in (getattr(config, "classifier_dropout", None), getattr(config, "hidden_dropout", None))
                  if v is not None), 0.1)
        self.dropout = torch.nn.Dropout(p)
        self.score = torch.nn.Linear(config.hidden_size, config.num_labels,
                                     bias=getattr(config, "token_classification_bias", True))
        self.post_init()

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: Any = None, inputs_embeds: Tensor | None = None,
                labels: Tensor | None = None, use_cache: bool | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                **kwargs: Any) -> TokenClassifierOutput | tuple:
        out = self._hidden(input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache,
                           output_attentions, output_hidden_states, kwargs)
        logits = self.score(self.dropout(out.last_hidden_state))  # (B, T, L)
        loss = None
        if labels is not None:  # transformers' token loss takes num_items_in_batch itself: sum / it
            loss = self.loss_function(logits, labels, self.config,
                                      num_items_in_batch=kwargs.get("num_items_in_batch"))
        result = TokenClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                       attentions=out.attentions)
        return result if _return_dict(self.config, return_dict) else result.to_tuple()


class HybridNormForQuestionAnswering(_HeadModel):
    """Extractive QA: ``qa_outputs`` gives each token a start and an end logit; the loss is the mean of the
    start and end cross-entropies, positions past the sequence ignored, as transformers'. ``Trainer`` counts
    no items for it (its labels are not ``labels``) and divides the loss by the accumulation steps itself."""

    def __init__(self, config: HybridNormConfig) -> None:
        super().__init__(config)
        self.qa_outputs = torch.nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: Any = None, inputs_embeds: Tensor | None = None,
                start_positions: Tensor | None = None, end_positions: Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **kwargs: Any) -> QuestionAnsweringModelOutput | tuple:
        out = self._hidden(input_ids, attention_mask, position_ids, cache, inputs_embeds, False,
                           output_attentions, output_hidden_states, kwargs)
        start, end = self.qa_outputs(out.last_hidden_state).split(1, dim=-1)  # (B, T, 1) each
        start, end = start.squeeze(-1).contiguous(), end.squeeze(-1).contiguous()  # (B, T)
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = self.loss_function(start, end, start_positions, end_positions)
        result = QuestionAnsweringModelOutput(loss=loss, start_logits=start, end_logits=end,
                                              hidden_states=out.hidden_states, attentions=out.attentions)
        return result if _return_dict(self.config, return_dict) else result.to_tuple()
