"""Placements of one's own (tests/nn/test_custom_placement_oracle.py's random specs) on the paths the presets are
checked on elsewhere: an MoE FFN against the float64 oracle of the spec's equations with a token-by-token MoE
(tests/oracle_spec.py), and the fast paths against the plain ones, forward and every parameter's gradient, in
float64: the hand-written kernels (``fast_kernels``), activation checkpointing and regional ``torch.compile``,
each for dense and MoE blocks."""

from __future__ import annotations

import dataclasses

import oracle
import pytest
import torch
from oracle_spec import spec_logits
from test_custom_placement_oracle import _model_config, random_placement

import hybridnorm as hn
from hybridnorm.nn.regional import checkpoint_blocks, compile_blocks

MOE = {"num_experts": 4, "top_k": 2}


def _config(seed: int, moe: bool, **changes) -> hn.ModelConfig:
    d = _model_config(seed, random_placement(seed)).to_dict()
    if moe:  # normalize_topk both ways; an untied head, as the MoE presets have
        d.update(moe={**MOE, "normalize_topk": seed % 2 == 0}, tie_embeddings=False)
    return hn.ModelConfig.from_dict({**d, **changes})


@pytest.mark.parametrize("seed", range(16))
def test_a_random_placement_with_an_moe_ffn_matches_its_equations(seed: int) -> None:
    cfg = _config(seed, moe=True)
    model = oracle.randomize_(hn.TransformerLM(cfg), seed=seed).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = model(ids)
    sd = model.state_dict()
    want, used = spec_logits(sd, cfg, random_placement(seed), ids)
    assert used == set(sd), f"weights the equations never read: {sorted(set(sd) - used)}"
    scale = max(1.0, want.abs().max().item())
    assert (got.double() - want).abs().max().item() <= 1e-5 * scale


def _logits_and_grads(model: hn.TransformerLM, ids: torch.Tensor, cotangent: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits, aux = model(ids, return_aux=True)
    ((logits * cotangent).sum() + (aux["aux_loss"] if aux else 0)).backward()  # a generic vector-Jacobian product
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _check_same(seed: int, moe: bool, fast: str) -> None:
    """The model on the path ``fast`` against the plain one (``fast_kernels=false``, eager, no checkpointing)."""
    cfg = _config(seed, moe)
    plain = hn.TransformerLM(dataclasses.replace(cfg, fast_kernels=False)).double().train()
    oracle.randomize_(plain, seed=seed)
    other = hn.TransformerLM(cfg if fast == "kernels" else dataclasses.replace(cfg, fast_kernels=False)).double()
    other.load_state_dict(plain.state_dict())
    other.train()
    if fast == "checkpointing":
        checkpoint_blocks(other)
    elif fast == "compile":
        compile_blocks(other, backend="aot_eager")  # dynamo's graphs run as traced (inductor: test_regional.py)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    cot = torch.randn(2, 9, cfg.embedding_size, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    want_logits, want_grads = _logits_and_grads(plain, ids, cot)
    got_logits, got_grads = _logits_and_grads(other, ids, cot)
    scale = want_logits.abs().max().item()
    assert (got_logits - want_logits).abs().max().item() <= 1e-9 * scale, f"{fast}: logits"
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert g is not None and got_grads[name] is not None, f"{fast}: {name} got no gradient"
        assert (got_grads[name] - g).abs().max().item() <= 1e-8 * max(g.abs().max().item(), 1e-30), f"{fast}: {name}"


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("seed", range(12))
def test_the_fused_kernels_equal_the_plain_math_on_a_random_placement(seed: int, moe: bool) -> None:
    _check_same(seed, moe, "kernels")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("seed", range(6))
def test_activation_checkpointing_equals_the_plain_step_on_a_random_placement(seed: int, moe: bool) -> None:
    _check_same(seed, moe, "checkpointing")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("seed", range(3))
def test_regional_compile_equals_the_plain_step_on_a_random_placement(seed: int, moe: bool, dynamo) -> None:
    _check_same(seed, moe, "compile")
