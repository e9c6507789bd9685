"""The HF classes compute what the training code and the float64 oracle compute, through every output
transformers offers: logits for every placement with each attention backend, hidden states, attention
weights, the loss conventions (against transformers' own ``ForCausalLMLoss``), tuples, ``logits_to_keep``,
``inputs_embeds``, explicit positions, and the base ``HybridNormModel`` for ``AutoModel``."""

from __future__ import annotations

from pathlib import Path

import oracle  # tests/oracle.py: the float64 reference of every placement
import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from transformers import AutoModel, AutoModelForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

import hybridnorm as hn
import hybridnorm.hf
from hybridnorm import ModelConfig, TransformerLM
from hybridnorm.hf import HybridNormConfig, HybridNormForCausalLM, HybridNormModel
from hybridnorm.hf.loss import causal_lm_loss

V = 97


def mc_of(placement: str, **kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=V, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_size=48,
                                 max_seq_len=64, placement=placement), **kw})


def hf_model(placement: str, impl: str = "sdpa", dtype: torch.dtype = torch.float32, **kw) -> HybridNormForCausalLM:
    torch.manual_seed(0)
    hf = HybridNormForCausalLM(HybridNormConfig.from_model_config(mc_of(placement, **kw)))
    oracle.randomize_(hf.model, seed=0)
    hf.set_attn_implementation(impl)
    return hf.to(dtype).eval()


IDS = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("placement", sorted(set(hn.placements.names()) | set(hn.placements.PAPER_NAMES)))
@torch.no_grad()
def test_float64_logits_equal_transformer_lm_and_the_oracle(placement: str, impl: str) -> None:
    hf = hf_model(placement, impl, torch.float64)
    ours = TransformerLM(hf.config.model_config()).to(torch.float64).eval()
    ours.load_state_dict(hf.model.state_dict())
    got = hf(IDS).logits
    assert (got - ours(IDS)).abs().max() < 1e-12
    want, _ = oracle.oracle_logits(hf.model.state_dict(), hf.config.model_config(), placement, IDS)
    assert (got - want).abs().max() < 1e-5  # the RoPE tables are fp32 by design (nn/rope.py): ~1e-7..1e-6 here


