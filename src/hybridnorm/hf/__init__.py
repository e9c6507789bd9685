"""Hugging Face ``transformers`` integration (needs the ``hf`` extra: ``pip install 'hybridnorm[hf]'``).

- :mod:`~hybridnorm.hf.modeling`: ``HybridNormModel`` / ``HybridNormForCausalLM`` for every placement, with
  ``HybridNormConfig`` (:mod:`~hybridnorm.hf.configuration`), registered with ``AutoConfig`` / ``AutoModel`` /
  ``AutoModelForCausalLM`` when this package is imported; :mod:`~hybridnorm.hf.attention` plugs
  transformers' attention backends and caches into our attention, :mod:`~hybridnorm.hf.compat` holds the
  differences between supported transformers releases.
- :mod:`~hybridnorm.hf.stock`: placements that stock architectures express exactly (Llama, Qwen3, OLMo-2,
  Mixtral, Qwen3-MoE, OLMoE) and the weight maps to and from them.
- :mod:`~hybridnorm.hf.export`: ``hybridnorm export`` / ``hybridnorm import`` (runs <-> HF folders,
  tokenizer as ``PreTrainedTokenizerFast``).
"""

from hybridnorm.hf.modeling import HybridNormConfig, HybridNormForCausalLM, HybridNormModel, register

register()

__all__ = ["HybridNormConfig", "HybridNormForCausalLM", "HybridNormModel", "register"]
