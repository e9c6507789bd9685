"""A ``config.json`` (or a config dict, keywords) whose standard fields and ``hybridnorm`` dict state one setting
differently is one ConfigError naming both fields, both values and the file; it used to load with the standard
field silently winning (a model other than the dict's). What transformers does after construction still works:
``from_pretrained(..., num_hidden_layers=...)``, assignment, ``resize_token_embeddings`` and
``set_output_embeddings`` change the standard fields, which stay the truth and are saved with the dict alike."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
import transformers
from train_helpers import cli_in_process

from hybridnorm import ConfigError, ModelConfig, MoEConfig, TransformerLM
from hybridnorm.config import RopeScaling
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.hf import HybridNormConfig, HybridNormForCausalLM
from hybridnorm.hf.export import export_model

IDS = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))


def mc_of(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=257, pad_vocab_multiple=8, d_model=32, n_layers=2, n_heads=4,
                                 n_kv_heads=2, ffn_hidden_size=48, max_seq_len=64, rope_theta=10_000.0,
                                 placement="hybridnorm_star"), **kw})


def saved(mc: ModelConfig) -> dict:
    """The config dict as ``save_pretrained`` writes it (JSON round trip): both statements alike."""
    return as_saved(HybridNormConfig.from_model_config(mc))


def as_saved(cfg: HybridNormConfig) -> dict:
    return json.loads(cfg.to_json_string(use_diff=False))


def edited(d: dict, top: dict | None = None, nested: dict | None = None) -> dict:
    return {**d, **(top or {}), "hybridnorm": {**d["hybridnorm"], **(nested or {})}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model of our own class exported with the byte tokenizer; read only (tests edit copies)."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("contradiction") / "hf"
    export_model(TransformerLM(mc_of()).eval(), out, ByteTokenizer(), arch="hybridnorm")
    return out


def copy_with(src: Path, dst: Path, change) -> Path:
    """``src`` copied to ``dst`` with its config.json passed through ``change``."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    d = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(change(d)))
    return dst


# (the standard field and its value, the dict's field and its value), each from a saved config of mc_of()
CASES = [
    ({"hidden_size": 64}, {}, "hidden_size=64 and hybridnorm.d_model=32"),
    ({}, {"d_model": 64}, "hidden_size=32 and hybridnorm.d_model=64"),
    ({"num_hidden_layers": 3}, {}, "num_hidden_layers=3 and hybridnorm.n_layers=2"),
    ({"num_attention_heads": 8}, {}, "num_attention_heads=8 and hybridnorm.n_heads=4"),
    ({}, {"n_kv_heads": 4}, "num_key_value_heads=2 and hybridnorm.n_kv_heads=4"),
    ({"num_key_value_heads": 2}, {"n_kv_heads": None}, "num_key_value_heads=2 and hybridnorm.n_kv_heads=None "
                                                       "(= n_heads, 4)"),
    ({"head_dim": 16}, {"attn_head_dim": None}, "head_dim=16 and hybridnorm.attn_head_dim=None (= d_model / "
                                                "n_heads, 8)"),
    ({"intermediate_size": 64}, {}, "intermediate_size=64 and hybridnorm.ffn_hidden_size=48"),
    ({"max_position_embeddings": 128}, {}, "max_position_embeddings=128 and hybridnorm.max_seq_len=64"),
    ({"rms_norm_eps": 1e-6}, {}, "rms_norm_eps=1e-06 and hybridnorm.norm_eps=1e-05"),
    ({"rope_theta": 500000.0, "rope_parameters": None}, {}, "rope_theta=500000.0 and hybridnorm.rope_theta=10000.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, {},
     "rope_parameters['rope_theta']=500000.0 and hybridnorm.rope_theta=10000.0"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, {},
     "rope_parameters['rope_type']='linear' and hybridnorm.rope_scaling=None (plain RoPE)"),
    ({"initializer_range": 0.02}, {}, "initializer_range=0.02 and hybridnorm.init_std=None"),
    # HF's vocab_size counts embedding rows: 257 padded to a multiple of 8 is 264
    ({"vocab_size": 257}, {}, "vocab_size=257 and hybridnorm.vocab_size=257 (rounded up to "
                              "hybridnorm.pad_vocab_multiple=8: 264 embedding rows)"),
    ({}, {"tie_embeddings": False}, "tie_word_embeddings=True and hybridnorm.tie_embeddings=False"),
    ({"num_experts": 4, "num_experts_per_tok": 2}, {}, "num_experts=4 and hybridnorm.moe=None (a dense FFN)"),
]


@pytest.mark.parametrize(("top", "nested", "said"), CASES, ids=[c[2].split("=")[0] + f"-{i}" for i, c in
                                                               enumerate(CASES)])
def test_a_config_dict_whose_two_statements_disagree_is_one_error_naming_both(top: dict, nested: dict,
                                                                              said: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(said) + " disagree: the standard field and the hybridnorm "
                                                            "dict state one setting"):
        HybridNormConfig.from_dict(edited(saved(mc_of()), top, nested))


