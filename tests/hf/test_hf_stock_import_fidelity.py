"""``hybridnorm import`` of stock folders whose config.json says more than the config class declares: the stock
model's own logits (fp32, from_pretrained of the same folder) are the oracle. Either the imported run computes
them, or the import is one ConfigError naming the field; never other logits, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from hybridnorm.config import ModelConfig, MoEConfig
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.errors import ConfigError
from hybridnorm.hf import stock
from hybridnorm.hf.export import hf_tokenizer, import_hf, load_hf
from hybridnorm.loading import load_run

TOL = 1e-5


def _ids() -> torch.Tensor:
    return torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(1))


def _stock_folder(path: Path, model_type: str, **overrides) -> tuple[stock.StockArch, Path]:
    """A tiny random stock model saved by transformers (norm gains != 1, so a swapped norm shows), with a tokenizer."""
    arch = stock.BY_TYPE[model_type]
    moe = MoEConfig(num_experts=4, top_k=2, normalize_topk=True) if arch.moe else None
    mc = ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_size=48,
                     max_seq_len=64, placement="pre", tie_embeddings=False, moe=moe)
    kwargs = stock.to_hf_config_kwargs(mc, arch, eos_token_id=256) | overrides
    torch.manual_seed(0)
    model = stock.stock_model_class(arch)(stock.stock_config_class(arch)(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    hf_tokenizer(ByteTokenizer()).save_pretrained(path)
    return arch, path


def _stock_logits(arch: stock.StockArch, path: Path) -> torch.Tensor:
    theirs = stock.stock_model_class(arch).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return theirs(_ids()).logits


@pytest.mark.parametrize("model_type", ["olmo2", "phi3", "flex_olmo"])
def test_a_head_dim_the_config_class_does_not_declare_is_the_one_the_stock_model_uses(tmp_path: Path,
                                                                                     model_type: str) -> None:
    """OLMo-2's, Phi-3's and FlexOlmo's attention read ``getattr(config, "head_dim", hidden / heads)``, so a
    config.json with ``head_dim: 16`` (hidden / heads = 8) is a model with 16-wide heads; the import derived 8
    and failed with a state-dict traceback."""
    arch, path = _stock_folder(tmp_path / "hf", model_type, head_dim=16)
    assert json.loads((path / "config.json").read_text())["head_dim"] == 16
    run = load_run(import_hf(path, tmp_path / "run"))
    assert run.config.model.head_dim == 16
    with torch.no_grad():
        assert (run.model(_ids()) - _stock_logits(arch, path)).abs().max().item() <= TOL


def test_olmoe_with_head_dim_unlike_hidden_over_heads_is_refused_naming_head_dim(tmp_path: Path) -> None:
    """OLMoE's q_norm is hidden_size wide, so such a folder runs nowhere (the stock model fails on its first
    forward): one ConfigError naming head_dim, not a state-dict traceback."""
    arch, path = _stock_folder(tmp_path / "hf", "olmoe", head_dim=16)
    with pytest.raises(RuntimeError):  # the stock model itself cannot run it
        _stock_logits(arch, path)
    with pytest.raises(ConfigError, match=r"config.json: olmoe config: head_dim=16 != hidden_size"):
        load_hf(path)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_tied_config_whose_files_hold_another_lm_head_imports_the_files_head(tmp_path: Path,
                                                                              model_type: str) -> None:
    """``tie_word_embeddings: true`` with an ``lm_head.weight`` unlike the embedding in the files: transformers
    leaves them untied and computes with the file's head; the import tied them (logits off by ~20)."""
    from safetensors.torch import load_file, save_file

    arch, path = _stock_folder(tmp_path / "hf", model_type, tie_word_embeddings=True)
    sd = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in sd
    embed = sd["model.embed_tokens.weight"]
    sd["lm_head.weight"] = torch.randn(embed.shape, generator=torch.Generator().manual_seed(2))
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    run = load_run(import_hf(path, tmp_path / "run"))
    assert not run.config.model.tie_embeddings
    with torch.no_grad():
        assert (run.model(_ids()) - _stock_logits(arch, path)).abs().max().item() <= TOL


@pytest.mark.parametrize("model_type", ["qwen3", "mistral"])
def test_layer_types_with_a_sliding_layer_is_refused_naming_layer_types(tmp_path: Path, model_type: str) -> None:
    """A ``sliding_attention`` entry in layer_types (transformers' caches read it for every class) was imported
    as full attention; the stock model builds a sliding-window cache for it. Full-only layer_types still import
    with the stock logits."""
    arch, path = _stock_folder(tmp_path / "full", model_type, layer_types=["full_attention"] * 2,
                               **({"sliding_window": None} if model_type == "mistral" else {}))
    run_model, _ = load_hf(path)
    with torch.no_grad():
        assert (run_model(_ids()) - _stock_logits(arch, path)).abs().max().item() <= TOL
    cfg = json.loads((path / "config.json").read_text())
    # Mistral's own sliding_window stays null here: a set one is refused by its name first
    window = {"sliding_window": 8} if model_type == "qwen3" else {}
    layer_types = {"layer_types": ["full_attention", "sliding_attention"]}
    (path / "config.json").write_text(json.dumps(cfg | layer_types | window))
    with pytest.raises(ConfigError, match=r"layer_types=\['full_attention', 'sliding_attention'\]: only full_att"):
        load_hf(path)