@torch.no_grad()
def test_hidden_states_and_attention_weights() -> None:
    hf = hf_model("hybridnorm_star", "eager")
    out = hf(IDS, output_hidden_states=True, output_attentions=True)
    L, lm = hf.config.num_hidden_layers, hf.model
    assert len(out.hidden_states) == L + 1 and len(out.attentions) == L
    inputs = []  # what each block really received, by a hook: the recorded states are those
    hooks = [b.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for b in lm.blocks]
    hf(IDS)
    for h in hooks:
        h.remove()
    for got, want in zip(out.hidden_states[:L], inputs, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(out.hidden_states[-1], lm.trunk(lm.embed(IDS), lm.rope_cos[:11], lm.rope_sin[:11]))
    for w in out.attentions:  # (B, H, T, T): rows are distributions over the past only
        assert w.shape == (2, 4, 11, 11)
        assert torch.allclose(w.sum(-1), torch.ones(2, 4, 11), atol=1e-5)
        assert w.triu(1).abs().max() == 0
    sdpa = hf_model("hybridnorm_star", "sdpa")
    assert (sdpa(IDS).logits - out.logits).abs().max() < 1e-5  # the two backends agree
    plain = hf(IDS, return_dict=False)
    assert isinstance(plain, tuple) and torch.equal(plain[0], out.logits)


@torch.no_grad()
def test_inputs_embeds_positions_and_logits_to_keep() -> None:
    hf = hf_model("hybridnorm", tie_embeddings=False)
    full = hf(IDS).logits
    assert torch.equal(hf(inputs_embeds=hf.get_input_embeddings()(IDS)).logits, full)
    # the head on fewer rows: a GEMM of another shape, which some CPUs' BLAS blocks differently (measured
    # 4.8e-7 on an AMD EPYC), so equal to float rounding rather than bitwise
    assert (hf(IDS, logits_to_keep=3).logits - full[:, -3:]).abs().max() < 1e-5
    assert (hf(IDS, logits_to_keep=torch.tensor([0, 5])).logits - full[:, [0, 5]]).abs().max() < 1e-5
    shifted = hf(IDS, position_ids=torch.arange(4, 15)[None]).logits  # RoPE is relative: same attention
    assert (shifted - full).abs().max() < 1e-4
    with pytest.raises(ValueError, match="exactly one"):
        hf(IDS, inputs_embeds=hf.get_input_embeddings()(IDS))


@pytest.mark.parametrize("with_shift", [False, True])
def test_loss_follows_transformers_conventions(with_shift: bool) -> None:
    """Labels with ignored tokens; mean, and sum / num_items_in_batch: our loss == ForCausalLMLoss."""
    hf = hf_model("hybridnorm_star")
    labels = IDS.clone()
    labels[0, :4] = -100
    logits = hf(IDS).logits
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous() if with_shift else None
    kw = dict(shift_labels=shift) if with_shift else dict(labels=labels)
    for n in (None, torch.tensor(37)):
        want = ForCausalLMLoss(logits, labels, V, num_items_in_batch=n, shift_labels=shift)
        got = hf(IDS, num_items_in_batch=n, **kw).loss
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
    loss, scored = causal_lm_loss(logits.double(), labels)
    assert loss.dtype == torch.float64 and scored.item() == 2 * 10 - 3  # labels 1..3 of row 0 ignored


def test_base_model_loads_a_causal_lm_folder_and_back(tmp_path: Path) -> None:
    hf = hf_model("post", tie_embeddings=False)
    hf.save_pretrained(tmp_path / "lm")
    base = AutoModel.from_pretrained(tmp_path / "lm").eval()
    assert type(base) is HybridNormModel
    with torch.no_grad():
        h = base(IDS).last_hidden_state
        assert torch.equal(hf.model.head(h), hf(IDS).logits)
    base.save_pretrained(tmp_path / "base")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, hf(IDS).logits)


def test_config_from_standard_fields_and_their_authority() -> None:
    """Built from the standard fields alone (as transformers' tests and tools do); a standard field
    changed later (resize_token_embeddings sets vocab_size) reaches the ModelConfig and the saved dict."""
    cfg = HybridNormConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=37, max_position_embeddings=128,
                           placement="Pre-QKV-Post")
    mc = cfg.model_config()
    assert (mc.vocab_size, mc.d_model, mc.n_layers, mc.kv_heads, mc.ffn_hidden_size, mc.max_seq_len) == \
        (99, 32, 2, 2, 37, 128)
    assert mc.resolved_placement() == hn.placements.get("Pre-QKV-Post")
    cfg.num_hidden_layers = 3
    assert len(HybridNormForCausalLM(cfg).model.blocks) == 3
    assert cfg.to_dict()["hybridnorm"]["n_layers"] == 3
    with pytest.raises(hn.ConfigError, match="n_kv_heads"):
        HybridNormConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=3)


def test_tie_word_embeddings_is_honoured_and_old_exports_keep_their_tied_head(tmp_path: Path) -> None:
    untied = HybridNormConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, tie_word_embeddings=False)
    assert HybridNormForCausalLM(untied).get_output_embeddings() is not None
    untied.tie_word_embeddings = True  # changed after construction: still the truth for the model built next
    tied = HybridNormForCausalLM(untied)
    assert tied.model.lm_head is None and tied.get_output_embeddings().weight is tied.model.embed.weight
    # a config.json as exports before this release wrote it: tie_word_embeddings false, the dict tied
    old = HybridNormConfig.from_dict({"model_type": "hybridnorm", "tie_word_embeddings": False,
                                      "hybridnorm": mc_of("hybridnorm_star").to_dict()})
    assert old.tie_word_embeddings is True and HybridNormForCausalLM(old).model.lm_head is None
