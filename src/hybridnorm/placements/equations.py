"""Render a placement as the equations of its forward pass, in the paper's notation.

The docs and every preset's docstring are generated from here, so the prose cannot drift from the
spec that the model actually runs. Notation: ``X`` block input, ``Y`` mid-block stream, ``X'`` block
output, ``N`` a norm, ``MHA_#`` attention with per-head norms on the letters ``#``, ``D`` ResiDual's
second stream, ``α`` residual scale, ``β`` branch scale, ``N_l = N/√l`` (LayerNorm Scaling).
"""

from __future__ import annotations

from hybridnorm.placements.spec import BlockSpec, Override, Placement, SublayerSpec


def _branch(spec: SublayerSpec, block: BlockSpec, s: str, op: str) -> str:
    """What the sublayer adds to its skip: ``op`` on its (normed) input, normed and scaled as the spec says."""
    n = "N_l" if block.depth_scaled_norms else "N"
    u = f"{n}({s})" if spec.in_norm else s
    branch = f"{op}({u})"
    if spec.out_norm:
        branch = f"{n}({branch})"
    return f"β·{branch}" if block.branch_scale != 1.0 else branch


def _sublayer(spec: SublayerSpec, block: BlockSpec, s: str, x: str, op: str) -> str:
    n = "N_l" if block.depth_scaled_norms else "N"
    branch = _branch(spec, block, s, op)
    skip = {"input": s, "normed": f"{n}({s})", "block": x, "block+input": f"{x} + {s}"}[spec.skip]
    if block.residual_scale != 1.0:
        skip = f"α·({skip})" if " + " in skip else f"α·{skip}"
    total = f"{skip} + {branch}"
    return f"{n}({total})" if spec.post_norm else total


def attention_name(block: BlockSpec) -> str:
    letters = block.qkv_norm.upper()
    if not letters:
        return "MHA"
    notes = []
    if block.qkv_norm_scope != "head":
        notes.append("full-width")
    if block.qkv_norm_order != "before_rope" and any(c in letters for c in "QK"):
        notes.append("after RoPE")
    return f"MHA_{letters}" + (f"[{', '.join(notes)}]" if notes else "")


def block_equations(block: BlockSpec) -> str:
    """``Y = …;  X' = …`` for one block."""
    attn = _sublayer(block.attn, block, "X", "X", attention_name(block))
    ffn = _sublayer(block.ffn, block, "Y", "X", "FFN")
    return f"Y = {attn};  X' = {ffn}"


def _which(o: Override) -> str:
    if o.first_n is not None:
        return "block 1" if o.first_n == 1 else f"blocks 1..{o.first_n}"
    return f"blocks l ≤ ⌊{o.first_fraction:g}·L⌋"


def constants(placement: Placement) -> list[str]:
    """The non-default constants the equations refer to (α, β, N_l)."""
    out: list[str] = []
    blocks = [placement.block, *(o.block for o in placement.overrides)]
    for b in blocks:
        if b.residual_scale == "deepnorm":
            out.append("α = (2L)^¼")
        elif b.residual_scale != 1.0:
            out.append(f"α = {b.residual_scale:g}")
        if b.branch_scale != 1.0:
            out.append(f"β = {b.branch_scale:g}")
        if b.depth_scaled_norms:
            out.append("N_l(z) = N(z)/√l in block l")
    return list(dict.fromkeys(out))


def equations(placement: Placement) -> list[str]:
    """One line per distinct block form, then the embedding and head lines."""
    lines = []
    if placement.embed_norm:
        lines.append("X₁ = N(Embed(tokens))")
    for o in placement.overrides:
        lines.append(f"{_which(o)}: {block_equations(o.block)}")
    prefix = "other blocks: " if placement.overrides else ""
    lines.append(prefix + block_equations(placement.block))
    out = "X'_L"
    if placement.dual_stream:  # ResiDual: one line for the second stream (the main block's branches)
        b = placement.block
        attn, ffn = _branch(b.attn, b, "X", attention_name(b)), _branch(b.ffn, b, "Y", "FFN")
        lines.append(f"D₁ = X₁;  D' = D + {attn} + {ffn}")
        out = "X'_L + N(D_L)"
    lines.append(f"logits = Head(N({out}))" if placement.final_norm else f"logits = Head({out})  (no final N)")
    consts = constants(placement)
    if consts:
        lines.append("where " + ", ".join(consts))
    return lines


def one_line(placement: Placement) -> str:
    return ";  ".join(equations(placement))
