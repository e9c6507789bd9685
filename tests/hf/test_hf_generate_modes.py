"""``generate()`` modes beyond greedy and plain sampling, driven through transformers' own arguments, against
a stock ``LlamaForCausalLM`` with the same weights (the ``pre`` placement exported both ways): beam search
with every ``early_stopping`` setting and ``num_return_sequences`` (beams that end at an eos, a left-padded
batch whose cache is reordered every step), beam sampling, the ``return_dict_in_generate`` record (scores,
logits, hidden states, attention weights, beam indices, ``compute_transition_scores``), assisted decoding
with a smaller model of ours drafting for a bigger one (greedy and speculative sampling) and prompt lookup,
a static cache that ``generate`` compiles itself (``compile_config``), and caches the user builds
(``StaticCache``, a prompt's cache reused). Placements no stock class computes: beam search, assisted
decoding and the static cache against our own ``TransformerLM.generate`` and the uncached forward.
(test_hf_generate.py covers these modes on our class alone; test_hf_stock_seams.py greedy, sampling, one
beam width, the static cache and penalties against the stock classes.)"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
import transformers
from test_hf_generate import pair as own_pair  # tests/hf/: our class and a TransformerLM with the same weights
from test_hf_generate import prompts
from test_hf_stock_parity import random_gains, tiny  # tests/hf/: the tiny configs and randomized gains

from hybridnorm import TransformerLM
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.hf import HybridNormForCausalLM
from hybridnorm.hf.compat import CACHE_FIELD
from hybridnorm.hf.export import export_model

TOL = 1e-5
PAD = 256
EOS = list(range(0, 256, 9))  # many eos ids: beams that end


def twins(tmp: Path, n_layers: int = 2, seed: int = 0,
          impl: str = "sdpa") -> tuple[HybridNormForCausalLM, transformers.LlamaForCausalLM]:
    """Ours and Llama with the same weights, both loaded through ``from_pretrained``; ours with sdpa and then
    switched by ``set_attn_implementation`` (Llama loaded with ``impl``), so both ways of choosing it run."""
    torch.manual_seed(seed)
    lm = TransformerLM(dataclasses.replace(tiny("pre"), n_layers=n_layers)).eval()
    random_gains(lm)
    export_model(lm, tmp / f"llama{n_layers}", ByteTokenizer(), arch="llama")
    export_model(lm, tmp / f"ours{n_layers}", ByteTokenizer(), arch="hybridnorm")
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp / f"ours{n_layers}").eval()
    ours.set_attn_implementation(impl)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp / f"llama{n_layers}", attn_implementation=impl)
    assert isinstance(ours, HybridNormForCausalLM) and isinstance(theirs, transformers.LlamaForCausalLM)
    return ours, theirs.eval()


def left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 8 tokens, the first left-padded by 3."""
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


def tensors(x) -> list[torch.Tensor]:
    """Every tensor of a (nested) tuple of per-step / per-layer outputs, in order."""
    return [x] if isinstance(x, torch.Tensor) else [t for part in x for t in tensors(part)]


def assert_same_record(a, b, fields: tuple[str, ...]) -> None:
    """Two ``generate`` results: the same tokens, and each recorded field the same within TOL (-inf where
    the other has -inf: a token the processors ruled out)."""
    assert torch.equal(a.sequences, b.sequences)
    for field in fields:
        xs, ys = tensors(getattr(a, field)), tensors(getattr(b, field))
        assert len(xs) == len(ys) > 0, field
        for x, y in zip(xs, ys, strict=True):
            assert x.shape == y.shape, field
            torch.testing.assert_close(x, y, rtol=0, atol=TOL, msg=field)


def both(ours, theirs, *args, seed: int = 7, **kw) -> list:
    outs = []
    for model in (ours, theirs):
        torch.manual_seed(seed)
        outs.append(model.generate(*args, pad_token_id=PAD, **kw))
    return outs


