"""The float64 oracle of a placement given as plain data (a user's own, not a preset): the five lines of
SCHEMES.md / ``hybridnorm.placements.spec``, written out by hand again, for any combination of slots.

    u      = N_in(s)            if in_norm   else s          # s: the sublayer's input stream
    branch = N_out(G(u))        if out_norm  else G(u)       # G = MHA_# or FFN
    skip   = s | N_in(s) | x | x + s                         # input | normed | block | block+input
    s'     = N_post(α·skip + β·branch) if post_norm else α·skip + β·branch

with α a number or DeepNet's (2L)^¼, every norm of block l times 1/√l under ``depth_scaled_norms``
(Q/K/V/C norms included), per-layer overrides (the first that covers a block wins: ``first_n`` blocks,
or ⌊``first_fraction``·L⌋), an embedding norm, a final norm and ResiDual's second stream D (D₁ = X₁,
D' = D + β·h_attn + β·h_ffn, output X'_L + N(D_L)). The placement is read as the plain dict a config
file holds; nothing of the library's spec classes (``alpha()``, ``block_for()``, ``count()``) is used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from oracle import BlockCtx, Weights, norm
from torch import Tensor


class ScaledCtx(BlockCtx):
    """A block whose every norm output is multiplied by ``scale`` (1/√l for LayerNorm Scaling)."""

    def __init__(self, W: Weights, cfg, index: int, scope: str, order: str, scale: float) -> None:
        super().__init__(W, cfg, index, scope, order)
        self.scale = scale

    def _norm(self, prefix: str, z: Tensor) -> Tensor:
        return super()._norm(prefix, z) * self.scale

    def F(self, u: Tensor) -> Tensor:
        """The FFN: SwiGLU, or under ``cfg.moe`` a dropless top-k MoE of SwiGLU experts, token by token."""
        return super().F(u) if self.cfg.moe is None else moe_ffn(self, u)


def moe_ffn(b: BlockCtx, u: Tensor) -> Tensor:
    """p = softmax(u W_r^T); the k largest p_e (renormalized if ``normalize_topk``) weight expert e's SwiGLU,
    ``w_in[e]`` holding [gate | up] columns and ``w_out[e]`` the down projection (nn/moe.py's docstring)."""
    moe, prefix = b.cfg.moe, f"blocks.{b.i}.ffn"
    router, w_in, w_out = b.W(f"{prefix}.router.weight"), b.W(f"{prefix}.w_in"), b.W(f"{prefix}.w_out")
    h = w_out.shape[1]
    rows = []
    for x in u.reshape(-1, u.shape[-1]):
        p = (router @ x).softmax(0)
        top = sorted(range(moe.num_experts), key=lambda e: -p[e].item())[:moe.top_k]
        total = sum(p[e] for e in top) if moe.normalize_topk else 1.0
        y = x.new_zeros(x.shape)
        for e in top:
            gate, up = x @ w_in[e, :, :h], x @ w_in[e, :, h:]
            y = y + p[e] / total * ((gate * gate.sigmoid() * up) @ w_out[e])
        rows.append(y)
    return torch.stack(rows).reshape(u.shape)


def block_of(placement: Mapping[str, Any], index: int, n_layers: int) -> Mapping[str, Any]:
    for o in placement.get("overrides", []):
        covered = o["first_n"] if o.get("first_n") is not None else math.floor(o["first_fraction"] * n_layers)
        if index < covered:
            return o["block"]
    return placement["block"]


def sublayer(b: BlockCtx, s: Tensor, x: Tensor, sub: Mapping[str, Any], prefix: str, G, alpha: float,
             beta: float) -> tuple[Tensor, Tensor]:
    """(s', β·branch) of one sublayer named ``prefix`` (``attn`` / ``ffn``)."""
    u = b.N(f"{prefix}_norm", s) if sub["in_norm"] else s
    h = G(u)
    if sub["out_norm"]:
        h = b.N(f"{prefix}_out_norm", h)
    skip = {"input": s, "normed": u, "block": x, "block+input": x + s}[sub["skip"]]
    out = alpha * skip + beta * h
    if sub["post_norm"]:
        out = b.N(f"{prefix}_post_norm", out)
    return out, beta * h


def spec_logits(state_dict: Mapping[str, Tensor], cfg, placement: Mapping[str, Any],
                ids: Tensor) -> tuple[Tensor, set[str]]:
    """float64 logits (B, T, V) of ``placement`` (a plain dict) and the set of state_dict keys read."""
    W = Weights(state_dict)
    L = cfg.n_layers
    x = W("embed.weight")[ids]
    if placement["embed_norm"]:
        x = norm(W, "embed_norm", x, cfg.norm, cfg.norm_eps)
    d = x
    for i in range(L):
        blk = block_of(placement, i, L)
        alpha = (2 * L) ** 0.25 if blk["residual_scale"] == "deepnorm" else float(blk["residual_scale"])
        beta = float(blk["branch_scale"])
        scale = 1 / math.sqrt(i + 1) if blk["depth_scaled_norms"] else 1.0
        b = ScaledCtx(W, cfg, i, blk["qkv_norm_scope"], blk["qkv_norm_order"], scale)
        letters = blk["qkv_norm"].upper()
        y, h_attn = sublayer(b, x, x, blk["attn"], "attn", lambda u, b=b, q=letters: b.A(u, q), alpha, beta)
        x, h_ffn = sublayer(b, y, x, blk["ffn"], "ffn", b.F, alpha, beta)
        d = d + h_attn + h_ffn
    if placement["dual_stream"]:
        x = x + norm(W, "dual_norm", d, cfg.norm, cfg.norm_eps)
    if placement["final_norm"]:
        x = norm(W, "final_norm", x, cfg.norm, cfg.norm_eps)
    head = W("embed.weight") if cfg.tie_embeddings else W("lm_head.weight")
    return x @ head.T, W.used
