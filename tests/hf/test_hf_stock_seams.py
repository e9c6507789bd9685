"""``HybridNormForCausalLM`` against the stock transformers class that computes the same function, with the
same weights, through transformers' own entry points: a left-padded batch's logits, hidden states and
attention weights, the loss with ``-100`` labels and ``num_items_in_batch``, every parameter's gradient,
and ``generate()`` in greedy, sampling, beam-search, static-cache, repetition-penalty and chunked-prefill
modes.

The stock class is the independent oracle: transformers' own code for the cache, masks, positions and
loss. (test_hf_stock_parity.py compares our *TransformerLM* with the stock classes on plain forwards; this
file drives our HF class the way transformers' users do.) Known, documented differences are kept out:
a plain forward with a 2-D mask and no ``position_ids`` counts positions over real tokens in ours and
from 0 in the stock classes, so the forwards here pass explicit positions (``generate`` derives the same
ones in both); an MoE's loss includes its router losses in ours (docs/huggingface.md), so the MoE here
weighs them 0 (test_hf_moe_router.py compares them with Mixtral's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
import transformers
from test_hf_stock_parity import random_gains, tiny  # tests/hf/: the tiny configs and randomized gains

from hybridnorm import TransformerLM
from hybridnorm.config import MoEConfig
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.hf import HybridNormForCausalLM, stock
from hybridnorm.hf.export import export_model

TOL = 1e-5
CASES = {
    "llama": ("pre", None),
    "qwen3": ("qk_norm", None),
    "olmo2": ("olmo2", None),
    # router-loss weights 0: our loss includes the router losses, a stock class's only with output_router_logits
    "mixtral": ("pre", MoEConfig(num_experts=4, top_k=2, normalize_topk=True, lb_loss_weight=0.0, z_loss_weight=0.0)),
}


def pair(tmp: Path, case: str, impl: str = "sdpa",
         moe: MoEConfig | None = None) -> tuple[HybridNormForCausalLM, torch.nn.Module]:
    """Ours and the stock class of ``case`` with the same weights; ``moe`` in place of the case's own."""
    placement, case_moe = CASES[case]
    moe = moe or case_moe
    torch.manual_seed(0)
    lm = TransformerLM(tiny(placement, moe)).eval()
    random_gains(lm)
    stock_class = export_model(lm, tmp / "stock", ByteTokenizer()).class_name
    export_model(lm, tmp / "ours", ByteTokenizer(), arch="hybridnorm")
    theirs = getattr(transformers, stock_class).from_pretrained(tmp / "stock", attn_implementation=impl).eval()
    ours = HybridNormForCausalLM.from_pretrained(tmp / "ours", attn_implementation=impl).eval()
    return ours, theirs


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 12 tokens, two of them left-padded (by 4 and by 1)."""
    ids = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, :1] = 0
    return ids, mask


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= TOL


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_states_loss_and_gradients_equal_the_stock_class(tmp_path: Path, case: str, impl: str) -> None:
    ours, theirs = pair(tmp_path, case, impl)
    ids, mask = batch()
    real = mask.bool()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    eager = impl == "eager"
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True, output_attentions=eager)
        b = theirs(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True,
                   output_attentions=eager)
    assert close(a.logits[real], b.logits[real])
    assert len(a.hidden_states) == len(b.hidden_states) == 3
    for x, y in zip(a.hidden_states, b.hidden_states, strict=True):
        assert close(x[real], y[real])
    if eager:  # (B, H, T, S): the rows of real queries
        for x, y in zip(a.attentions, b.attentions, strict=True):
            assert close(x.transpose(1, 2)[real], y.transpose(1, 2)[real])
    # the loss: -100 labels on the padding and on a prefix, and Trainer's num_items_in_batch
    labels = ids.masked_fill(~real, -100)
    labels[2, :5] = -100
    scored = (labels[:, 1:] != -100).sum()
    for extra in ({}, {"num_items_in_batch": scored + 7}):
        kw = dict(attention_mask=mask, position_ids=positions, labels=labels, **extra)
        with torch.no_grad():
            assert abs(ours(ids, **kw).loss - theirs(ids, **kw).loss).item() <= TOL
    # gradients of the same loss, mapped to the stock names
    ours.train()
    theirs.train()
    kw = dict(attention_mask=mask, position_ids=positions, labels=labels)
    ours(ids, **kw).loss.backward()
    theirs(ids, **kw).loss.backward()
    grads = {n: p.grad for n, p in ours.model.named_parameters()}
    mapped = stock.to_hf_state_dict(grads, ours.model.config, stock.BY_TYPE[theirs.config.model_type])
    params = dict(theirs.named_parameters(remove_duplicate=False))  # a tied head is its embedding
    assert set(mapped) == set(params)
    for name, g in mapped.items():
        assert (g - params[name].grad).abs().max().item() <= 1e-5, name


GENERATE = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0, temperature=1.0),
    "top_p": dict(do_sample=True, top_p=0.8, temperature=0.7),
    "beam": dict(num_beams=3, do_sample=False),
    "static_cache": dict(do_sample=False, cache_implementation="static"),
    "penalties": dict(do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=2),
    "chunked_prefill": dict(do_sample=False, prefill_chunk_size=5),  # the prompt enters the cache 5 at a time
}


@pytest.mark.parametrize("case", list(CASES))
def test_generate_equals_the_stock_class_in_every_mode(tmp_path: Path, case: str) -> None:
    """Same tokens from a left-padded batch: positions, the cache, the masks and the sampling all agree
    (sampling from one seed: the two draw from probabilities equal to ~1e-6)."""
    ours, theirs = pair(tmp_path, case, "sdpa")
    ids, mask = batch()
    for mode, kw in GENERATE.items():
        outs = []
        for model in (ours, theirs):
            torch.manual_seed(7)
            outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                                       pad_token_id=256, **kw))
        assert torch.equal(outs[0], outs[1]), mode