@torch.no_grad()
def test_beam_search_equals_the_stock_class_for_every_early_stopping(tmp_path: Path) -> None:
    """The eos ids are the tokens greedy decoding picks, so beams end early and ``early_stopping`` decides
    (True returns other beams than False here); the returned beams, their scores, each step's scores and
    logits, the beam indices and ``compute_transition_scores`` equal Llama's."""
    ours, theirs = twins(tmp_path)
    ids, mask = left_padded()
    greedy = ours.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD,
                           eos_token_id=None)
    eos = sorted(set(greedy[:, -1].tolist()))
    record = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
    got = {}
    for early_stopping in (False, True, "never"):
        kw = dict(attention_mask=mask, num_beams=4, early_stopping=early_stopping, max_new_tokens=10,
                  do_sample=False, eos_token_id=eos)
        a, b = both(ours, theirs, ids, num_return_sequences=3, **kw, **record)
        assert a.sequences.shape[0] == 6
        assert_same_record(a, b, ("sequences_scores", "scores", "logits", "beam_indices"))
        steps = [m.compute_transition_scores(r.sequences, r.scores, r.beam_indices)
                 for m, r in ((ours, a), (theirs, b))]
        torch.testing.assert_close(*steps, rtol=0, atol=TOL)
        got[early_stopping] = a.sequences
        a, b = both(ours, theirs, ids, length_penalty=0.5, **kw)  # favours the shorter beams
        assert torch.equal(a, b), early_stopping
    assert any(t in eos for t in got[False][:, 8:].flatten().tolist())  # some returned beam ended at an eos
    assert not torch.equal(got[True], got[False])  # and early_stopping changed which beams come back


@torch.no_grad()
def test_beam_sampling_and_the_generate_record_equal_the_stock_class(tmp_path: Path) -> None:
    """Eager attention (ours switched to it after loading, Llama loaded with it): every hidden state and
    attention weight ``generate`` records, for beam sampling, greedy and sampled decoding."""
    ours, theirs = twins(tmp_path, impl="eager")
    assert ours.config._attn_implementation == "eager"
    ids, mask = left_padded()
    record = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, output_hidden_states=True,
                  output_attentions=True)
    modes = {"beam_sample": dict(num_beams=3, do_sample=True, num_return_sequences=2, eos_token_id=EOS),
             "greedy": dict(do_sample=False), "sample": dict(do_sample=True, top_k=20)}
    for mode, kw in modes.items():
        a, b = both(ours, theirs, ids, attention_mask=mask, max_new_tokens=5, **kw, **record)
        fields = ("scores", "logits", "hidden_states", "attentions") + (("beam_indices",) if "num_beams" in kw else ())
        assert_same_record(a, b, fields)
        L = ours.config.num_hidden_layers
        assert len(a.hidden_states[0]) == L + 1 and len(a.attentions[0]) == L, mode


@torch.no_grad()
def test_a_smaller_model_of_ours_drafts_for_a_bigger_one_as_for_the_stock_class(tmp_path: Path) -> None:
    """Assisted decoding (the draft's proposals verified by the big model, its cache cropped where they are
    rejected) and prompt lookup: greedy, the big model's own greedy tokens; sampled (speculative sampling)
    and with the recorded states, what the stock pair gives from the same seed. One prompt: assisted
    decoding takes batches of one."""
    big, big_llama = twins(tmp_path / "big", n_layers=3)
    small, small_llama = twins(tmp_path / "small", n_layers=1, seed=5)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    ids[0, 6:] = ids[0, :6]  # repeats, so prompt lookup has candidates to propose
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, eos_token_id=0)
    greedy = big.generate(ids, do_sample=False, pad_token_id=PAD, **kw)
    assert torch.equal(greedy, big_llama.generate(ids, do_sample=False, pad_token_id=PAD, **kw))
    helpers = {"assistant": ({"assistant_model": small}, {"assistant_model": small_llama}),
               "lookup": ({"prompt_lookup_num_tokens": 3}, {"prompt_lookup_num_tokens": 3})}
    for name, (ours_kw, stock_kw) in helpers.items():
        assert torch.equal(big.generate(ids, do_sample=False, pad_token_id=PAD, **kw, **ours_kw), greedy), name
        outs = []
        for model, extra in ((big, ours_kw), (big_llama, stock_kw)):
            torch.manual_seed(11)
            outs.append(model.generate(ids, do_sample=True, top_k=30, pad_token_id=PAD, **kw, **extra))
        assert torch.equal(*outs), name
        outs = [model.generate(ids, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True,
                               output_scores=True, output_logits=True, output_hidden_states=True, **kw, **extra)
                for model, extra in ((big, ours_kw), (big_llama, stock_kw))]
        assert_same_record(*outs, ("logits", "hidden_states"))
    # a draft of one kind for a model of the other: only the tokens are shared
    assert torch.equal(big.generate(ids, do_sample=False, assistant_model=small_llama, pad_token_id=PAD, **kw), greedy)


