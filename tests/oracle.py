"""An independent, plain functional reference of every normalization placement.

Written by hand from ``shared/spec/SCHEMES.md`` (§1 tables and §2 table), NOT from the library's block
code or its placement spec objects: the only thing taken from the library is the state_dict layout, used
to fetch weights. Everything is computed in float64 with explicit per-head loops, a hand-written
RMSNorm / LayerNorm / DyT, RoPE ("rotate half"), masked-softmax causal attention with GQA and SwiGLU.

Usage::

    logits, used = oracle_logits(model.state_dict(), cfg, "hybridnorm", ids)

``used`` is the set of state_dict keys the equations read; a test asserts it equals the model's key set,
so a norm weight the equations need but the model lacks fails (KeyError -> AssertionError), and a norm
weight the model has but the equations do not use fails too.

Block equations are written as ``fn(b, x) -> x'`` with ``b.N(slot, z)`` a block norm (slot = the module
name the library gives it: ``attn_norm``, ``attn_out_norm``, ``attn_post_norm``, ``ffn_norm``,
``ffn_out_norm``, ``ffn_post_norm``), ``b.A(u, "#")`` = MHA_# (attention incl. W_O, per-head norms on the
letters #) and ``b.F(u)`` the FFN; ``b.l`` is the 1-based block index and ``b.L`` the number of blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

F64 = torch.float64


# ----------------------------------------------------------------------------------------------------
# primitives
# ----------------------------------------------------------------------------------------------------

class Weights:
    """float64 copies of a state_dict; records every key read."""

    def __init__(self, state_dict: Mapping[str, Tensor]) -> None:
        self.sd = {k: v.detach().to(F64) for k, v in state_dict.items()}
        self.used: set[str] = set()

    def __call__(self, key: str) -> Tensor:
        if key not in self.sd:
            raise AssertionError(f"the equations need weight {key!r} but the model has no such weight")
        self.used.add(key)
        return self.sd[key]


def norm(W: Weights, prefix: str, z: Tensor, kind: str, eps: float) -> Tensor:
    """N(z) over the last dim; ``prefix`` the module name (``blocks.0.attn_norm``)."""
    g = W(prefix + ".weight")
    if g.shape[-1] != z.shape[-1]:
        raise AssertionError(f"{prefix}.weight has {g.shape[-1]} features, the equations norm over "
                             f"{z.shape[-1]}")
    if kind == "rms":
        return z / torch.sqrt((z * z).mean(-1, keepdim=True) + eps) * g
    if kind == "layer":
        mu = z.mean(-1, keepdim=True)
        var = ((z - mu) ** 2).mean(-1, keepdim=True)
        return (z - mu) / torch.sqrt(var + eps) * g
    if kind == "dyt":
        return torch.tanh(W(prefix + ".alpha") * z) * g + W(prefix + ".bias")
    raise ValueError(kind)


def rope(t: Tensor, theta: float, start: int = 0) -> Tensor:
    """Rotate-half RoPE of t (B, T, h, D) at positions start..start+T-1."""
    T, D = t.shape[1], t.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=F64) / D)           # (D/2,)
    ang = torch.arange(start, start + T, dtype=F64)[:, None] * inv_freq[None]  # (T, D/2)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]                    # (T, 1, D/2)
    x1, x2 = t[..., : D // 2], t[..., D // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def softmax(s: Tensor) -> Tensor:
    e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def silu(z: Tensor) -> Tensor:
    return z / (1.0 + torch.exp(-z))


# ----------------------------------------------------------------------------------------------------
# one block's building blocks: N, A (MHA_#), F
# ----------------------------------------------------------------------------------------------------

class BlockCtx:
    def __init__(self, W: Weights, cfg, index: int, scope: str, order: str) -> None:
        self.W, self.cfg, self.i = W, cfg, index
        self.l, self.L = index + 1, cfg.n_layers
        self.scope, self.order = scope, order

    def _norm(self, prefix: str, z: Tensor) -> Tensor:
        return norm(self.W, prefix, z, self.cfg.norm, self.cfg.norm_eps)

    def N(self, slot: str, z: Tensor) -> Tensor:
        return self._norm(f"blocks.{self.i}.{slot}", z)

    def A(self, u: Tensor, letters: str = "") -> Tensor:
        """MHA_#(u): causal GQA attention with per-head (or full-width) norms on ``letters``, then W_O."""
        cfg, W = self.cfg, self.W
        H, Hkv = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
        D = cfg.head_dim
        p = f"blocks.{self.i}.attn"
        B, T, _ = u.shape
        qkv = u @ W(p + ".w_qkv.weight").T                   # rows [q heads; k heads; v heads]
        q = qkv[..., : H * D].reshape(B, T, H, D)
        k = qkv[..., H * D: (H + Hkv) * D].reshape(B, T, Hkv, D)
        v = qkv[..., (H + Hkv) * D:].reshape(B, T, Hkv, D)
        assert qkv.shape[-1] == (H + 2 * Hkv) * D

        def inner(letter: str, t: Tensor) -> Tensor:
            if letter not in letters:
                return t
            name = f"{p}.{letter.lower()}_norm"
            if self.scope == "head":                    # one gain of length D shared by all heads
                return self._norm(name, t)
            assert self.scope == "full"                 # over all heads at once
            return self._norm(name, t.reshape(B, T, -1)).reshape(t.shape)

        v = inner("V", v)
        if self.order == "before_rope":
            q, k = inner("Q", q), inner("K", k)
        q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
        if self.order == "after_rope":
            q, k = inner("Q", q), inner("K", k)

        causal = torch.ones(T, T, dtype=torch.bool).tril()
        group = H // Hkv
        heads = torch.zeros(B, T, H, D, dtype=F64)
        for b in range(B):
            for h in range(H):
                j = h // group                          # kv head j serves query heads j*group .. +group-1
                scores = q[b, :, h] @ k[b, :, j].T / math.sqrt(D)     # (T, T)
                scores = scores.masked_fill(~causal, float("-inf"))
                heads[b, :, h] = softmax(scores) @ v[b, :, j]
        heads = inner("C", heads)                       # per head, before concat and W_O
        return heads.reshape(B, T, H * D) @ W(p + ".w_o.weight").T

    def F(self, u: Tensor) -> Tensor:
        """SwiGLU: w_out(silu(gate) * up), w_in rows [gate; up]."""
        w_in = self.W(f"blocks.{self.i}.ffn.w_in.weight")
        hidden = w_in.shape[0] // 2
        gate, up = u @ w_in[:hidden].T, u @ w_in[hidden:].T
        return (silu(gate) * up) @ self.W(f"blocks.{self.i}.ffn.w_out.weight").T


