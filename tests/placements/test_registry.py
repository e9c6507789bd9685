"""The registry and the paper's grammar: names parse to the specs the paper's notation describes."""

import pytest

import hybridnorm as hn
from hybridnorm import ConfigError, placements
from hybridnorm.placements import BlockSpec, Override, Placement, SublayerSpec
from hybridnorm.placements.docs import render

REQUIRED = {"pre", "post", "post_shifted", "hybridnorm", "hybridnorm_star", "qk_norm", "span", "peri",
            "olmo2", "deepnorm", "mix_ln", "lns", "b2t", "first_qkv_pre", "embed_norm", "resi_dual"}

# Every name shared/spec/SCHEMES.md's tables (§1 block equations, §2 other placements) give a placement,
# as written there, and the preset it names (DyT is a norm kind, `model.norm=dyt`, not a placement)
SPEC_NAMES = {"Pre-Norm": "pre", "Post-Norm": "post", "HybridNorm": "hybridnorm", "HybridNorm*": "hybridnorm_star",
              "QK-Norm": "qk_norm", "First-QKV-Pre": "first_qkv_pre", "EmbedNorm": "embed_norm",
              "SpanNorm": "span", "Sandwich": "peri", "Peri-LN": "peri", "OLMo-2 reordered": "olmo2",
              "OLMo-2": "olmo2", "DeepNorm": "deepnorm", "Mix-LN": "mix_ln", "LayerNorm Scaling": "lns",
              "B2T": "b2t", "ResiDual": "resi_dual"}


def test_required_presets_registered():
    assert REQUIRED <= set(placements.names())
    assert placements.get("sandwich") == placements.get("peri")


@pytest.mark.parametrize("name", sorted(SPEC_NAMES))
def test_every_name_the_spec_uses_resolves(name):
    assert placements.get(name) == placements.get(SPEC_NAMES[name])


@pytest.mark.parametrize("name", ["QKV-Post", "qkv-post", "QKV_POST", " qkv-Post "])
def test_grammar_is_case_and_separator_insensitive(name):
    assert placements.get(name).block == placements.get("hybridnorm").block


@pytest.mark.parametrize(
    ("name", "attn", "letters", "ffn"),
    [
        ("QKVC-Post", SublayerSpec(), "QKVC", SublayerSpec(in_norm=True, skip="normed")),
        ("KC-Post", SublayerSpec(), "KC", SublayerSpec(in_norm=True, skip="normed")),
        ("Pre-QKV-Pre", SublayerSpec(in_norm=True), "QKV", SublayerSpec(in_norm=True)),
        ("Pre-QK-Pre", SublayerSpec(in_norm=True), "QK", SublayerSpec(in_norm=True)),
        ("QKV-Pre", SublayerSpec(), "QKV", SublayerSpec(in_norm=True)),
        ("Post-Pre", SublayerSpec(in_norm=True, skip="normed"), "", SublayerSpec(in_norm=True)),
        ("Pre-Post", SublayerSpec(in_norm=True), "", SublayerSpec(in_norm=True, skip="normed")),
        ("CKQ-Pre", SublayerSpec(), "QKC", SublayerSpec(in_norm=True)),  # letters canonicalised
    ],
)
def test_grammar_parses_to_spec(name, attn, letters, ffn):
    block = placements.get(name).block
    assert (block.attn, block.qkv_norm, block.ffn) == (attn, letters, ffn)


def test_all_paper_names_parse_and_render():
    for name in placements.PAPER_NAMES:
        assert "Y = " in placements.one_line(placements.get(name))


@pytest.mark.parametrize("bad", ["foo", "QKX-Post", "QQ-Post", "Pre-Pre-Pre", "QKV", "Pre-QKV-Mid", ""])
def test_bad_names_list_valid_choices(bad):
    with pytest.raises(ConfigError) as e:
        placements.get(bad)
    msg = str(e.value)
    assert "hybridnorm" in msg and "QKV-Post" in msg  # names the presets and the grammar


def test_equations_match_paper_notation():
    eq = placements.block_equations
    assert eq(placements.get("pre").block) == "Y = X + MHA(N(X));  X' = Y + FFN(N(Y))"
    assert eq(placements.get("post").block) == "Y = N(X + MHA(X));  X' = N(Y + FFN(Y))"
    assert eq(placements.get("hybridnorm").block) == "Y = X + MHA_QKV(X);  X' = N(Y) + FFN(N(Y))"
    assert eq(placements.get("Post-Pre").block) == "Y = N(X) + MHA(N(X));  X' = Y + FFN(N(Y))"
    assert eq(placements.get("span").block) == "Y = N(X + MHA(X));  X' = N(X + FFN(Y))"
    assert eq(placements.get("b2t").block) == "Y = N(X + MHA(X));  X' = N(X + Y + FFN(Y))"
    star = placements.equations(placements.get("hybridnorm_star"))
    assert star[0] == "block 1: Y = X + MHA_QKV(N(X));  X' = Y + FFN(N(Y))"


