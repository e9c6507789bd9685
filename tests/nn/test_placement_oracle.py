"""Every placement's logits against an independent hand-written oracle of SCHEMES.md (tests/oracle.py).

All weights, norm gains included, are randomized first so a gain applied in the wrong place (or not at
all) shows up. The oracle runs in float64 with explicit per-head loops; the library in float32.
"""

from __future__ import annotations

import oracle  # tests/oracle.py: the float64 reference (tests/ is on sys.path via its conftest)
import pytest
import torch

import hybridnorm as hn

TOL = 1e-5
B, T = 2, 12


def _norm_keys_by_block(keys: set[str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m in oracle.norm_modules(keys):
        parts = m.split(".")
        where = ".".join(parts[:2]) if parts[0] == "blocks" else "model"
        out.setdefault(where, set()).add(m)
    return out


def check(oracle_name: str, placement=None, *, scope: str | None = None, order: str | None = None,
          seed: int = 0, **overrides) -> float:
    """Build the library model, randomize it, compare logits and used weights with the oracle."""
    overrides.setdefault("n_layers", 4)
    cfg = hn.ModelConfig.from_preset("tiny", placement=placement or oracle_name, **overrides)
    torch.manual_seed(seed)
    model = oracle.randomize_(hn.TransformerLM(cfg), seed=seed).eval()
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        got = model(ids)
    sd = model.state_dict()
    want, used = oracle.oracle_logits(sd, cfg, oracle_name, ids, qkv_norm_scope=scope, qkv_norm_order=order)

    have_norms, used_norms = _norm_keys_by_block(set(sd)), _norm_keys_by_block(used)
    for where in sorted(set(have_norms) | set(used_norms)):
        h, u = have_norms.get(where, set()), used_norms.get(where, set())
        assert h == u, (f"{oracle_name} {where}: norm modules in the model but not in the equations: "
                        f"{sorted(h - u)}; in the equations but not in the model: {sorted(u - h)}")
    assert used == set(sd), f"{oracle_name}: weights the equations never read: {sorted(set(sd) - used)}"

    assert got.shape == want.shape == (B, T, cfg.embedding_size)
    assert got.dtype == torch.float32
    diff = (got.double() - want).abs().max().item()
    assert diff <= TOL, f"{oracle_name}: max |library - oracle| = {diff:.3g} > {TOL}"
    # a meaningful comparison: logits are O(1), not all ~0
    assert want.abs().max().item() > 0.1
    return diff


# -- coverage -------------------------------------------------------------------------------------------

def test_every_preset_has_oracle_equations():
    missing = [n for n in hn.placements.names() if n not in oracle.PRESETS]
    assert not missing, f"presets without oracle equations: {missing}"


def test_every_table6_name_has_oracle_equations():
    assert set(hn.placements.PAPER_NAMES) == set(oracle.TABLE6)


# -- every preset, every Table-6 name -------------------------------------------------------------------

@pytest.mark.parametrize("name", hn.placements.names())
def test_preset_matches_oracle(name):
    assert name in oracle.PRESETS, f"preset {name!r} has no oracle entry"
    check(name)


@pytest.mark.parametrize("name", hn.placements.PAPER_NAMES)
def test_table6_name_matches_oracle(name):
    check(name)


@pytest.mark.parametrize("norm", ["rms", "layer", "dyt"])
def test_every_grammar_name_matches_oracle(norm):
    """Table 6 is 12 names; the grammar admits 94 (3 attention words x 16 letter sets x 2 FFN words, less
    'Pre' and 'Post' alone). Each parses to its canonical spelling and computes the equations its words
    name, in every norm kind."""
    names = oracle.grammar_names()
    assert len(names) == 94 and set(hn.placements.PAPER_NAMES) <= set(names)
    for name in names:
        assert hn.placements.parse(name.lower().replace("-", "_")).name == name
        check(name, norm=norm, n_layers=2)  # through get(): some names are aliases of presets (QKV-Post)


# -- heads, norm kinds, depths ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["pre", "post", "hybridnorm", "hybridnorm_star", "span", "olmo2", "b2t"])
def test_untied_head_matches_oracle(name):
    check(name, tie_embeddings=False)


@pytest.mark.parametrize("name", ["pre", "post", "hybridnorm", "hybridnorm_star", "olmo2", "deepnorm",
                                  "lns", "QKVC-Post"])
def test_layernorm_matches_oracle(name):
    check(name, norm="layer")


@pytest.mark.parametrize("name", ["pre", "hybridnorm_star", "peri", "embed_norm", "QKVC-Post", "olmo2",
                                  "lns", "span"])
def test_dyt_matches_oracle(name):
    check(name, norm="dyt")


@pytest.mark.parametrize("n_layers", [4, 8, 5])
@pytest.mark.parametrize("name", ["mix_ln", "lns", "deepnorm", "hybridnorm_star", "span"])
def test_depth_dependent_presets(name, n_layers):
    check(name, n_layers=n_layers)


@pytest.mark.parametrize("kv", [1, 4])
@pytest.mark.parametrize("name", ["hybridnorm", "olmo2", "QKVC-Post", "KV-Post"])
def test_gqa_variants(name, kv):
    check(name, n_kv_heads=kv)


@pytest.mark.parametrize("name", ["hybridnorm_star", "olmo2", "QKVC-Post", "qk_norm"])
def test_decoupled_head_dim(name):
    """attn_head_dim != d_model / n_heads (Qwen3's layout): projections and norms follow the head size."""
    check(name, n_kv_heads=2, attn_head_dim=12)


def test_untied_padded_vocab():
    check("hybridnorm_star", tie_embeddings=False, vocab_size=250, pad_vocab_multiple=16)


# -- attention-internal norm options: scope full / order after RoPE --------------------------------------

@pytest.mark.parametrize(("scope", "order"), [("full", "before_rope"), ("head", "after_rope"),
                                              ("full", "after_rope")])
@pytest.mark.parametrize("name", ["hybridnorm", "hybridnorm_star", "QKVC-Post", "qk_norm"])
def test_qkv_norm_scope_and_order(name, scope, order):
    placement = hn.placements.get(name).replace_blocks(qkv_norm_scope=scope, qkv_norm_order=order)
    check(name, placement, scope=scope, order=order)


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_full_scope_with_gqa(kv):
    placement = hn.placements.get("hybridnorm").replace_blocks(qkv_norm_scope="full")
    check("hybridnorm", placement, scope="full", n_kv_heads=kv, norm="layer")


def test_olmo2_after_rope():
    placement = hn.placements.get("olmo2").replace_blocks(qkv_norm_order="after_rope")
    check("olmo2", placement, order="after_rope")


def test_order_and_scope_actually_matter():
    """Sanity of the oracle itself: the variants differ, so the tests above can tell them apart."""
    cfg = hn.ModelConfig.from_preset("tiny", placement="hybridnorm", n_layers=2)
    model = oracle.randomize_(hn.TransformerLM(cfg), seed=3)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    sd = model.state_dict()
    base, _ = oracle.oracle_logits(sd, cfg, "hybridnorm", ids)
    after, _ = oracle.oracle_logits(sd, cfg, "hybridnorm", ids, qkv_norm_order="after_rope")
    assert (base - after).abs().max() > 1e-3


# -- the spec's claim about the paper's Post-Norm baseline ------------------------------------------------

def test_post_shifted_is_textbook_post_on_normed_embedding():
    """SCHEMES.md: post_shifted = textbook Post-Norm applied to N(embedding). Map the library's
    post_shifted weights onto the oracle's textbook Post-Norm (with an embedding norm) and compare."""
    L = 4
    cfg = hn.ModelConfig.from_preset("tiny", placement="post_shifted", n_layers=L)
    model = oracle.randomize_(hn.TransformerLM(cfg), seed=7).eval()
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids)
    sd = model.state_dict()
    mapped = {k: v for k, v in sd.items() if not oracle.is_norm_param(k)}
    mapped["embed_norm.weight"] = sd["blocks.0.attn_norm.weight"]
    for i in range(L):
        mapped[f"blocks.{i}.attn_post_norm.weight"] = sd[f"blocks.{i}.ffn_norm.weight"]
        nxt = f"blocks.{i + 1}.attn_norm.weight" if i + 1 < L else "final_norm.weight"
        mapped[f"blocks.{i}.ffn_post_norm.weight"] = sd[nxt]
    textbook = oracle.Scheme(oracle.every(oracle.post), final_norm=False, embed_norm=True)
    oracle.SCHEMES["_post_on_normed_embedding"] = textbook
    try:
        want, used = oracle.oracle_logits(mapped, cfg, "_post_on_normed_embedding", ids)
    finally:
        del oracle.SCHEMES["_post_on_normed_embedding"]
    assert used == set(mapped)
    assert (got.double() - want).abs().max().item() <= TOL
