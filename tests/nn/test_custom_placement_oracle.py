"""Placements of a user's own (README: "a placement of your own is a spec, not a subclass"), drawn at random
from every slot, skip, scale, attention-norm option, override and model-level norm the spec offers, against
the float64 oracle of the spec's equations (tests/oracle_spec.py): the library's logits, the norm modules it
builds (each used by the equations, none missing), and the HF class after a save/load of its config.json."""

from __future__ import annotations

import random
from pathlib import Path

import oracle
import pytest
import torch
from oracle_spec import spec_logits

import hybridnorm as hn

SKIPS_ATTN = ("input", "normed")
SKIPS_FFN = ("input", "normed", "block", "block+input")


def _sublayer(rng: random.Random, skips: tuple[str, ...]) -> dict:
    in_norm = rng.random() < 0.6
    skip = rng.choice([s for s in skips if in_norm or s != "normed"])
    return {"in_norm": in_norm, "skip": skip, "out_norm": rng.random() < 0.3, "post_norm": rng.random() < 0.3}


def _block(rng: random.Random) -> dict:
    letters = "".join(c for c in "QKVC" if rng.random() < 0.4)
    return {"attn": _sublayer(rng, SKIPS_ATTN), "ffn": _sublayer(rng, SKIPS_FFN), "qkv_norm": letters,
            "qkv_norm_scope": rng.choice(["head", "full"]), "qkv_norm_order": rng.choice(["before_rope", "after_rope"]),
            "residual_scale": rng.choice([1.0, 1.0, 0.5, 1.7, "deepnorm"]), "branch_scale": rng.choice([1.0, 0.6]),
            "depth_scaled_norms": rng.random() < 0.25}


def random_placement(seed: int) -> dict:
    """A valid placement as the plain dict a YAML config holds; the seed names it."""
    rng = random.Random(seed)
    overrides = []
    for _ in range(rng.choice([0, 0, 1, 2])):
        count = {"first_n": rng.choice([0, 1, 2, 5])} if rng.random() < 0.5 else \
            {"first_fraction": rng.choice([0.0, 0.25, 0.5, 1.0])}
        overrides.append({"block": _block(rng), **count})
    return {"name": f"custom{seed}", "block": _block(rng), "overrides": overrides,
            "embed_norm": rng.random() < 0.3, "final_norm": rng.random() < 0.7, "dual_stream": rng.random() < 0.2,
            "init": rng.choice(["normal", "megatron", "depth_scaled", "deepnorm"])}


def _model_config(seed: int, placement: dict) -> hn.ModelConfig:
    rng = random.Random(1000 + seed)
    heads = rng.choice([2, 4])
    return hn.ModelConfig(vocab_size=61, d_model=24, n_layers=rng.choice([1, 2, 3, 4]), n_heads=heads,
                          n_kv_heads=rng.choice([1, heads]), attn_head_dim=rng.choice([None, 8]), ffn_hidden_size=40,
                          max_seq_len=32, placement=placement, norm=rng.choice(["rms", "layer", "dyt"]),
                          tie_embeddings=rng.random() < 0.5)


def _check(model: torch.nn.Module, cfg: hn.ModelConfig, placement: dict, ids: torch.Tensor, got: torch.Tensor) -> None:
    sd = model.state_dict()
    want, used = spec_logits(sd, cfg, placement, ids)
    assert used == set(sd), (f"weights the equations never read: {sorted(set(sd) - used)}; "
                             f"norms: {sorted(oracle.norm_modules(set(sd)))}")
    scale = max(1.0, want.abs().max().item())
    diff = (got.double() - want).abs().max().item()
    assert diff <= 1e-5 * scale, f"{placement}: max |library - oracle| = {diff:.3g} (logits up to {scale:.3g})"


SEEDS = range(48)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_placement_of_your_own_matches_its_equations(seed: int) -> None:
    placement = random_placement(seed)
    cfg = _model_config(seed, placement)
    model = oracle.randomize_(hn.TransformerLM(cfg), seed=seed).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = model(ids)
    _check(model, cfg, placement, ids, got)


@pytest.mark.parametrize("seed", SEEDS[:12])
def test_a_random_placement_through_the_hf_class_and_its_config_json(seed: int, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from hybridnorm.hf import HybridNormConfig, HybridNormForCausalLM

    placement = random_placement(seed)
    cfg = _model_config(seed, placement)
    hf = HybridNormForCausalLM(HybridNormConfig.from_model_config(cfg))
    oracle.randomize_(hf.model, seed=seed)
    hf.save_pretrained(tmp_path)
    back = HybridNormForCausalLM.from_pretrained(tmp_path).double().eval()
    assert back.config.model_config().resolved_placement() == hn.placements.Placement.from_dict(placement)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = back(ids).logits
    _check(back.model, cfg, placement, ids, got)


def test_the_random_placements_cover_every_option() -> None:
    """The draw reaches every slot, skip, scale and model-level norm (so the tests above can fail there)."""
    blocks, models = [], []
    for s in SEEDS:
        p = random_placement(s)
        models.append(p)
        blocks += [p["block"], *(o["block"] for o in p["overrides"])]
    subs = [b[k] for b in blocks for k in ("attn", "ffn")]
    assert {s["skip"] for s in subs} == {"input", "normed", "block", "block+input"}
    for slot in ("in_norm", "out_norm", "post_norm"):
        assert {s[slot] for s in subs} == {True, False}
    assert {c for b in blocks for c in b["qkv_norm"]} == set("QKVC")
    assert {b["qkv_norm_scope"] for b in blocks} == {"head", "full"}
    assert {b["qkv_norm_order"] for b in blocks} == {"before_rope", "after_rope"}
    assert {str(b["residual_scale"]) for b in blocks} == {"1.0", "0.5", "1.7", "deepnorm"}
    assert {b["branch_scale"] for b in blocks} == {1.0, 0.6}
    assert {b["depth_scaled_norms"] for b in blocks} == {True, False}
    for key in ("embed_norm", "final_norm", "dual_stream"):
        assert {p[key] for p in models} == {True, False}
    assert {"first_n" in o for p in models for o in p["overrides"]} == {True, False}
