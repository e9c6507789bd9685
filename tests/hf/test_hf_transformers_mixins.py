"""What transformers' own model tests (``ModelTesterMixin``, ``ConfigTester``, run by ``CausalLMModelTest`` on a
causal LM and its task heads) ask that the other files here do not already check: every random draw of a task
head scales with ``initializer_range`` (their ``_config_zero_init`` checks, on a built head and on one loaded
with ``ignore_mismatched_sizes``), and the config takes the common properties as ``ConfigTester`` sets them,
refusing a size no model has with the one error type that tester accepts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from hybridnorm import ConfigError
from hybridnorm.hf import HybridNormConfig
from hybridnorm.hf.configuration import UnbuildableConfigError
from hybridnorm.hf.heads import (
    HybridNormForQuestionAnswering,
    HybridNormForSequenceClassification,
    HybridNormForTokenClassification,
)

HEADS = [(HybridNormForSequenceClassification, "score"), (HybridNormForTokenClassification, "score"),
         (HybridNormForQuestionAnswering, "qa_outputs")]


def config(**kw) -> HybridNormConfig:
    """As transformers' CausalLMModelTester builds it (standard fields only); HybridNorm* draws with megatron,
    whose untied LM head is 1/sqrt(d) whatever initializer_range says."""
    return HybridNormConfig(**{**dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=37, max_position_embeddings=64,
                                      pad_token_id=0, placement="hybridnorm_star"), **kw})


def trunc_std(sigma: float) -> float:
    """The standard deviation of N(0, σ²) truncated at ±3σ (the scheme's draw)."""
    a = 3.0
    pdf = math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
    return sigma * math.sqrt(1 - 2 * a * pdf / math.erf(a / math.sqrt(2)))


@pytest.mark.parametrize(("cls", "head"), HEADS, ids=[c.__name__ for c, _ in HEADS])
def test_a_task_heads_draw_scales_with_initializer_range(cls, head: str) -> None:
    """transformers' test_initialization: with initializer_range 1e-10 every parameter's mean rounds to 0 or 1
    (the head's did not: it was drawn with the megatron LM head's 1/sqrt(d)); and the head's σ is
    initializer_range, as transformers draws its heads (N(0, initializer_range), truncated here at 3σ)."""
    torch.manual_seed(0)
    model = cls(config(initializer_range=1e-10))
    for name, p in model.named_parameters():
        assert round(p.mean().item() * 1e9) / 1e9 in (0.0, 1.0), name
    assert getattr(model, head).weight.abs().max().item() < 1e-9
    torch.manual_seed(0)
    w = getattr(cls(config(initializer_range=0.05, hidden_size=256, num_labels=64)), head).weight
    assert w.std().item() == pytest.approx(trunc_std(0.05), rel=0.1)
    if getattr(model, head).bias is not None:
        assert not getattr(model, head).bias.any()


@pytest.mark.parametrize("auto", [AutoModelForSequenceClassification, AutoModelForTokenClassification])
def test_a_head_of_another_shape_loaded_with_ignore_mismatched_sizes_is_drawn_with_initializer_range(
        tmp_path: Path, auto) -> None:
    """transformers' test_mismatched_shapes_have_properly_initialized_weights: a classifier saved under
    initializer_range 1e-10 and loaded with 42 labels is refused without ignore_mismatched_sizes (RuntimeError)
    and with it, says so and draws the new head with that σ: every mean rounds to 0 or 1."""
    auto.from_config(config(initializer_range=1e-10)).save_pretrained(tmp_path)
    with pytest.raises(RuntimeError):
        auto.from_pretrained(tmp_path, num_labels=42)
    logger = logging.get_logger("transformers.modeling_utils")
    with CaptureLogger(logger) as cl:
        model = auto.from_pretrained(tmp_path, num_labels=42, ignore_mismatched_sizes=True)
    assert "MISMATCH" in cl.out and "score.weight" in cl.out  # transformers' load report names it
    assert model.score.weight.shape == (42, 32) and model.score.weight.abs().max().item() < 1e-9
    for name, p in model.named_parameters():
        assert round(p.mean().item() * 1e9) / 1e9 in (0.0, 1.0), name


def test_the_common_properties_as_config_tester_sets_them() -> None:
    """ConfigTester.create_and_test_config_common_properties: each of hidden_size, num_attention_heads,
    num_hidden_layers and vocab_size set to its index (0, 1, 2, 3) on a config reads back, and builds a config
    with that value, or raises NotImplementedError. hidden_size=0 describes no model: refused as before (a
    ConfigError naming both names), and that error is a NotImplementedError too."""
    props = ["hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"]
    cfg = HybridNormConfig()
    for value, name in enumerate(props):
        setattr(cfg, name, value)
        assert getattr(cfg, name) == value
    with pytest.raises(UnbuildableConfigError, match=r"hidden_size \(model\.d_model\)=0 must be >= 1") as err:
        HybridNormConfig(hidden_size=0)
    assert isinstance(err.value, ConfigError) and isinstance(err.value, ValueError)
    assert isinstance(err.value, NotImplementedError)
    for value, name in list(enumerate(props))[1:]:
        assert getattr(HybridNormConfig(**{name: value}), name) == value
