"""Hugging Face ``transformers`` integration (needs the ``hf`` extra: ``pip install 'hybridnorm[hf]'``).

- :mod:`~hybridnorm.hf.modeling`: ``HybridNormModel`` / ``HybridNormForCausalLM`` for every placement, with
  ``HybridNormConfig`` (:mod:`~hybridnorm.hf.configuration`); :mod:`~hybridnorm.hf.heads`: the task heads
  (sequence classification and reward models, token classification, question answering). Importing this
  package registers them all with the ``Auto`` factories (:mod:`~hybridnorm.hf.auto`);
  :mod:`~hybridnorm.hf.attention` plugs transformers' attention backends and caches into our attention,
  :mod:`~hybridnorm.hf.compat` holds the differences between supported transformers releases.
- :mod:`~hybridnorm.hf.stock`: placements that stock architectures express exactly (Llama, Qwen3, OLMo-2,
  Mixtral, Qwen3-MoE, OLMoE, FlexOlmo; Mistral and Phi-3 for import) and the weight maps to and from them.
- :mod:`~hybridnorm.hf.export`: ``hybridnorm export`` / ``hybridnorm import`` (runs <-> HF folders,
  tokenizer as ``PreTrainedTokenizerFast``).
"""

from hybridnorm.hf.auto import register
from hybridnorm.hf.heads import (
    HybridNormForQuestionAnswering,
    HybridNormForSequenceClassification,
    HybridNormForTokenClassification,
)
from hybridnorm.hf.modeling import HybridNormConfig, HybridNormForCausalLM, HybridNormModel

register()

__all__ = ["HybridNormConfig", "HybridNormForCausalLM", "HybridNormForQuestionAnswering",
           "HybridNormForSequenceClassification", "HybridNormForTokenClassification", "HybridNormModel", "register"]
