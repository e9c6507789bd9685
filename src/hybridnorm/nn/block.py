"""ONE Transformer block for every placement: norm slots that a :class:`BlockSpec` switches on.

Each sublayer (attention, then FFN) runs the same five lines::

    u      = N_in(s)              if in_norm
    h      = N_out(G(u))          if out_norm          # G = MHA_# or FFN
    skip   = s | u | x | x + s    by spec.skip         # input | normed | block | block+input
    s'     = α·skip + β·h
    s'     = N_post(s')           if post_norm

so Pre-Norm, Post-Norm, HybridNorm, Peri-LN, OLMo-2, SpanNorm, B2T and DeepNorm differ only in which
slots are on (see ``hybridnorm.placements``). Module names of the slots: ``attn_norm``, ``attn_out_norm``,
``attn_post_norm``, ``ffn_norm``, ``ffn_out_norm``, ``ffn_post_norm``. Given ResiDual's second stream
``dual``, a block also adds its two branch outputs to it, ``dual' = dual + β·h_attn + β·h_ffn``, and
returns ``(s', dual')``.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from hybridnorm.nn.attention import Attention, KVCache
from hybridnorm.nn.ffn import SwiGLU
from hybridnorm.nn.norms import build_norm
from hybridnorm.placements.spec import BlockSpec, SublayerSpec


class Block(nn.Module):
    def __init__(self, cfg, spec: BlockSpec, layer: int) -> None:  # cfg: a hybridnorm.config.ModelConfig
        super().__init__()
        self.spec, self.layer = spec, layer
        self.alpha = spec.alpha(cfg.n_layers)
        self.beta = spec.branch_scale
        scale = 1.0 / math.sqrt(layer + 1) if spec.depth_scaled_norms else 1.0

        fast = cfg.fast_kernels

        def slot(on: bool) -> nn.Module | None:
            return build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, scale, fast) if on else None

        self.attn_norm, self.attn_out_norm, self.attn_post_norm = (
            slot(spec.attn.in_norm), slot(spec.attn.out_norm), slot(spec.attn.post_norm))
        self.ffn_norm, self.ffn_out_norm, self.ffn_post_norm = (
            slot(spec.ffn.in_norm), slot(spec.ffn.out_norm), slot(spec.ffn.post_norm))
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.kv_heads, spec, cfg.norm, cfg.norm_eps, scale,
                              head_dim=cfg.head_dim, fast=fast, layer_idx=layer)
        if cfg.moe is None:
            self.ffn: nn.Module = SwiGLU(cfg.d_model, cfg.ffn_hidden_size, fast)
        else:
            from hybridnorm.nn.moe import MoEFFN

            self.ffn = MoEFFN(cfg.d_model, cfg.moe.expert_hidden_size or cfg.ffn_hidden_size, cfg.moe)

    def _sublayer(self, s: Tensor, x: Tensor, spec: SublayerSpec, op: nn.Module, args: tuple,
                  in_norm: nn.Module | None, out_norm: nn.Module | None,
                  post_norm: nn.Module | None) -> tuple[Tensor, Tensor]:
        """(the sublayer's output stream s', its branch β·h)."""
        # op is the sublayer module itself, called with its extra args (not a closure over them): torch.compile
        # guards a closure by its code object, so a fresh one per call would force a recompile on every block
        u = in_norm(s) if in_norm is not None else s
        h = op(u, *args)
        if out_norm is not None:
            h = out_norm(h)
        if spec.skip == "input":
            skip = s
        elif spec.skip == "normed":
            skip = u
        elif spec.skip == "block":
            skip = x
        else:  # "block+input"
            skip = x + s
        if self.alpha != 1.0:
            skip = self.alpha * skip
        if self.beta != 1.0:
            h = self.beta * h
        out = skip + h
        return (post_norm(out) if post_norm is not None else out), h

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None,
                mask: Tensor | None = None, dual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        y, h_attn = self._sublayer(x, x, self.spec.attn, self.attn, (cos, sin, cache, mask),
                                   self.attn_norm, self.attn_out_norm, self.attn_post_norm)  # (B, T, d)
        out, h_ffn = self._sublayer(y, x, self.spec.ffn, self.ffn, (),
                                    self.ffn_norm, self.ffn_out_norm, self.ffn_post_norm)  # (B, T, d)
        if dual is None:
            return out
        return out, dual + h_attn + h_ffn  # ResiDual: the second stream gathers both branches, never normed