BlockFn = Callable[[BlockCtx, Tensor], Tensor]


# ----------------------------------------------------------------------------------------------------
# the equations (SCHEMES.md), one small function each
# ----------------------------------------------------------------------------------------------------

# attention halves of the paper's grammar (§1): Y = X + MHA_#(X) | X + MHA_#(N(X)) | N(X) + MHA_#(N(X))
def attn_plain(b: BlockCtx, x: Tensor, letters: str) -> Tensor:
    return x + b.A(x, letters)


def attn_pre(b: BlockCtx, x: Tensor, letters: str) -> Tensor:
    return x + b.A(b.N("attn_norm", x), letters)


def attn_post(b: BlockCtx, x: Tensor, letters: str) -> Tensor:
    n = b.N("attn_norm", x)
    return n + b.A(n, letters)


# FFN halves: X' = Y + FFN(N(Y)) (Pre) | N(Y) + FFN(N(Y)) (the paper's "Post")
def ffn_pre(b: BlockCtx, y: Tensor) -> Tensor:
    return y + b.F(b.N("ffn_norm", y))


def ffn_post(b: BlockCtx, y: Tensor) -> Tensor:
    n = b.N("ffn_norm", y)
    return n + b.F(n)


def pre(b: BlockCtx, x: Tensor) -> Tensor:
    """Y = X + MHA(N(X));  X' = Y + FFN(N(Y))"""
    y = x + b.A(b.N("attn_norm", x))
    return y + b.F(b.N("ffn_norm", y))


