"""Big-model inference through accelerate, as transformers' users run it: ``from_pretrained(device_map=...,
offload_folder=...)`` with some modules offloaded to "cpu" or "disk" (the way a model larger than the GPU
runs). accelerate's hooks load an offloaded module's weights only inside that module's own forward and put
them back on the meta device afterwards — and torch computes with a meta weight without an error (it returns
garbage). So every weight must be read inside its own module's forward.

Found and fixed: the fused Q/K/V kernel read the Q/K/V norms' gains without calling the norm modules, so an
offloaded HybridNorm block computed with garbage gains (logits off by 8e-4 here, silently) and its loss
failed; the fused head + loss likewise read an offloaded untied head's weight. Both now step aside for a
module whose ``forward`` accelerate has replaced (``has_hooks``). A *tied* head reads the embedding's weight
outside the embedding's forward by its nature: the HF class runs the embedding's accelerate hook around
that read (it computed with garbage before, or, once that was refused, stopped with an error). Loading with
the embedding offloaded also failed at first (the RoPE tables, computed not loaded, were left on meta).

The oracle is the same folder loaded whole, without a device map: logits, loss and greedy tokens equal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate", reason="device_map offloading needs accelerate")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from test_hf_stock_parity import random_gains, tiny  # tests/hf/: the tiny configs and randomized gains

from hybridnorm import TransformerLM
from hybridnorm.config import MoEConfig
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.hf import HybridNormForCausalLM
from hybridnorm.hf.export import export_model

MOE = MoEConfig(num_experts=4, top_k=2)
CASES = {  # id -> (placement, moe, tied head)
    "hybridnorm_star-tied": ("hybridnorm_star", None, True),  # fused Q/K/V norms, the tied head
    "hybridnorm-untied": ("hybridnorm", None, False),  # the fused head + loss on an untied head
    "pre-tied": ("pre", None, True),
    "moe-untied": ("hybridnorm_star", MOE, False),  # router and stacked expert weights offloaded
}


def _export(tmp: Path, case: str) -> Path:
    placement, moe, tie = CASES[case]
    torch.manual_seed(0)
    lm = TransformerLM(tiny(placement, moe, tie=tie)).eval()
    random_gains(lm)
    return export_model(lm, tmp / "hf", ByteTokenizer(), arch="hybridnorm").out_dir


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    return ids, mask


def _split_map(tie: bool) -> dict[str, str]:
    """The embedding and block 0 on the CPU (the execution device here), block 1 and the rest on disk."""
    dm = {"model.embed": "cpu", "model.blocks.0": "cpu", "model.blocks.1": "disk", "model.final_norm": "disk"}
    return dm if tie else {**dm, "model.lm_head": "disk"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_offloaded_blocks_compute_what_the_whole_model_computes(tmp_path, case):
    folder = _export(tmp_path, case)
    whole = HybridNormForCausalLM.from_pretrained(folder).eval()
    offloaded = HybridNormForCausalLM.from_pretrained(folder, device_map=_split_map(CASES[case][2]),
                                                      offload_folder=tmp_path / "offload").eval()
    # really offloaded: block 1's weights sit on the meta device between forwards
    assert offloaded.model.blocks[1].attn.w_qkv.weight.is_meta
    ids, mask = _batch()
    with torch.no_grad():
        want, got = whole(ids, attention_mask=mask), offloaded(ids, attention_mask=mask)
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-6)
        lw, lo = whole(ids, labels=ids).loss, offloaded(ids, labels=ids).loss  # the fused head + loss path
        torch.testing.assert_close(lo, lw, rtol=1e-6, atol=0)
    greedy = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(offloaded.generate(ids, **greedy), whole.generate(ids, **greedy))


def _stock_offloads_a_whole_model_to_disk(tmp: Path) -> bool:
    """Whether this transformers dispatches a stock LlamaForCausalLM offloaded whole to disk (5.5.0 leaves
    its weights on the meta device without hooks and sets no hf_device_map: its forward fails)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp / "llama")
    stock = LlamaForCausalLM.from_pretrained(tmp / "llama", device_map={"": "disk"}, offload_folder=tmp / "off")
    return getattr(stock, "hf_device_map", None) == {"": "disk"}


@pytest.mark.parametrize("case", ["hybridnorm_star-tied", "moe-untied"])
def test_everything_offloaded_to_disk(tmp_path, case):
    """``device_map="auto"`` with too little memory: accelerate puts the whole model on disk, the embedding
    too, so a tied head reads a weight that is loaded for the read and put back afterwards."""
    if not _stock_offloads_a_whole_model_to_disk(tmp_path / "stock"):
        pytest.skip("this transformers cannot offload a whole model to disk: stock LlamaForCausalLM fails too")
    folder = _export(tmp_path, case)
    whole = HybridNormForCausalLM.from_pretrained(folder).eval()
    size = sum(p.numel() * p.element_size() for p in whole.parameters())
    offloaded = HybridNormForCausalLM.from_pretrained(folder, device_map="auto", max_memory={"cpu": size // 4},
                                                      offload_folder=tmp_path / "offload").eval()
    assert offloaded.hf_device_map == {"": "disk"}
    ids, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids, attention_mask=mask).logits,
                                   whole(ids, attention_mask=mask).logits, rtol=0, atol=1e-6)
    assert offloaded.model.embed.weight.is_meta  # back on disk after the head's read: nothing kept in memory
    greedy = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(offloaded.generate(ids, **greedy), whole.generate(ids, **greedy))


def test_a_head_weight_left_on_meta_is_refused_not_computed_with():
    """Outside the HF class (or with a hook we do not know), a head weight on the meta device beside real
    hidden states would give garbage logits without an error from torch: TransformerLM refuses it. A model
    wholly on meta (``hybridnorm plan``'s estimate) still runs."""
    lm = TransformerLM(tiny("hybridnorm_star")).eval()
    x = torch.randn(1, 3, lm.config.d_model)
    lm.embed.weight = torch.nn.Parameter(torch.empty_like(lm.embed.weight, device="meta"))
    with pytest.raises(RuntimeError, match=r"embed \(the tied head reads its weight\), is on the meta device"):
        lm.head(x)
    assert lm.head(x.to("meta")).is_meta
