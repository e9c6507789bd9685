"""Model components: norms, RoPE, attention with QKV(C) norms, SwiGLU / MoE FFN, the block, the LM."""

from hybridnorm.nn.attention import Attention, KVCache
from hybridnorm.nn.block import Block
from hybridnorm.nn.ffn import SwiGLU
from hybridnorm.nn.model import TransformerLM, lm_loss
from hybridnorm.nn.norms import DyT, LayerNorm, RMSNorm, build_norm

__all__ = ["Attention", "Block", "DyT", "KVCache", "LayerNorm", "RMSNorm", "SwiGLU", "TransformerLM",
           "build_norm", "lm_loss"]