def post(b: BlockCtx, x: Tensor) -> Tensor:
    """Textbook: Y = N(X + MHA(X));  X' = N(Y + FFN(Y))"""
    y = b.N("attn_post_norm", x + b.A(x))
    return b.N("ffn_post_norm", y + b.F(y))


def post_shifted(b: BlockCtx, x: Tensor) -> Tensor:
    """Y = N(X) + MHA(N(X));  X' = N(Y) + FFN(N(Y))   (with a final N)"""
    n = b.N("attn_norm", x)
    y = n + b.A(n)
    m = b.N("ffn_norm", y)
    return m + b.F(m)


def hybridnorm(b: BlockCtx, x: Tensor) -> Tensor:
    """QKV-Post: Y = X + MHA_QKV(X);  X' = N(Y) + FFN(N(Y))"""
    y = x + b.A(x, "QKV")
    n = b.N("ffn_norm", y)
    return n + b.F(n)


def pre_qkv_pre(b: BlockCtx, x: Tensor) -> Tensor:
    """Y = X + MHA_QKV(N(X));  X' = Y + FFN(N(Y))"""
    y = x + b.A(b.N("attn_norm", x), "QKV")
    return y + b.F(b.N("ffn_norm", y))


def qkv_pre(b: BlockCtx, x: Tensor) -> Tensor:
    """Y = X + MHA_QKV(X);  X' = Y + FFN(N(Y))"""
    y = x + b.A(x, "QKV")
    return y + b.F(b.N("ffn_norm", y))


def qk_norm(b: BlockCtx, x: Tensor) -> Tensor:
    """Pre-QK-Pre: Y = X + MHA_QK(N(X));  X' = Y + FFN(N(Y))"""
    y = x + b.A(b.N("attn_norm", x), "QK")
    return y + b.F(b.N("ffn_norm", y))


def span(b: BlockCtx, x: Tensor) -> Tensor:
    """y = N1(x + A(u)), u = N0(x) in block 1 else x;  x' = N2(x + F(y))  (FFN skip = BLOCK input)"""
    u = b.N("attn_norm", x) if b.l == 1 else x
    y = b.N("attn_post_norm", x + b.A(u))
    return b.N("ffn_post_norm", x + b.F(y))


def peri(b: BlockCtx, x: Tensor) -> Tensor:
    """h = x + N_o(A(N_i(x)));  x' = h + N_o'(F(N_i'(h)))"""
    h = x + b.N("attn_out_norm", b.A(b.N("attn_norm", x)))
    return h + b.N("ffn_out_norm", b.F(b.N("ffn_norm", h)))


def olmo2(b: BlockCtx, x: Tensor) -> Tensor:
    """h = x + N(A_QK(x));  x' = h + N(F(h))   (QK norm full width, before RoPE: set on the scheme)"""
    h = x + b.N("attn_out_norm", b.A(x, "QK"))
    return h + b.N("ffn_out_norm", b.F(h))


def deepnorm(b: BlockCtx, x: Tensor) -> Tensor:
    """x' = N(α·x + G(x)) per sublayer, α = (2L)^¼"""
    alpha = (2 * b.L) ** 0.25
    y = b.N("attn_post_norm", alpha * x + b.A(x))
    return b.N("ffn_post_norm", alpha * y + b.F(y))


def lns(b: BlockCtx, x: Tensor) -> Tensor:
    """Pre-Norm with each N output in block l multiplied by 1/√l"""
    s = 1.0 / math.sqrt(b.l)
    y = x + b.A(b.N("attn_norm", x) * s)
    return y + b.F(b.N("ffn_norm", y) * s)


def b2t(b: BlockCtx, x: Tensor) -> Tensor:
    """h = N(x + A(x));  x' = N(x + h + F(h))"""
    h = b.N("attn_post_norm", x + b.A(x))
    return b.N("ffn_post_norm", x + h + b.F(h))


