"""transformers' continuous batching (``generate_batch``: what ``transformers serve`` and batch-inference
scripts run) on ``HybridNormForCausalLM``, through its own entry point, against the stock class with the
same weights and against ordinary ``generate`` of each prompt alone.

Continuous batching packs the requests into one row, keeps their keys in a paged cache
(``PagedAttentionCache``) and hands the model, beside that cache and a prepared 4-D mask, the indices into
it as forward keyword arguments that transformers' models pass down to ``cache.update`` and the attention
function. Ours failed here before (the paged cache counts no tokens, and the indices never reached it):
every request came back with no tokens, the error only logged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from test_hf_stock_parity import random_gains, tiny  # tests/hf/: the tiny configs and randomized gains
from test_hf_stock_seams import batch, pair
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from hybridnorm import TransformerLM
from hybridnorm.config import MoEConfig
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.hf import HybridNormForCausalLM
from hybridnorm.hf.export import export_model

NEW = 8


def prompts() -> list[list[int]]:
    """Three prompts of 8, 11 and 12 tokens: batch()'s rows without their left padding."""
    ids, mask = batch()
    return [ids[r][mask[r].bool()].tolist() for r in range(ids.shape[0])]


def continuous(model: torch.nn.Module, defaults: bool = False) -> list[list[int]]:
    """The tokens ``generate_batch`` returns for each prompt, greedy, exactly ``NEW`` of them. Its paged cache
    is sized by a small config (8 pages), unless ``defaults``: then by transformers' own rule, a share of the
    free memory (seconds to allocate on a CPU)."""
    gc = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=256)
    small = None if defaults else ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=64)
    out = model.generate_batch(inputs=prompts(), generation_config=gc, continuous_batching_config=small)
    return [out[f"req_{i}"].generated_tokens for i in range(len(out))]


def alone(model: torch.nn.Module) -> list[list[int]]:
    """Ordinary cached ``generate`` of each prompt by itself: the oracle of what each request must get."""
    out = []
    for p in prompts():
        ids = torch.tensor([p])
        out.append(model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                  pad_token_id=256)[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("case", ["llama", "qwen3", "olmo2"])
def test_generate_batch_gives_the_stock_classes_tokens_and_each_prompts_own(tmp_path: Path, case: str,
                                                                            impl: str) -> None:
    """sdpa, and eager (which continuous batching turns into transformers' ``paged|eager``)."""
    ours, theirs = pair(tmp_path, case, impl)
    expected = alone(ours)  # first: transformers 5.5 leaves a model in its paged attention after generate_batch
    got = continuous(ours)
    assert all(len(tokens) == NEW for tokens in got)  # the failure mode: requests back empty
    assert got == continuous(theirs)
    assert got == expected


def test_generate_batch_with_transformers_defaults(tmp_path: Path) -> None:
    """As a user calls it: no continuous-batching config, the paged cache sized by transformers' own rule."""
    ours, theirs = pair(tmp_path, "llama", "sdpa")
    expected = alone(ours)
    assert continuous(ours, defaults=True) == expected == continuous(theirs, defaults=True)


@pytest.mark.parametrize("placement", ["hybridnorm_star", "resi_dual", "post"])
def test_generate_batch_of_placements_no_stock_class_computes_equals_generate(tmp_path: Path,
                                                                              placement: str) -> None:
    """HybridNorm* (Q/K/V norms in the attention whose cache is paged), ResiDual, Post-Norm, and an MoE:
    each request gets the tokens ``generate`` gives its prompt alone."""
    for moe in (None, MoEConfig(num_experts=4, top_k=2)) if placement == "hybridnorm_star" else (None,):
        torch.manual_seed(0)
        lm = TransformerLM(tiny(placement, moe)).eval()
        random_gains(lm)
        folder = tmp_path / f"{placement}-{moe is not None}"
        export_model(lm, folder, ByteTokenizer(), arch="hybridnorm")
        ours = HybridNormForCausalLM.from_pretrained(folder).eval()
        expected = alone(ours)
        got = continuous(ours)
        assert all(len(tokens) == NEW for tokens in got)
        assert got == expected

