"""PEFT's prompt-learning adapters (prefix tuning, prompt tuning, P-tuning) on ``HybridNormForCausalLM``
through PEFT's and transformers' own entry points (``get_peft_model``, ``Trainer``, ``generate``), against
the stock class with the same weights and the same adapter, and a KV cache handed to a forward with
``use_cache=False``, which transformers' models attend to and extend (and which ours returns only when
``use_cache`` asks, as transformers documents).

Prefix tuning hands its learned keys and values to the model as a KV cache. The model's config often says
``use_cache=False`` (``Trainer`` writes ``TrainingArguments.use_cache`` into it, False by default), and our
class dropped a passed cache then: the adapter's keys were never attended to (a crash with a padding mask,
no gradient without one). The stock class is the oracle: transformers' own code for the cache and masks.

Known and kept out: with a left-padded batch and no ``position_ids`` (PEFT removes them for prompt tuning),
ours counts positions over real tokens and the stock classes from 0 (docs/huggingface.md), so the
comparisons with the stock class use right-padded or unpadded rows, and ours is checked on left-padded
rows against its own full forwards and against each row alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="peft is in the dev extra")
pytest.importorskip("accelerate", reason="Trainer needs accelerate (in the dev extra)")
from peft import PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig, get_peft_model
from test_hf_stock_seams import batch, pair
from test_hf_trainer import one_trainer_step
from transformers import DynamicCache

from hybridnorm.hf.compat import CACHE_FIELD

TOL = 1e-5
METHODS = {
    "prefix": lambda: PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "prompt": lambda: PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "p_tuning": lambda: PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=16),
}


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def adapted_pair(tmp: Path, method: str, use_cache: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Ours and stock Llama with the same weights, each wrapped by PEFT with the same adapter weights
    (random, so that the adapter acts), with the config's ``use_cache`` as given."""
    ours, theirs = pair(tmp, "llama")
    for model in (ours, theirs):
        model.config.use_cache = use_cache
    ours, theirs = get_peft_model(ours, METHODS[method]()), get_peft_model(theirs, METHODS[method]())
    g = torch.Generator().manual_seed(5)
    mine, stock = trainable(ours), trainable(theirs)
    assert mine and list(mine) == list(stock)
    with torch.no_grad():
        for name, p in mine.items():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            stock[name].copy_(p)
    return ours, theirs


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("method", list(METHODS))
def test_trainer_step_of_the_adapter_equals_the_stock_classes(tmp_path: Path, method: str, use_cache: bool) -> None:
    """One Trainer step (ragged, right-padded rows, two accumulated micro-batches): the same logged loss and
    the same change to every adapter weight as the stock class's, the base weights untouched. Trainer sets
    the config's ``use_cache`` from ``TrainingArguments.use_cache``, False by default: there ours dropped the
    prefix's keys and crashed, with Trainer's defaults."""
    ours, theirs = adapted_pair(tmp_path, method, True)
    loss, step = one_trainer_step(tmp_path / "ours", ours, batch=4, accum=2, use_cache=use_cache)
    stock_loss, stock_step = one_trainer_step(tmp_path / "stock", theirs, batch=4, accum=2, use_cache=use_cache)
    assert ours.config.use_cache is use_cache  # what Trainer set
    assert abs(loss - stock_loss) <= TOL
    adapter = trainable(ours)
    for name, change in step.items():
        if name in adapter:
            assert change.abs().max() > 1e-4, name  # the adapter gets a gradient: it is in the function
            assert (change - stock_step[name]).abs().max() <= TOL, name
        else:
            assert change.abs().max() == 0, name  # PEFT froze the base model


@pytest.mark.parametrize("use_cache", [False, True])
def test_prefix_tuned_forward_attends_to_the_prefix_as_the_stock_class_does(tmp_path: Path, use_cache: bool) -> None:
    """Logits of unpadded rows, with and without a 2-D mask, equal the stock class's and differ from the bare
    base model's (the control that the prefix is in them)."""
    ours, theirs = adapted_pair(tmp_path, "prefix", use_cache)
    ids, _ = batch()
    with torch.no_grad():
        bare = ours.get_base_model()(ids).logits
        for kw in ({}, {"attention_mask": torch.ones_like(ids)}):
            mine = ours(input_ids=ids, **kw).logits
            assert (mine - theirs(input_ids=ids, **kw).logits).abs().max() <= TOL
            assert (mine - bare).abs().max() > 1e-2