def test_per_layer_overrides():
    mix = placements.get("mix_ln")
    blocks = mix.blocks(8)
    assert blocks[:2] == [placements.get("post").block] * 2
    assert blocks[2:] == [placements.get("pre").block] * 6
    star = placements.get("hybridnorm_star").blocks(3)
    assert star[0].attn.in_norm and star[0].qkv_norm == "QKV" and not star[1].attn.in_norm
    assert placements.get("deepnorm").block.alpha(6) == pytest.approx(12 ** 0.25)


def test_spec_round_trips_through_dict():
    for name in placements.names():
        p = placements.get(name)
        assert Placement.from_dict(p.to_dict()) == p


def test_invalid_specs_name_the_field():
    with pytest.raises(ConfigError, match=r"attn\.skip='normed' needs .*in_norm"):
        Placement("x", BlockSpec(attn=SublayerSpec(skip="normed"))).validate()
    with pytest.raises(ConfigError, match=r"qkv_norm_scope='wide' is not one of 'head', 'full'"):
        placements.get("hybridnorm").replace_blocks(qkv_norm_scope="wide")
    with pytest.raises(ConfigError, match=r"qkv_norm='QX'"):
        Placement("x", BlockSpec(qkv_norm="QX")).validate()
    with pytest.raises(ConfigError, match="exactly one of first_n, first_fraction"):
        Placement("x", BlockSpec(), overrides=(Override(BlockSpec()),)).validate()
    with pytest.raises(ConfigError, match="unknown field 'blok'"):
        Placement.from_dict({"name": "x", "blok": {}})


@pytest.mark.parametrize("build, field", [
    (lambda: Placement("x", BlockSpec(attn=SublayerSpec(in_norm="no"))), r"block\.attn\.in_norm='no' must be true or"),
    (lambda: Placement("x", BlockSpec(qkv_norm=None)), r"block\.qkv_norm=None must be a string"),
    (lambda: Placement("x", BlockSpec(ffn=3)), r"block\.ffn=3 must be a section"),
    (lambda: Placement("x", BlockSpec(), final_norm=0), r"\]\.final_norm=0 must be true or false"),
    (lambda: Placement("x", BlockSpec(), overrides=(Override(BlockSpec(), first_n=1.5),)),
     r"overrides\[0\]\.first_n=1\.5 must be an integer"),
])
def test_a_spec_built_in_python_with_a_wrong_type_is_refused_naming_the_field(build, field):
    # a dataclass does not check its annotations: "no" is truthy, so in_norm="no" built a normed model
    with pytest.raises(ConfigError, match=field):
        hn.TransformerLM(hn.ModelConfig.from_preset("tiny", placement=build()))


def test_lossless_forms_in_a_python_built_spec_equal_the_canonical_ones():
    loose = Placement("x", BlockSpec(residual_scale=2), overrides=[Override(BlockSpec(), first_n=1)]).validate()
    exact = Placement("x", BlockSpec(residual_scale=2.0), overrides=(Override(BlockSpec(), first_n=1),))
    assert loose == exact and hash(loose) == hash(exact)
    assert Placement.from_dict(loose.to_dict()) == exact


def test_a_python_built_spec_with_its_attention_letters_in_another_order_or_case_is_the_grammars():
    """The letters are a set (the model asks ``norms(letter)``): 'vkq' built the grammar's QKV-Post model but was
    another spec, unequal, hashed apart and written MHA_VKQ, so a resume with it was refused as another model."""
    ffn = SublayerSpec(in_norm=True, skip="normed")
    mine = Placement("mine", BlockSpec(attn=SublayerSpec(), ffn=ffn, qkv_norm="vkq")).validate()
    assert mine.block == placements.get("QKV-Post").block and hash(mine.block) == hash(placements.get("QKV-Post").block)
    assert placements.one_line(mine).startswith("Y = X + MHA_QKV(X)")
    assert Placement.from_dict({"name": "x", "block": {"qkv_norm": "ck"}}).block.qkv_norm == "KC"
    assert Placement.from_dict(mine.to_dict()) == mine


def test_register_rejects_duplicates():
    with pytest.raises(ConfigError, match="already registered"):
        placements.register(Placement("pre", BlockSpec()))


def test_docs_are_generated_from_registry():
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "placements.md"
    assert doc.read_text(encoding="utf-8") == render(), \
        "docs/placements.md is stale: python -m hybridnorm.placements.docs > docs/placements.md"
    for name in placements.names():
        assert f"### `{name}`" in render()


def test_resi_dual_is_post_norm_blocks_with_a_second_stream():
    p = placements.get("ResiDual")
    assert p.block == placements.get("post").block and p.dual_stream and not p.final_norm
    assert not any(placements.get(n).dual_stream for n in placements.names() if n != "resi_dual")
    assert placements.equations(p)[-2:] == ["D₁ = X₁;  D' = D + MHA(X) + FFN(Y)",
                                            "logits = Head(X'_L + N(D_L))  (no final N)"]
    assert Placement.from_dict(p.to_dict()) == p
    old = {k: v for k, v in placements.get("post").to_dict().items() if k != "dual_stream"}  # a config before it
    assert Placement.from_dict(old).dual_stream is False
    with pytest.raises(ConfigError, match=r"dual_stream"):
        Placement.from_dict({**p.to_dict(), "dual_stream": "yes"})