def test_an_moe_and_a_scaled_rope_disagreeing_inside_are_named_by_their_keys() -> None:
    d = saved(mc_of(moe=MoEConfig(num_experts=4, top_k=2), rope_scaling=RopeScaling(type="linear", factor=2.0)))
    HybridNormConfig.from_dict(d)  # as saved: fine
    for top, said in [({"num_experts": 8}, "num_experts=8 and hybridnorm.moe.num_experts=4"),
                      ({"num_experts_per_tok": 1}, "num_experts_per_tok=1 and hybridnorm.moe.top_k=2"),
                      ({"moe_intermediate_size": 40}, "moe_intermediate_size=40 and hybridnorm.moe.expert_hidden_size="
                                                      "None (= ffn_hidden_size, 48)"),
                      ({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
                       "rope_parameters['factor']=4.0 and hybridnorm.rope_scaling.factor=2.0")]:
        with pytest.raises(ConfigError, match=re.escape(said)):
            HybridNormConfig.from_dict(edited(d, top))


def test_keywords_that_contradict_the_dict_given_at_construction_are_refused_too() -> None:
    mc = mc_of()
    with pytest.raises(ConfigError, match=r"num_hidden_layers=5 and hybridnorm\.n_layers=2 disagree"):
        HybridNormConfig.from_model_config(mc, num_hidden_layers=5)
    with pytest.raises(ConfigError, match=r"hidden_size=64 and hybridnorm\.d_model=32 disagree"):
        HybridNormConfig(hybridnorm=mc.to_dict(), hidden_size=64)
    # a value of the wrong kind in the dict is named as the dict's field, not taken for a disagreement
    with pytest.raises(ConfigError, match=r"^hybridnorm\.d_model='32' must be an integer$"):
        HybridNormConfig.from_dict(edited(saved(mc), nested={"d_model": "32"}))


def test_values_alike_in_a_lossless_form_or_stated_once_load_unchanged() -> None:
    d = saved(mc_of())
    assert as_saved(HybridNormConfig.from_dict(json.loads(json.dumps(d)))) == d  # the normal export
    same = edited(d, {"hidden_size": 32.0, "num_hidden_layers": 2.0, "rms_norm_eps": 1e-5, "vocab_size": 264.0},
                  {"n_layers": 2.0, "norm_eps": "1e-5", "n_kv_heads": 2.0})
    assert as_saved(HybridNormConfig.from_dict(same)) == d
    # None in the dict is what ModelConfig derives it as: n_kv_heads None is one kv head per head
    assert HybridNormConfig.from_dict(edited(d, {"num_key_value_heads": 4}, {"n_kv_heads": None})).model_config() \
        .kv_heads == 4
    # a partial dict (what it leaves out, the standard fields give) is no contradiction
    part = HybridNormConfig(hybridnorm={"placement": "pre", "d_model": 32}, hidden_size=32, num_hidden_layers=1,
                            num_attention_heads=4)
    assert (part.model_config().d_model, part.model_config().n_layers) == (32, 1)
    # exports before 2026-11 wrote tie_word_embeddings false above a tied dict: still read as the dict says
    assert HybridNormConfig.from_dict(edited(d, {"tie_word_embeddings": False})).tie_word_embeddings is True


def test_the_commands_name_config_json_and_both_fields(folder: Path, tmp_path: Path) -> None:
    bad = copy_with(folder, tmp_path / "bad", lambda d: edited(d, {"hidden_size": 64}))
    want = (f"error: {bad / 'config.json'}: hidden_size=64 and hybridnorm.d_model=32 disagree: the standard field "
            "and the hybridnorm dict state one setting of the model differently")
    for args in (["generate", str(bad), "--prompt", "In", "--max-new-tokens", "2"],
                 ["import", str(bad), "--out", str(tmp_path / "run")]):
        r = cli_in_process(*args, ok=False)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(want), r.stderr
    with pytest.raises(ConfigError, match=r"hidden_size=64 and hybridnorm\.d_model=32 disagree"):
        transformers.AutoModelForCausalLM.from_pretrained(bad)


def test_what_transformers_sets_after_construction_stays_the_truth(folder: Path, tmp_path: Path) -> None:
    cli_in_process("generate", str(folder), "--prompt", "In", "--max-new-tokens", "2")  # the export itself loads
    one = transformers.AutoModelForCausalLM.from_pretrained(folder, num_hidden_layers=1)  # keyword: setattr
    assert len(one.model.blocks) == 1 and one.config.to_dict()["hybridnorm"]["n_layers"] == 1
    cfg = HybridNormConfig.from_pretrained(folder)
    cfg.rms_norm_eps = 1e-6  # assignment, before the model is built from it
    model = HybridNormForCausalLM.from_pretrained(folder, config=cfg).eval()
    model.resize_token_embeddings(300)  # sets vocab_size
    head = torch.nn.Linear(32, 300, bias=False)
    model.set_output_embeddings(head)  # unties: sets tie_word_embeddings false
    before = model(IDS).logits
    model.save_pretrained(tmp_path / "changed")
    d = json.loads((tmp_path / "changed" / "config.json").read_text())
    assert (d["vocab_size"], d["hybridnorm"]["vocab_size"], d["hybridnorm"]["pad_vocab_multiple"]) == (300, 300, 1)
    assert (d["tie_word_embeddings"], d["hybridnorm"]["tie_embeddings"]) == (False, False)
    assert (d["rms_norm_eps"], d["hybridnorm"]["norm_eps"]) == (1e-6, 1e-6)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "changed").eval()
    torch.testing.assert_close(back(IDS).logits, before, rtol=0, atol=0)
