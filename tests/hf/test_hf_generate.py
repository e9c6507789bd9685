"""``HybridNormForCausalLM.generate()``, transformers' own decoding loop, against our own KV-cached
``TransformerLM.generate`` and against itself without a cache: every placement, every decoding mode the
issue lists (greedy, sampling, beam search, beam sampling, prompt-lookup and assisted decoding), dynamic
and static caches (the static one also compiled with ``fullgraph=True``), left padding, 4-D masks,
continuing from a returned cache, ``inputs_embeds`` prompts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

import hybridnorm as hn
import hybridnorm.hf
from hybridnorm import ModelConfig, TransformerLM
from hybridnorm.hf import HybridNormConfig, HybridNormForCausalLM
from hybridnorm.hf.compat import CACHE_FIELD

V, NEW = 97, 10


def pair(placement: str = "hybridnorm_star", seed: int = 0, **kw) -> tuple[HybridNormForCausalLM, TransformerLM]:
    """An HF model and a TransformerLM with the same (randomized, norm gains included) weights."""
    import oracle

    mc = ModelConfig(**{**dict(vocab_size=V, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden_size=48,
                                max_seq_len=64, placement=placement), **kw})
    torch.manual_seed(seed)
    hf = HybridNormForCausalLM(HybridNormConfig.from_model_config(mc, pad_token_id=0, eos_token_id=None)).eval()
    oracle.randomize_(hf.model, seed=seed)
    ours = TransformerLM(hf.config.model_config()).eval()
    ours.load_state_dict(hf.model.state_dict())
    return hf, ours


def prompts(batch: int = 2, length: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("placement", hn.placements.names())
@torch.no_grad()
def test_greedy_cached_equals_uncached_equals_ours_for_every_placement(placement: str) -> None:
    hf, ours = pair(placement)
    x = prompts()
    cached = hf.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    uncached = hf.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, ours.generate(x, NEW, temperature=0))


@pytest.mark.parametrize("placement", ["hybridnorm_star", "post", "olmo2"])
@torch.no_grad()
def test_left_padded_batch_generates_what_each_prompt_does_alone(placement: str) -> None:
    hf, ours = pair(placement)
    a, b = prompts(1, 3, seed=2), prompts(1, 8, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), a], 1), b])  # row 0 left-padded
    mask = (torch.arange(8) >= torch.tensor([[5], [0]])).long()
    out = hf.generate(batch, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    for row, alone in zip(out, (a, b), strict=True):
        assert row[-NEW:].tolist() == ours.generate(alone, NEW, temperature=0)[0, -NEW:].tolist()
    static = hf.generate(batch, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         cache_implementation="static")
    assert torch.equal(static, out)


@torch.no_grad()
def test_sampling_and_beam_modes_agree_with_and_without_cache() -> None:
    hf, _ = pair()
    x = prompts()
    modes = [dict(do_sample=True, top_k=20, temperature=0.9), dict(num_beams=3),
             dict(num_beams=3, do_sample=True), dict(num_beams=4, num_beam_groups=1, num_return_sequences=2)]
    for kw in modes:
        runs = []
        for use_cache in (True, False):
            torch.manual_seed(7)
            runs.append(hf.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, use_cache=use_cache, **kw))
        assert torch.equal(*runs), kw


@torch.no_grad()
def test_greedy_beam_search_of_width_one_and_assisted_decoding_equal_greedy() -> None:
    hf, ours = pair("hybridnorm")
    x = prompts(1, 12)
    x[0, 6:] = x[0, :6]  # repeats, so prompt lookup has candidates to propose
    greedy = ours.generate(x, NEW, temperature=0)
    assert torch.equal(hf.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, num_beams=1), greedy)
    # an eos id (never reached: min_new_tokens): transformers 5.5's candidate generators need one
    lookup = hf.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=3,
                         eos_token_id=0)
    assert torch.equal(lookup, greedy)
    assistant, _ = pair("pre", seed=5)  # a different (draft) model: its proposals are verified, never trusted
    assisted = hf.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, assistant_model=assistant,
                           eos_token_id=0)
    assert torch.equal(assisted, greedy)


@torch.no_grad()
def test_static_cache_compiled_fullgraph_equals_eager_dynamic() -> None:
    import torch._dynamo.testing

    hf, ours = pair()
    x = prompts()
    want = ours.generate(x, NEW, temperature=0)
    assert torch.equal(hf.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                   cache_implementation="static"), want)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    hf.forward = torch.compile(hf.forward, fullgraph=True, backend=counter)  # a graph break would raise
    got = hf.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, cache_implementation="static")
    assert torch.equal(got, want)
    assert counter.frame_count >= 1  # the forward really ran compiled


@torch.no_grad()
def test_continuing_from_a_returned_cache_equals_the_full_forward() -> None:
    hf, ours = pair("hybridnorm")
    x = prompts(2, 12)
    first = hf(x[:, :5], use_cache=True)
    cache = getattr(first, CACHE_FIELD)
    assert cache is not None and cache.get_seq_length() == 5
    rest = hf(x[:, 5:], **{CACHE_FIELD: cache})  # a 7-token chunk after a cached prefix
    assert (rest.logits - ours(x)[:, 5:]).abs().max() < 1e-5
    mask = torch.ones(2, 12, dtype=torch.long)
    cont = hf.generate(x, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert torch.equal(cont, ours.generate(x, NEW, temperature=0))


@torch.no_grad()
def test_a_4d_mask_equals_the_2d_padding_mask() -> None:
    hf, _ = pair()
    x = prompts(2, 7)
    mask2 = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    mask4 = (causal & mask2.bool()[:, None, :])[:, None] | torch.eye(7, dtype=torch.bool)  # (B, 1, T, T)
    pos = (mask2.cumsum(-1) - 1).clamp(min=0)
    got = hf(x, attention_mask=mask4, position_ids=pos).logits
    want = hf(x, attention_mask=mask2).logits
    assert (got - want)[mask2.bool()].abs().max() < 1e-5


@torch.no_grad()
def test_generate_from_inputs_embeds_and_returned_hidden_states() -> None:
    hf, ours = pair()
    x = prompts(1, 6)
    embeds = hf.get_input_embeddings()(x)
    out = hf.generate(inputs_embeds=embeds, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert out.tolist()[0] == ours.generate(x, NEW, temperature=0)[0, -NEW:].tolist()  # new tokens only
    hf.set_attn_implementation("eager")
    res = hf.generate(x, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                      output_hidden_states=True, output_attentions=True, output_scores=True)
    L = hf.config.num_hidden_layers
    assert len(res.hidden_states) == 3 and all(len(step) == L + 1 for step in res.hidden_states)
    assert len(res.attentions) == 3 and all(len(step) == L for step in res.attentions)
    assert res.attentions[0][0].shape == (1, 4, 6, 6) and res.attentions[1][0].shape == (1, 4, 1, 7)
    assert res.hidden_states[0][0].shape == (1, 6, 32) and res.hidden_states[1][-1].shape == (1, 1, 32)


@torch.no_grad()
def test_generate_continues_from_the_cache_a_generate_returned() -> None:
    """Scattered padding as transformers' own tests draw it: 3 tokens, then 1 more from the returned cache,
    equals 4 tokens at once."""
    hf, _ = pair("hybridnorm_star")
    g = torch.Generator().manual_seed(4)
    x = torch.randint(1, V, (3, 7), generator=g)
    mask = (torch.rand(3, 7, generator=g) > 0.3).long()
    mask[:, -1] = 1
    kw = dict(do_sample=False, return_dict_in_generate=True, eos_token_id=None)
    full = hf.generate(x, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, **kw)
    part = hf.generate(x, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, **kw)
    longer = torch.nn.functional.pad(mask, (0, part.sequences.shape[1] - 7), value=1)
    cont = hf.generate(part.sequences, attention_mask=longer, max_new_tokens=1, min_new_tokens=1,
                       **{CACHE_FIELD: getattr(part, CACHE_FIELD)}, **kw)
    assert torch.equal(cont.sequences, full.sequences)


@torch.no_grad()
def test_the_old_cache_name_still_works_and_sdpa_returns_no_attention_weights() -> None:
    import warnings

    hf, ours = pair()
    x = prompts(1, 8)
    first = hf(x[:, :5], use_cache=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = hf(x[:, 5:], past_key_values=getattr(first, CACHE_FIELD))
    assert (rest.logits - ours(x)[:, 5:]).abs().max() < 1e-5
    if CACHE_FIELD == "cache":  # transformers >= 5.23 renamed it and warns for the old name, as we do
        assert any("`past_key_values` is deprecated" in str(w.message) for w in caught)
    assert hf(x, output_attentions=True).attentions == ()  # sdpa computes no weights: eager does