@torch.no_grad()
def test_the_static_cache_generate_compiles_itself_and_user_built_caches(tmp_path: Path) -> None:
    """``compile_config`` (on the CPU only with ``_compile_all_devices``; the ``eager`` backend keeps it
    quick): ``generate`` compiles the forward, ``fullgraph=True``, and gives the uncompiled tokens, as for
    Llama. A ``StaticCache`` made by the user, and a prompt prefix's cache reused by a deep copy (transformers'
    "re-use a cache" recipe), give the tokens of a fresh ``generate``."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig, DynamicCache, StaticCache

    ours, theirs = twins(tmp_path)
    ids, mask = left_padded()
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    want, stock_want = both(ours, theirs, ids, **kw)
    assert torch.equal(want, stock_want)
    for model in (ours, theirs):
        torch._dynamo.reset()
        counters.clear()
        config = CompileConfig(backend="eager", fullgraph=True, mode=None)
        config._compile_all_devices = True  # not an __init__ argument in 5.24: the CPU is no compile device
        got = model.generate(ids, cache_implementation="static", compile_config=config, pad_token_id=PAD, **kw)
        assert torch.equal(got, want), type(model).__name__
        assert counters["stats"]["unique_graphs"] >= 1, type(model).__name__  # the forward really ran compiled
    one = ids[1:]
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=PAD)
    for model in (ours, theirs):
        fresh = model.generate(one, **kw)
        static = StaticCache(config=model.config, max_cache_len=32)
        assert torch.equal(model.generate(one, **{CACHE_FIELD: static}, **kw), fresh)
        prefix = getattr(model(one[:, :5], **{CACHE_FIELD: DynamicCache(config=model.config)}), CACHE_FIELD)
        for _ in range(2):  # each use extends its own copy
            assert torch.equal(model.generate(one, **{CACHE_FIELD: copy.deepcopy(prefix)}, **kw), fresh)
        assert prefix.get_seq_length() == 5
    assert torch.equal(ours.generate(one, **kw), theirs.generate(one, **kw))


@pytest.mark.parametrize("placement", ["hybridnorm_star", "resi_dual", "post"])
@torch.no_grad()
def test_beam_assisted_and_static_modes_of_placements_without_a_stock_class(placement: str) -> None:
    """Beam search cached == uncached (the cache reordered every step == no cache), a left-padded beam batch
    == each prompt's beams alone; assisted decoding with a one-layer draft of the same placement, prompt
    lookup and the static cache == our own ``TransformerLM.generate``."""
    hf, ours = own_pair(placement)
    draft, _ = own_pair(placement, seed=5, n_layers=1)
    x = prompts(1, 10)
    x[0, 5:] = x[0, :5]
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=0)
    greedy = ours.generate(x, 8, temperature=0)
    for extra in (dict(assistant_model=draft), dict(prompt_lookup_num_tokens=2), dict(cache_implementation="static")):
        assert torch.equal(hf.generate(x, **kw, **extra), greedy), extra
    beams = dict(num_beams=3, num_return_sequences=2, **kw)
    assert torch.equal(hf.generate(x, **beams), hf.generate(x, use_cache=False, **beams))
    a, b = prompts(1, 4, seed=2), prompts(1, 9, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), a], 1), b])
    mask = (torch.arange(9) >= torch.tensor([[5], [0]])).long()
    out = hf.generate(batch, attention_mask=mask, **beams)  # (4, 17): rows 0-1 the first prompt's
    for i, alone in enumerate((a, b)):
        assert torch.equal(out[2 * i:2 * i + 2, -8:], hf.generate(alone, **beams)[:, -8:]), i
