"""Hugging Face ``transformers`` integration (needs the ``hf`` extra: ``pip install 'hybridnorm[hf]'``).

- :mod:`~hybridnorm.hf.modeling`: ``HybridNormConfig`` / ``HybridNormForCausalLM`` for every placement,
  registered with ``AutoConfig`` / ``AutoModelForCausalLM`` when this package is imported.
- :mod:`~hybridnorm.hf.stock`: placements that stock architectures express exactly (Llama, Qwen3, OLMo-2,
  Mixtral, Qwen3-MoE, OLMoE) and the weight maps to and from them.
- :mod:`~hybridnorm.hf.export`: ``hybridnorm export`` / ``hybridnorm import`` (runs <-> HF folders,
  tokenizer as ``PreTrainedTokenizerFast``).
"""

from hybridnorm.hf.modeling import HybridNormConfig, HybridNormForCausalLM, register

register()

__all__ = ["HybridNormConfig", "HybridNormForCausalLM", "register"]