def resi_dual(b: BlockCtx, x: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """ResiDual, per sublayer f: post stream x <- N(x + f(x)), dual stream d <- d + f(x) (§2 table)"""
    a = b.A(x)
    h = b.N("attn_post_norm", x + a)
    f = b.F(h)
    return b.N("ffn_post_norm", h + f), d + a + f


@dataclass(frozen=True)
class Scheme:
    block: Callable[[int, int], BlockFn]   # (l 1-based, L) -> the equations of block l
    final_norm: bool = True
    embed_norm: bool = False
    # ResiDual: (b, x, d) -> (x', d'), d starting at block 1's input (microsoft/ResiDual: res = x), and
    # the output x_L + N(d_L) (norm "dual_norm"); `block` is unused then
    dual: Callable[[BlockCtx, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None
    scope: str = "head"
    order: str = "before_rope"


def every(fn: BlockFn) -> Callable[[int, int], BlockFn]:
    return lambda layer, n_layers: fn


def first_block(first: BlockFn, rest: BlockFn) -> Callable[[int, int], BlockFn]:
    return lambda layer, n_layers: first if layer == 1 else rest


def mix_ln(layer: int, n_layers: int) -> BlockFn:
    """blocks l <= floor(0.25 L) Post-Norm, the rest Pre-Norm"""
    return post if layer <= math.floor(0.25 * n_layers) else pre


def _g(attn: Callable[[BlockCtx, Tensor, str], Tensor], letters: str,
       ffn: Callable[[BlockCtx, Tensor], Tensor]) -> BlockFn:
    return lambda b, x: ffn(b, attn(b, x, letters))


# The presets (§1 and §2).
PRESETS: dict[str, Scheme] = {
    "pre": Scheme(every(pre)),
    "post": Scheme(every(post), final_norm=False),
    "post_shifted": Scheme(every(post_shifted)),
    "hybridnorm": Scheme(every(hybridnorm)),
    "hybridnorm_star": Scheme(first_block(pre_qkv_pre, hybridnorm)),
    "first_qkv_pre": Scheme(first_block(qkv_pre, hybridnorm)),
    "embed_norm": Scheme(every(hybridnorm), embed_norm=True),
    "qk_norm": Scheme(every(qk_norm)),
    "span": Scheme(every(span), final_norm=False),
    "peri": Scheme(every(peri)),
    "olmo2": Scheme(every(olmo2), scope="full"),
    "deepnorm": Scheme(every(deepnorm), final_norm=False),
    "mix_ln": Scheme(mix_ln),
    "lns": Scheme(every(lns)),
    "b2t": Scheme(every(b2t), final_norm=False),
    "resi_dual": Scheme(every(post), final_norm=False, dual=resi_dual),
}

# The paper's Table 6 names, grammar [Pre-|Post-]<#>-<Pre|Post>, each with a final N.
TABLE6: dict[str, Scheme] = {
    "QKVC-Post": Scheme(every(_g(attn_plain, "QKVC", ffn_post))),
    "QKC-Post": Scheme(every(_g(attn_plain, "QKC", ffn_post))),
    "QK-Post": Scheme(every(_g(attn_plain, "QK", ffn_post))),
    "KV-Post": Scheme(every(_g(attn_plain, "KV", ffn_post))),
    "KC-Post": Scheme(every(_g(attn_plain, "KC", ffn_post))),
    "QKV-Post": Scheme(every(_g(attn_plain, "QKV", ffn_post))),
    "Pre-QKV-Post": Scheme(every(_g(attn_pre, "QKV", ffn_post))),
    "Pre-QKV-Pre": Scheme(every(_g(attn_pre, "QKV", ffn_pre))),
    "Pre-QK-Pre": Scheme(every(_g(attn_pre, "QK", ffn_pre))),
    "QKV-Pre": Scheme(every(_g(attn_plain, "QKV", ffn_pre))),
    "Post-Pre": Scheme(every(_g(attn_post, "", ffn_pre))),
    "Pre-Post": Scheme(every(_g(attn_pre, "", ffn_post))),
}

SCHEMES: dict[str, Scheme] = {**PRESETS, **TABLE6}

# The whole grammar, beyond Table 6: the attention word (none / Pre / Post), any subset of QKVC, the FFN word.
GRAMMAR_ATTN: dict[str, Callable[[BlockCtx, Tensor, str], Tensor]] = {
    "": attn_plain, "Pre": attn_pre, "Post": attn_post}
GRAMMAR_FFN: dict[str, Callable[[BlockCtx, Tensor], Tensor]] = {"Pre": ffn_pre, "Post": ffn_post}


def grammar_names() -> list[str]:
    """Every name the grammar ``[Pre|Post-][letters-]Pre|Post`` admits (two or three words), letters in
    QKVC order: 3 attention words x 16 letter sets x 2 FFN words, less the two one-word names."""
    subsets = ["", *sorted({"".join(c for j, c in enumerate("QKVC") if m >> j & 1) for m in range(1, 16)})]
    names = ["-".join(w for w in (a, letters, f) if w) for a in GRAMMAR_ATTN for letters in subsets
             for f in GRAMMAR_FFN]
    return [n for n in names if "-" in n]


def grammar_scheme(name: str) -> Scheme:
    """The equations of a grammar name, read from its words (the paper's §1 tables), with a final N."""
    *head, last = name.split("-")
    attn = head.pop(0) if head and head[0] in ("Pre", "Post") else ""
    letters = head.pop(0) if head else ""
    return Scheme(every(_g(GRAMMAR_ATTN[attn], letters, GRAMMAR_FFN[last])))


def scheme(name: str) -> Scheme:
    if name in SCHEMES:
        return SCHEMES[name]
    if name in grammar_names():
        return grammar_scheme(name)
    raise KeyError(f"the oracle has no equations for placement {name!r}")


# ----------------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------------

def oracle_logits(state_dict: Mapping[str, Tensor], cfg, name: str, ids: Tensor, *,
                  qkv_norm_scope: str | None = None,
                  qkv_norm_order: str | None = None) -> tuple[Tensor, set[str]]:
    """float64 logits (B, T, V) of placement ``name`` and the set of state_dict keys read."""
    s = scheme(name)
    scope = qkv_norm_scope or s.scope
    order = qkv_norm_order or s.order
    W = Weights(state_dict)
    x = W("embed.weight")[ids]
    if s.embed_norm:
        x = norm(W, "embed_norm", x, cfg.norm, cfg.norm_eps)
    L = cfg.n_layers
    d = x
    for i in range(L):
        b = BlockCtx(W, cfg, i, scope, order)
        if s.dual is not None:
            x, d = s.dual(b, x, d)
        else:
            x = s.block(i + 1, L)(b, x)
    if s.dual is not None:
        x = x + norm(W, "dual_norm", d, cfg.norm, cfg.norm_eps)
    if s.final_norm:
        x = norm(W, "final_norm", x, cfg.norm, cfg.norm_eps)
    head = W("embed.weight") if cfg.tie_embeddings else W("lm_head.weight")
    return x @ head.T, W.used


# ----------------------------------------------------------------------------------------------------
# helpers for tests
# ----------------------------------------------------------------------------------------------------

def is_norm_param(name: str) -> bool:
    module = name.rsplit(".", 1)[0]
    return module.split(".")[-1].endswith("norm")


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights everywhere, norm gains included (1 + 0.3·randn), so gain bugs show up."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float64)
        leaf = name.rsplit(".", 1)[-1]
        if is_norm_param(name):
            val = {"weight": 1.0 + 0.3 * r, "alpha": 0.5 + 0.1 * r, "bias": 0.1 * r}[leaf]
        elif p.ndim == 2:                            # (out, in) linear / (V, d) embedding
            val = r / math.sqrt(p.shape[-1])
        elif p.ndim == 3:                            # stacked experts (E, in, out)
            val = r / math.sqrt(p.shape[-2])
        else:
            val = 0.1 * r
        p.copy_(val.to(p.dtype))
    return model


def norm_modules(keys: set[str] | list[str]) -> set[str]:
    """The norm module prefixes among state_dict keys (``blocks.0.attn.q_norm``, ``final_norm`` ...)."""
    return {k.rsplit(".", 1)[0] for k in keys if is_norm_param(k)}
