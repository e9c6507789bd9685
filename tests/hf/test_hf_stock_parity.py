"""Parity with stock ``transformers`` classes (tiny random weights, no download): our model and the
stock model with the same weights must produce the same logits (fp32, ≤ 1e-5), both when we export to
the stock class and when a model made by transformers is imported into ours."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
import transformers

from hybridnorm import ModelConfig, TransformerLM
from hybridnorm import placements as P
from hybridnorm.config import MoEConfig
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.hf import stock
from hybridnorm.hf.export import export_model, import_hf, load_hf
from hybridnorm.loading import load_run

TOL = 1e-5
OLMOE_PLACEMENT = P.get("qk_norm").replace_blocks(qkv_norm_scope="full").to_dict() | {"name": "olmoe_like"}

# (placement, moe, stock class name)
CASES = [
    ("pre", None, "LlamaForCausalLM"),
    ("qk_norm", None, "Qwen3ForCausalLM"),
    ("Pre-QK-Pre", None, "Qwen3ForCausalLM"),  # the paper's grammar name: matched on structure, not name
    ("olmo2", None, "Olmo2ForCausalLM"),
    ("pre", MoEConfig(num_experts=4, top_k=2, normalize_topk=True), "MixtralForCausalLM"),
    ("qk_norm", MoEConfig(num_experts=4, top_k=2), "Qwen3MoeForCausalLM"),
    (OLMOE_PLACEMENT, MoEConfig(num_experts=4, top_k=2), "OlmoeForCausalLM"),
    ("olmo2", MoEConfig(num_experts=4, top_k=2, normalize_topk=True), "FlexOlmoForCausalLM"),
]


def tiny(placement, moe=None, tie=True, head_dim=None) -> ModelConfig:
    return ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_size=48,
                       max_seq_len=64, rope_theta=10_000.0, placement=placement, tie_embeddings=tie, moe=moe,
                       attn_head_dim=head_dim)


def random_gains(model: torch.nn.Module) -> None:
    """Norm gains start at 1, which would hide a swapped or missing norm: make them all different."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def ids(batch: int = 2, T: int = 24) -> torch.Tensor:
    return torch.randint(0, 257, (batch, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize(("placement", "moe", "class_name"), CASES,
                         ids=[f"{c[2]}" + ("-grammar" if c[0] == "Pre-QK-Pre" else "") for c in CASES])
def test_export_to_stock_class_matches(tmp_path: Path, placement, moe, class_name: str, tie: bool) -> None:
    torch.manual_seed(0)
    ours = TransformerLM(tiny(placement, moe, tie)).eval()
    random_gains(ours)
    result = export_model(ours, tmp_path / "hf", ByteTokenizer())
    assert (result.class_name, result.stock) == (class_name, True)
    # loaded by transformers alone, through its own class: nothing of ours in the loop
    theirs = getattr(transformers, class_name).from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == class_name
    with torch.no_grad():
        assert (theirs(ids()).logits - ours(ids())).abs().max().item() <= TOL


@pytest.mark.parametrize(("placement", "moe", "class_name"), [c for c in CASES if c[0] != "Pre-QK-Pre"],
                         ids=[c[2] for c in CASES if c[0] != "Pre-QK-Pre"])
def test_import_from_stock_class_matches(tmp_path: Path, placement, moe, class_name: str) -> None:
    arch = next(a for a in stock.ARCHS if a.class_name == class_name)
    kwargs = stock.to_hf_config_kwargs(tiny(placement, moe, tie=False), arch, eos_token_id=256)
    torch.manual_seed(0)
    theirs = getattr(transformers, class_name)(stock.stock_config_class(arch)(**kwargs)).eval()  # HF's own init
    random_gains(theirs)
    theirs.save_pretrained(tmp_path / "hf")
    from hybridnorm.hf.export import hf_tokenizer

    hf_tokenizer(ByteTokenizer()).save_pretrained(tmp_path / "hf")

    run = load_run(import_hf(tmp_path / "hf", tmp_path / "run"))
    with torch.no_grad():
        assert (run.model(ids()) - theirs(ids()).logits).abs().max().item() <= TOL
    placement_name = run.config.model.resolved_placement().name
    assert placement_name == (placement if isinstance(placement, str) else placement["name"])


@pytest.mark.parametrize("class_name", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_decoupled_head_dim_round_trips(tmp_path: Path, class_name: str) -> None:
    """Real Qwen3 checkpoints have head_dim 128 with hidden_size / heads = 64: a stock model with
    head_dim != hidden/heads imports and exports with equal logits; OLMo-2, which derives it, refuses."""
    arch = next(a for a in stock.ARCHS if a.class_name == class_name)
    placement = "qk_norm" if class_name.startswith("Qwen3") else "pre"
    kwargs = stock.to_hf_config_kwargs(tiny(placement, head_dim=16), arch, eos_token_id=256)
    assert kwargs["head_dim"] == 16 and kwargs["hidden_size"] // kwargs["num_attention_heads"] == 8
    torch.manual_seed(0)
    theirs = getattr(transformers, class_name)(stock.stock_config_class(arch)(**kwargs)).eval()
    random_gains(theirs)
    theirs.save_pretrained(tmp_path / "hf")
    ours, _ = load_hf(tmp_path / "hf")
    assert ours.config.head_dim == 16
    with torch.no_grad():
        assert (ours(ids()) - theirs(ids()).logits).abs().max().item() <= TOL
    assert export_model(ours, tmp_path / "back").class_name == class_name
    assert "derives it" in stock.match_stock(tiny("olmo2", head_dim=16))[1]


def test_stock_generation_matches_ours(tmp_path: Path) -> None:
    """Greedy decoding through transformers' generate() on the exported Llama equals our own cached
    generate(): the KV cache, RoPE positions and the head agree beyond the first step."""
    torch.manual_seed(0)
    ours = TransformerLM(tiny("pre")).eval()
    random_gains(ours)
    export_model(ours, tmp_path / "hf", ByteTokenizer())
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = ids(1, 6)
    out = theirs.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert torch.equal(out, ours.generate(prompt, 12, temperature=0))


@pytest.mark.parametrize(("placement", "why"), [
    ("hybridnorm_star", "per-layer overrides"),
    ("hybridnorm", "attention norms on 'QKV'"),
    ("post", "no final norm"),
    ("deepnorm", "no final norm"),
    ("peri", "neither Pre-Norm nor OLMo-2"),
    ("post_shifted", "neither Pre-Norm nor OLMo-2"),
    (P.get("pre").replace_blocks(branch_scale=0.5).to_dict(), "scales"),
    ("embed_norm", "embedding norm"),
    ("lns", "1/sqrt(layer)"),
])
def test_placements_without_a_stock_class_say_why(tmp_path: Path, placement, why: str) -> None:
    mc = tiny(placement)
    arch, reason = stock.match_stock(mc)
    assert arch is None and why in reason
    result = export_model(TransformerLM(mc), tmp_path / "hf", ByteTokenizer())
    assert (result.class_name, result.stock) == ("HybridNormForCausalLM", False)
    assert why in result.reason


def test_stock_match_needs_rms_and_topk_semantics() -> None:
    assert stock.match_stock(tiny("pre"))[0].class_name == "LlamaForCausalLM"
    layer = ModelConfig(**{**tiny("pre").to_dict(), "norm": "layer"})
    assert stock.match_stock(layer) == (None, "norm='layer': the stock classes use RMSNorm")
    no_renorm = tiny("pre", MoEConfig(num_experts=4, top_k=2, normalize_topk=False))
    arch, reason = stock.match_stock(no_renorm)
    assert arch is None and "always renormalizes" in reason
    # matched on the resolved per-layer blocks: Mix-LN's Post-Norm share of 2 layers is empty
    assert stock.match_stock(tiny("mix_ln"))[0].class_name == "LlamaForCausalLM"
    deep = ModelConfig(**{**tiny("mix_ln").to_dict(), "n_layers": 8})
    assert "per-layer overrides" in stock.match_stock(deep)[1]
    after = tiny(P.get("qk_norm").replace_blocks(qkv_norm_order="after_rope").to_dict())
    assert stock.match_stock(after)[0] is None


def test_forcing_a_stock_class_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    from hybridnorm.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot export as llama: per-layer overrides"):
        export_model(TransformerLM(tiny("hybridnorm_star")), tmp_path / "a", arch="llama")
    with pytest.raises(ConfigError, match="matches qwen3, not llama"):
        export_model(TransformerLM(tiny("qk_norm")), tmp_path / "b", arch="llama")
    with pytest.raises(ConfigError, match="--arch='gpt2' is not one of"):
        export_model(TransformerLM(tiny("pre")), tmp_path / "c", arch="gpt2")


def test_own_class_can_be_forced_and_loads_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ours = TransformerLM(tiny("pre")).eval()
    result = export_model(ours, tmp_path / "hf", ByteTokenizer(), arch="hybridnorm")
    assert not result.stock and "asked for hybridnorm's own class" in result.reason
    model, model_type = load_hf(tmp_path / "hf")
    assert model_type == "hybridnorm"
    with torch.no_grad():
        assert torch.equal(model(ids()), ours(ids()))


@pytest.mark.parametrize(("model_type", "head_dim"), [("mistral", None), ("mistral", 16), ("phi3", None)])
def test_a_llama_like_class_without_sliding_window_imports_with_its_logits_and_exports_as_llama(
        tmp_path: Path, model_type: str, head_dim) -> None:
    """Mistral (v0.3; Nemo, whose head_dim 16 here != hidden / heads) and Phi-3 (Phi-4: Q/K/V and gate/up
    stored fused), with ``sliding_window`` null, are Llama's function: imported, our model gives the stock
    class's logits and greedy tokens; exported, it is a Llama with those logits."""
    arch = stock.BY_TYPE[model_type]
    kwargs = stock.to_hf_config_kwargs(tiny("pre", tie=False, head_dim=head_dim), arch, eos_token_id=256)
    torch.manual_seed(0)
    config = stock.stock_config_class(arch)(**kwargs, sliding_window=None)
    theirs = stock.stock_model_class(arch)(config).eval()
    random_gains(theirs)
    theirs.save_pretrained(tmp_path / "hf")
    from hybridnorm.hf.export import hf_tokenizer

    hf_tokenizer(ByteTokenizer()).save_pretrained(tmp_path / "hf")
    run = load_run(import_hf(tmp_path / "hf", tmp_path / "run"))
    assert run.config.model.resolved_placement().name == "pre"
    with torch.no_grad():
        assert (run.model(ids()) - theirs(ids()).logits).abs().max().item() <= TOL
    prompt = ids(1, 6)
    want = theirs.generate(prompt, max_new_tokens=10, do_sample=False, min_new_tokens=10)
    assert torch.equal(run.model.generate(prompt, 10, temperature=0), want)
    mapped_back = stock.to_hf_state_dict(run.model.state_dict(), run.config.model, arch)  # the inverse map
    assert mapped_back.keys() == theirs.state_dict().keys()
    assert all(torch.equal(mapped_back[k], w) for k, w in theirs.state_dict().items())
    assert export_model(run.model, tmp_path / "back").class_name == "LlamaForCausalLM"
    llama = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert (llama(ids()).logits - theirs(ids()).logits).abs().max().item() <= TOL


@pytest.mark.parametrize(("model_type", "window"), [("mistral", 8), ("mistral", None), ("phi3", 2047)])
def test_a_sliding_window_is_refused_naming_it(tmp_path: Path, model_type: str, window) -> None:
    """``sliding_window: 8`` (2047: Phi-3-mini-4k's) and a Mistral config.json without the field
    (MistralConfig then reads 4096, as transformers would compute with) are refused before any weight."""
    import json

    from hybridnorm.errors import ConfigError

    arch = stock.BY_TYPE[model_type]
    kwargs = stock.to_hf_config_kwargs(tiny("pre"), arch, eos_token_id=256)
    stock.stock_config_class(arch)(**kwargs, sliding_window=window or 4096).save_pretrained(tmp_path / "hf")
    if window is None:
        cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
        del cfg["sliding_window"]
        (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=rf"config.json: {model_type} config: sliding-window .*sliding_window="
                                          rf"{window or 4096}"):
        load_hf(tmp_path / "hf")
