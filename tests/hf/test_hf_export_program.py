"""``HybridNormForCausalLM`` through ``torch.export`` the way ExecuTorch users reach it: transformers' own
recipes in ``transformers.integrations.executorch`` (``convert_and_export_with_cache``, the static-cache
module; ``TorchExportableModuleForDecoderOnlyLM.export`` with a dynamic prompt length, which is what
optimum-executorch calls). Every placement and an MoE: the exported program, decoding with its own static
cache, gives the eager forward's logits and ``generate()``'s greedy tokens.

The decode loops here are written out rather than transformers' ``TorchExportableModuleWithStaticCache.
generate`` helper: that helper (5.24.0) feeds each generated token at ``cache_position`` one past its
true position, so its tokens differ from ``generate()``'s for the stock LlamaForCausalLM too (measured
with the same weights as our ``pre``: identical wrong tokens from both classes)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from test_hf_generate import pair, prompts  # tests/hf/: tiny randomized HF model + TransformerLM twins
from transformers import GenerationConfig

import hybridnorm as hn
from hybridnorm.config import MoEConfig

executorch = pytest.importorskip("transformers.integrations.executorch",
                                 reason="no export recipes in this transformers")

NEW, CACHE, TOL = 8, 32, 1e-5
MOE = MoEConfig(num_experts=4, top_k=2)
CASES = [(p, None) for p in hn.placements.names()] + [("hybridnorm_star", MOE)]
IDS = [p if moe is None else f"{p}-moe" for p, moe in CASES]


def exportable(placement: str, moe: MoEConfig | None):
    """A tiny randomized HF model whose generation config asks for the static cache the recipes export."""
    hf, _ = pair(placement, moe=moe)
    hf.generation_config = GenerationConfig(use_cache=True, cache_implementation="static", max_length=CACHE,
                                            cache_config={"batch_size": 1, "max_cache_len": CACHE}, pad_token_id=0)
    return hf


def greedy(step, prompt: torch.Tensor, *, prefill_at_once: bool) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding over an exported program ``step(input_ids, cache_position) -> logits``, each token
    at its own position; returns the tokens and the logits of every position fed."""
    if prefill_at_once:
        seen = [step(input_ids=prompt, cache_position=torch.arange(prompt.shape[1]))]  # (1, T, V)
    else:
        seen = [step(input_ids=prompt[:, i:i + 1], cache_position=torch.tensor([i])) for i in range(prompt.shape[1])]
    tokens = prompt[0].tolist()
    for _ in range(NEW):
        tokens.append(int(seen[-1][0, -1].argmax()))
        seen.append(step(input_ids=torch.tensor([[tokens[-1]]]), cache_position=torch.tensor([len(tokens) - 1])))
    return tokens, torch.cat(seen, dim=1)[:, :-1]  # the last step's logits predict past NEW


def check(hf, step, *, prefill_at_once: bool) -> None:
    prompt = prompts(1)
    with torch.no_grad():
        tokens, logits = greedy(step, prompt, prefill_at_once=prefill_at_once)
        expected = hf.generate(prompt, max_new_tokens=NEW, do_sample=False)[0].tolist()
        eager = hf(torch.tensor([tokens[:-1]])).logits  # (1, T + NEW - 1, V)
    assert tokens == expected
    assert (logits - eager).abs().max().item() <= TOL


@pytest.mark.parametrize("placement,moe", CASES, ids=IDS)
def test_convert_and_export_with_cache_decodes_like_generate(placement: str, moe: MoEConfig | None) -> None:
    """transformers' default recipe (strict dynamo export, one token per call, static cache)."""
    hf = exportable(placement, moe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = executorch.convert_and_export_with_cache(hf)
    check(hf, program.module(), prefill_at_once=False)


@pytest.mark.parametrize("placement,moe", [("hybridnorm_star", None), ("resi_dual", None), ("hybridnorm_star", MOE)],
                         ids=["hybridnorm_star", "resi_dual", "hybridnorm_star-moe"])
def test_decoder_only_export_with_a_dynamic_prompt_length_prefills_at_once(placement: str, moe: MoEConfig | None):
    """optimum-executorch's entry: the prompt prefilled in one call of symbolic length, then decoded."""
    hf = exportable(placement, moe)
    module = executorch.TorchExportableModuleForDecoderOnlyLM(hf, batch_size=1, max_cache_len=CACHE)
    length = torch.export.Dim("length", max=CACHE - 1)
    prompt = prompts(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = module.export(input_ids=prompt, cache_position=torch.arange(prompt.shape[1]),
                                dynamic_shapes={"input_ids": {1: length}, "cache_position": {0: length}}, strict=False)
    check(hf, program.module(), prefill_at_once=True)
