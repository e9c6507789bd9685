"""Named placements: the presets, and the paper's grammar ``[Pre-|Post-]<#>-<Pre|Post>``.

Presets are entries in a dict; each line below reads as "which slots are on". Names are
case-insensitive and ``-``, ``_`` and blanks are interchangeable separators, in preset and grammar names alike
(``Pre QKV Post`` is ``Pre-QKV-Post``, ``OLMo-2 reordered`` is ``olmo_2_reordered``; a run of blanks is one
separator; an empty part between ``-``/``_``, ``Pre-`` or ``Pre--Pre``, is refused, not read as another name).
A name that is not a preset is parsed by the grammar (``QKV-Post``, ``Pre-QK-Pre``, ``Post-Pre`` …), so
every ablation of the paper's Table 6 — and any other subset of Q, K, V, C — is available without being listed by hand.
"""

from __future__ import annotations

import dataclasses

from hybridnorm.errors import ConfigError
from hybridnorm.placements.spec import QKVC, BlockSpec, Override, Placement, SublayerSpec

NONE = SublayerSpec()                                   # G(s) added to s, no norm at all
PRE = SublayerSpec(in_norm=True)                        # s + G(N(s))
POST_FFN = SublayerSpec(in_norm=True, skip="normed")    # N(s) + G(N(s))   (the paper's "Post")
POST = SublayerSpec(post_norm=True)                     # N(s + G(s))      (textbook Post-Norm)
SANDWICH = SublayerSpec(in_norm=True, out_norm=True)    # s + N(G(N(s)))
OUT = SublayerSpec(out_norm=True)                       # s + N(G(s))

PRE_BLOCK = BlockSpec(attn=PRE, ffn=PRE)
POST_BLOCK = BlockSpec(attn=POST, ffn=POST)
HYBRID_BLOCK = BlockSpec(attn=NONE, ffn=POST_FFN, qkv_norm="QKV")

_PRESETS: dict[str, Placement] = {}
_ALIASES: dict[str, str] = {}

# The ablation names of the paper's Table 6, all parsed by the grammar.
PAPER_NAMES: tuple[str, ...] = (
    "QKVC-Post", "QKC-Post", "QK-Post", "KV-Post", "KC-Post", "QKV-Post",
    "Pre-QKV-Post", "Pre-QKV-Pre", "Pre-QK-Pre", "QKV-Pre", "Post-Pre", "Pre-Post",
)

GRAMMAR = (
    "[<Pre|Post>-][<letters from QKVC>-]<Pre|Post>, in any case, its parts separated by '-', '_' or blanks: "
    "the optional first word is the attention input "
    "norm (Pre: X + MHA(N(X)); Post: N(X) + MHA(N(X))), the letters are the per-head norms inside "
    "attention, the last word is the FFN (Pre: Y + FFN(N(Y)); Post: N(Y) + FFN(N(Y))); "
    "e.g. QKV-Post, Pre-QK-Pre, Post-Pre"
)


def _key(name: str) -> str:
    return "_".join(name.strip().lower().replace("-", " ").replace("_", " ").split())


def _refusal(name: str, why: str = "") -> ConfigError:
    return ConfigError(f"placement {name!r} {why}is not a preset ({', '.join(names())}) "
                       f"nor a grammar name ({GRAMMAR})")


def _check_parts(name: str) -> None:
    """Refuse a name with an empty part between ``-``/``_`` (``Pre-``, ``Pre--Pre``, ``-pre``): ``_key`` and
    the grammar would drop it and read another, valid name, so a typo would train a placement nobody asked
    for. Blanks separate parts too (the spec's own names are written ``OLMo-2 reordered``), a run of them
    counting as one, as a name is typed. An empty name is no preset and no grammar name, refused as such."""
    if name.strip() and any(not part.strip() for part in name.strip().replace("_", "-").split("-")):
        raise _refusal(name, "has an empty part between '-'/'_': it ")


def register(placement: Placement) -> Placement:
    """Add a preset (and its aliases) to the registry; the name must be new."""
    placement.validate()
    key = _key(placement.name)
    if key in _PRESETS or key in _ALIASES:
        raise ConfigError(f"placement {placement.name!r} is already registered")
    _PRESETS[key] = placement
    for alias in placement.aliases:
        _ALIASES[_key(alias)] = key
    return placement


