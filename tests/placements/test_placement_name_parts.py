"""A placement name with an empty part between ``-``/``_`` (``Pre-``, ``Pre--Pre``, ``-pre``) is refused naming
the presets and the grammar, by every entry point that takes a name: it used to be read as another, valid name
(``Pre-`` as ``pre``, ``Pre--Pre`` as ``Pre-Pre``), so a typo trained a placement nobody asked for. Every name
that was valid keeps its meaning (tests/nn/test_placement_oracle.py checks each one's equations)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bad_input_helpers import assert_refused

from hybridnorm import ConfigError, placements

BAD = ["Pre-", "Pre--Pre", "-pre", "_pre", "pre__ln", "QKV-Post-", "Pre-_QKV-Post", "hybridnorm_star_"]
GRAMMAR_HEAD = "[<Pre|Post>-][<letters from QKVC>-]<Pre|Post>"
# a run the old code started (reading the bad name as a good one) is small and quick, so it fails fast
SMALL = ["--size", "tiny", "--max-steps", "1", "--batch_size=2", "--seq_len=32", "--eval_batches=1", "--device=cpu",
         "--data.tokenizer=bytes", "--data.source={corpus}", "--data.cache_dir={cache}"]


@pytest.mark.parametrize("bad", BAD)
def test_a_name_with_an_empty_part_is_refused_naming_presets_and_grammar(bad: str) -> None:
    for parse in (placements.get, placements.parse):
        with pytest.raises(ConfigError) as e:
            parse(bad)
        msg = str(e.value)
        assert f"placement {bad!r} has an empty part" in msg
        assert "hybridnorm_star" in msg and GRAMMAR_HEAD in msg


@pytest.mark.parametrize(("name", "same_as"), [
    ("Pre-Pre", "pre"), ("pre_ln", "pre"), (" pre ", "pre"), ("Pre-QKV_post", "Pre-QKV-Post"),
    ("OLMo-2 reordered", "olmo2"), ("LayerNorm Scaling", "lns"), ("hybridnorm*", "hybridnorm_star"),
])
def test_names_that_were_valid_keep_their_meaning(name: str, same_as: str) -> None:
    def model(p: placements.Placement) -> tuple:  # what it computes: not its name, summary or source
        return p.block, p.overrides, p.embed_norm, p.final_norm, p.dual_stream, p.init

    assert model(placements.get(name)) == model(placements.get(same_as))


@pytest.mark.parametrize(("name", "hyphens"), [
    ("Pre QKV Post", "Pre-QKV-Post"), ("pre qkv post", "Pre-QKV-Post"), ("Post Pre", "Post-Pre"),
    ("QKV  Post", "QKV-Post"), (" Pre - QKV - Post ", "Pre-QKV-Post"), ("kc\tpost", "KC-Post"),
    ("Pre QK_pre", "Pre-QK-Pre"),
])
def test_blanks_separate_a_grammar_names_words_as_they_do_a_presets(name: str, hyphens: str) -> None:
    """``pre qk pre`` worked (it is the preset ``qk_norm``'s alias, whose key reads blanks as separators) while
    ``Pre QKV Post`` was refused: the grammar split on ``-``/``_`` only."""
    assert placements.get(name) == placements.get(hyphens)
    assert placements.parse(name) == placements.parse(hyphens)


def test_every_name_and_paper_name_means_the_same_with_blanks_for_its_separators() -> None:
    every = [*placements.names(), *placements.aliases(), *placements.PAPER_NAMES]
    for name in every:
        assert placements.get(name.replace("-", " ").replace("_", " ")) == placements.get(name), name


@pytest.mark.parametrize("bad", ["Pre QKV Mid", "Pre QKV", "QKV", "Pre QKV Post Pre", "Pre QKX Post"])
def test_a_blank_separated_name_that_is_no_grammar_name_is_refused_naming_the_valid_forms(bad: str) -> None:
    with pytest.raises(ConfigError) as e:
        placements.get(bad)
    msg = str(e.value)
    assert f"placement {bad!r} is not a preset" in msg and "hybridnorm_star" in msg and GRAMMAR_HEAD in msg
    assert "separated by '-', '_' or blanks" in msg


@pytest.mark.parametrize("bad", ["Pre-", "Pre--Pre"])
@pytest.mark.parametrize("argv", [
    ["train", "--placement", "{bad}", "--out", "{tmp}/run", *SMALL],
    ["plan", "--placement", "{bad}"],
    ["compare", "--placements", "pre,{bad}", "--out", "{tmp}/cmp", *SMALL],
    ["sweep", "--placements", "{bad}", "--knob", "lr", "--values", "1e-3,2e-3", "--out", "{tmp}/swp", *SMALL],
    ["gradprofile", "--placements", "{bad}", "--sizes", "tiny", "--seeds", "0", "--inits", "megatron",
     "--batch-size", "1", "--seq-len", "16", "--out", "{tmp}/g.json"],
], ids=lambda a: a[0] if isinstance(a, list) else a)
def test_every_command_that_takes_a_name_refuses_it(tmp_path: Path, capsys, corpus: Path, cache_dir: Path,
                                                   argv: list[str], bad: str) -> None:
    argv = [a.format(bad=bad, tmp=tmp_path, corpus=corpus, cache=cache_dir) for a in argv]
    assert_refused(argv, capsys, [f"placement {bad!r} has an empty part", GRAMMAR_HEAD], tmp_path)
    assert not any(tmp_path.iterdir())  # nothing started


def test_an_hf_config_placement_with_an_empty_part_is_refused(tmp_path: Path, capsys) -> None:
    """config.json's ``placement`` beside the ``hybridnorm`` dict: ``hybridnorm_star_`` was taken as the dict's
    ``hybridnorm_star`` and loaded."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from hybridnorm import ModelConfig, TransformerLM
    from hybridnorm.data.tokenizer import ByteTokenizer
    from hybridnorm.hf.export import export_model

    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=257, pad_vocab_multiple=8, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     ffn_hidden_size=48, max_seq_len=64, placement="hybridnorm_star")
    hf = tmp_path / "hf"
    export_model(TransformerLM(mc).eval(), hf, ByteTokenizer(), arch="hybridnorm")
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["placement"] == "hybridnorm_star"
    (hf / "config.json").write_text(json.dumps({**cfg, "placement": "hybridnorm_star_"}))
    for argv in (["import", str(hf), "--out", str(tmp_path / "run")], ["generate", str(hf), "--max-new-tokens", "1"]):
        assert_refused(argv, capsys, ["config.json", "placement 'hybridnorm_star_' has an empty part"], tmp_path)