def greedy_forwards(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """The oracle of greedy generation: ``n`` full forwards of the whole sequence, each appending its argmax."""
    for _ in range(n):
        with torch.no_grad():
            nxt = model(input_ids=ids, attention_mask=mask).logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    return ids


@pytest.mark.parametrize("method", list(METHODS))
def test_adapted_generate_is_its_own_greedy_forwards_each_row_alone_and_the_stock_classes(tmp_path: Path,
                                                                                         method: str) -> None:
    """Uncached, a left-padded batch generates what greedy full forwards of the adapted model give, and each
    row what it generates alone (ours counts positions over real tokens; the virtual tokens go before the
    padding). Before the fix a prefix-tuned model crashed here, and after it, while a passed cache was still
    returned under ``use_cache=False``, generate handed it back with the whole sequence from the second step
    on (the stock classes do: wrong tokens on transformers 5.24, a crash on 5.5). Cached, ours gives the
    stock class's tokens: the model's own only where the cache keeps its old name (transformers < 5.23);
    after the rename PEFT 0.21 finds no cache, inserts the virtual tokens again at every step, and hands a
    prefix in beside transformers' own cache, where it is ignored (said, as the stock class says it)."""
    ours, theirs = adapted_pair(tmp_path, method, True)
    ids, mask = batch()
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=256)
    uncached = ours.generate(input_ids=ids, attention_mask=mask, use_cache=False, **kw)
    assert torch.equal(uncached, greedy_forwards(ours, ids, mask, 8))
    for row in range(ids.shape[0]):
        real = mask[row].bool()
        alone = ours.generate(input_ids=ids[row:row + 1, real], use_cache=False, **kw)
        assert torch.equal(alone[0], uncached[row, torch.cat([real, torch.ones(8, dtype=torch.bool)])])
    unpadded = ids[2:]  # batch()'s last row has no padding: both count positions alike
    if method == "prefix" and CACHE_FIELD == "cache":
        with pytest.warns(FutureWarning, match="ignoring `past_key_values`"):
            cached = ours.generate(input_ids=unpadded, **kw)
    else:
        cached = ours.generate(input_ids=unpadded, **kw)
    assert torch.equal(cached, theirs.generate(input_ids=unpadded, **kw))
    if CACHE_FIELD == "past_key_values":
        assert torch.equal(ours.generate(input_ids=ids, attention_mask=mask, **kw), uncached)


@pytest.mark.parametrize("use_cache", [False, True])
def test_a_cache_passed_in_is_attended_to_and_extended_whatever_use_cache_says(tmp_path: Path,
                                                                                use_cache: bool) -> None:
    """Without PEFT: the first 7 tokens' cache, handed to a forward of the last 5: logits equal the full
    forward's last 5 and the stock class's given its own cache, and both caches grow to 12."""
    ours, theirs = pair(tmp_path, "llama")
    ids, _ = batch()
    with torch.no_grad():
        full = ours(ids).logits
        out = {}
        for name, model in (("ours", ours), ("stock", theirs)):
            cache = DynamicCache(config=model.config)
            model(ids[:, :7], **{CACHE_FIELD: cache}, use_cache=True)  # the name this transformers uses
            out[name] = model(ids[:, 7:], **{CACHE_FIELD: cache}, use_cache=use_cache).logits
            assert cache.get_seq_length() == 12, name
    assert (out["ours"] - full[:, 7:]).abs().max() <= TOL
    assert (out["ours"] - out["stock"]).abs().max() <= TOL


def test_a_filled_cache_while_checkpointed_training_is_one_error_and_kept_without_gradients(tmp_path: Path) -> None:
    """Gradient checkpointing recomputes each block in backward, which would write its keys into a passed
    cache twice: training so with a cache that holds keys is refused by name (the stock classes compute
    without it, silently). Without gradients (generating from a model in training mode) nothing is
    recomputed, and the cache is used."""
    ours, _ = pair(tmp_path, "llama")
    ids, _ = batch()
    with torch.no_grad():
        full = ours(ids).logits
    ours.gradient_checkpointing_enable()
    ours.train()
    cache = DynamicCache(config=ours.config)
    with torch.no_grad():
        ours(ids[:, :7], cache=cache)
    with pytest.raises(ValueError, match="gradient checkpointing"):
        ours(ids[:, 7:], cache=cache)
    with torch.no_grad():
        assert (ours(ids[:, 7:], cache=cache).logits - full[:, 7:]).abs().max() <= TOL
    assert ours(ids).loss is None and ours(ids, labels=ids).loss.requires_grad  # an empty start: trains as before