def names() -> list[str]:
    """The registered preset names (aliases and grammar names not included)."""
    return sorted(_PRESETS)


def aliases() -> dict[str, str]:
    return dict(_ALIASES)


def parse(name: str) -> Placement:
    """Parse a grammar name such as ``Pre-QKV-Post`` (or ``pre_qkv_post``, ``Pre QKV Post``: ``-``, ``_`` and
    blanks separate its words, as in a preset's name) into a placement."""
    _check_parts(name)
    words = name.replace("_", " ").replace("-", " ").split()  # after _check_parts: no empty part is dropped
    bad = _refusal(name)
    if len(words) not in (2, 3) or words[-1].lower() not in ("pre", "post"):
        raise bad
    *head, last = (w.lower() for w in words)
    attn_word = head.pop(0) if head[0] in ("pre", "post") else ""
    letters = head.pop(0).upper() if head else ""
    if head or any(c not in QKVC for c in letters) or len(set(letters)) != len(letters):
        raise bad
    letters = "".join(c for c in QKVC if c in letters)
    attn = {"": NONE, "pre": PRE, "post": SublayerSpec(in_norm=True, skip="normed")}[attn_word]
    ffn = POST_FFN if last == "post" else PRE
    canonical = "-".join(w for w in (attn_word.capitalize(), letters, last.capitalize()) if w)
    return Placement(
        name=canonical,
        block=BlockSpec(attn=attn, ffn=ffn, qkv_norm=letters),
        init="megatron" if (letters or ffn is POST_FFN) else "normal",
        summary="Grammar placement (paper Table 6 notation).",
        source="HybridNorm, arXiv 2503.04598, Table 6 grammar",
    ).validate()


def get(name: str | Placement) -> Placement:
    """The placement for a preset name, an alias, or a grammar name (case-insensitive)."""
    if isinstance(name, Placement):
        return name.validate()
    if not isinstance(name, str):
        raise ConfigError(f"placement must be a name or a Placement, got {type(name).__name__}")
    _check_parts(name)
    key = _key(name)
    key = _ALIASES.get(key, key)
    if key in _PRESETS:
        return _PRESETS[key]
    return parse(name)


def _preset(name: str, block: BlockSpec, *, summary: str, source: str, init: str = "normal",
            overrides: tuple[Override, ...] = (), final_norm: bool = True, embed_norm: bool = False,
            dual_stream: bool = False, aliases: tuple[str, ...] = ()) -> None:
    register(Placement(name=name, block=block, overrides=overrides, final_norm=final_norm,
                       embed_norm=embed_norm, dual_stream=dual_stream, init=init, summary=summary, source=source,
                       aliases=aliases))


_preset("pre", PRE_BLOCK, aliases=("pre_norm", "pre_ln"),
        summary="Pre-Norm: the norm sits on each sublayer input; the residual stream is never normed.",
        source="Xiong et al. 2020 (arXiv 2002.04745); Llama")
_preset("post", POST_BLOCK, final_norm=False, aliases=("post_norm", "post_ln"),
        summary="Textbook Post-Norm: the norm follows each residual add; the stream leaves normed.",
        source="Vaswani et al. 2017")
_preset("post_shifted", BlockSpec(attn=SublayerSpec(in_norm=True, skip="normed"), ffn=POST_FFN),
        summary="The paper's Post-Norm baseline as its code computes it: N at the start of each sublayer, "
                "residual from the normed stream, final N = textbook Post-Norm applied to N(embedding).",
        source="HybridNorm reference code (OLMo fork)", aliases=("post_post",))
_preset("hybridnorm", HYBRID_BLOCK, init="megatron", aliases=("hybrid", "qkv_post"),
        summary="HybridNorm: per-head norms on Q, K, V inside attention; Post-Norm-style FFN.",
        source="HybridNorm, arXiv 2503.04598")
_preset("hybridnorm_star", HYBRID_BLOCK, init="megatron", aliases=("hybridnorm*", "hybrid_star"),
        overrides=(Override(BlockSpec(attn=PRE, ffn=PRE, qkv_norm="QKV"), first_n=1),),
        summary="HybridNorm*: HybridNorm, but block 1 is Pre-QKV-Pre (Pre-Norm on both sublayers).",
        source="HybridNorm, arXiv 2503.04598")
_preset("first_qkv_pre", HYBRID_BLOCK, init="megatron",
        overrides=(Override(BlockSpec(attn=NONE, ffn=PRE, qkv_norm="QKV"), first_n=1),),
        summary="HybridNorm whose block 1 is QKV-Pre (Pre-Norm FFN only).",
        source="HybridNorm, arXiv 2503.04598, Table 7")
_preset("embed_norm", HYBRID_BLOCK, init="megatron", embed_norm=True, aliases=("embednorm",),
        summary="HybridNorm with a norm on the token embeddings.",
        source="HybridNorm, arXiv 2503.04598, Table 7")
_preset("qk_norm", BlockSpec(attn=PRE, ffn=PRE, qkv_norm="QK"), aliases=("pre_qk_pre",),
        summary="Pre-Norm plus per-head norms on Q and K (= Pre-QK-Pre).",
        source="Dehghani et al. 2023 (arXiv 2302.05442); Qwen3")
_preset("span", BlockSpec(attn=POST, ffn=SublayerSpec(skip="block", post_norm=True)), final_norm=False,
        overrides=(Override(BlockSpec(attn=SublayerSpec(in_norm=True, post_norm=True),
                                      ffn=SublayerSpec(skip="block", post_norm=True)), first_n=1),),
        aliases=("spannorm",),
        summary="SpanNorm: the FFN's skip spans the whole block (back to X); both adds are Post-normed; "
                "block 1 also norms the attention input. α and β are this project's reading of the "
                "paper's scaling strategy (default 1; set residual_scale / branch_scale).",
        source="SpanNorm, arXiv 2601.22580 (ICML 2026), as read from a public re-implementation")
_preset("peri", BlockSpec(attn=SANDWICH, ffn=SANDWICH), aliases=("sandwich", "peri_ln"),
        summary="Peri-LN / Sandwich: norms on both the input and the output of every sublayer.",
        source="Peri-LN, arXiv 2502.02732; Gemma 2; Grok")
_preset("olmo2", BlockSpec(attn=OUT, ffn=OUT, qkv_norm="QK", qkv_norm_scope="full"),
        aliases=("olmo2_reordered", "olmo_2", "olmo_2_reordered", "output_norm"),
        summary="OLMo-2 reordered norm: norms on sublayer outputs only, full-width QK-norm before RoPE.",
        source="OLMo 2, arXiv 2501.00656; HF Olmo2ForCausalLM")
_preset("deepnorm", dataclasses.replace(POST_BLOCK, residual_scale="deepnorm"), final_norm=False,
        init="deepnorm",
        summary="DeepNorm: Post-Norm with the skip up-weighted by α and V/O/FFN init scaled by β = (8L)^-¼.",
        source="DeepNet, arXiv 2203.00555")
_preset("mix_ln", PRE_BLOCK, overrides=(Override(POST_BLOCK, first_fraction=0.25),), aliases=("mixln",),
        summary="Mix-LN: Post-Norm in the first ⌊0.25·L⌋ blocks, Pre-Norm after them.",
        source="Mix-LN, arXiv 2412.13795")
_preset("lns", dataclasses.replace(PRE_BLOCK, depth_scaled_norms=True), aliases=("layernorm_scaling",),
        summary="LayerNorm Scaling: Pre-Norm with every norm output in block l scaled by 1/√l.",
        source="arXiv 2502.05795")
_preset("b2t", BlockSpec(attn=POST, ffn=SublayerSpec(skip="block+input", post_norm=True)), final_norm=False,
        summary="Bottom-to-top connection: Post-Norm whose FFN skip also carries the block input X.",
        source="B2T, arXiv 2206.00330")
_preset("resi_dual", POST_BLOCK, final_norm=False, dual_stream=True, aliases=("residual",),
        summary="ResiDual: Post-Norm blocks, plus a second, never-normed stream that sums every sublayer's "
                "output from the block-1 input on; the output is the Post-Norm stream plus that stream normed.",
        source="ResiDual, arXiv 2304.14802; microsoft/ResiDual")
