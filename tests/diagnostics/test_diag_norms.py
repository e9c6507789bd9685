"""Per-layer / per-sublayer gradient, update and weight norms against norms taken by hand from the tensors,
and the DiagnosticsConfig switches (validation, CLI overrides)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridnorm import ModelConfig, TransformerLM, lm_loss
from hybridnorm.diagnostics import (
    DiagnosticsConfig,
    UpdateTracker,
    grad_norm_by_layer,
    param_groups_of,
    weight_norm_by_layer,
)
from hybridnorm.errors import ConfigError
from hybridnorm.train.config import TrainConfig, apply_overrides

# slots of every kind: pre/post/out norms, QKV(C) norms, embed norm, untied head, MoE router and experts
CASES = {
    "peri": dict(placement="peri"),
    "post": dict(placement="post"),
    "hybridnorm_star": dict(placement="hybridnorm_star"),
    "embed_norm_untied": dict(placement="embed_norm", tie_embeddings=False),
    "moe": dict(placement="hybridnorm", moe=dict(num_experts=4, top_k=2), ffn_hidden_size=32),
}


def _model(**kw) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(ModelConfig.from_preset("tiny", n_layers=3, **kw))


def _backward(model: TransformerLM) -> None:
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    logits, aux = model(ids, return_aux=True)
    (lm_loss(logits[:, :-1], ids[:, 1:]) + (aux["aux_loss"] if aux else 0)).backward()


def _hand_groups(model: TransformerLM) -> dict[str, list[str]]:
    """Group -> parameter names, spelled out from the module layout (independently of param_groups_of)."""
    names = [n for n, _ in model.named_parameters()]
    groups = {}
    for top in ("embed", "embed_norm", "final_norm", "lm_head"):
        members = [n for n in names if n.split(".")[0] == top]
        if members:
            groups[top] = members
    for i in range(model.config.n_layers):
        block = [n for n in names if n.startswith(f"blocks.{i}.")]
        attn = [n for n in block if n.split(".")[2] in ("attn", "attn_norm", "attn_out_norm", "attn_post_norm")]
        ffn = [n for n in block if n.split(".")[2] in ("ffn", "ffn_norm", "ffn_out_norm", "ffn_post_norm")]
        assert sorted(attn + ffn) == sorted(block), "a block parameter in neither sublayer"
        groups.update({f"blocks.{i}": block, f"blocks.{i}.attn": attn, f"blocks.{i}.ffn": ffn})
    # the top-level groups and the block totals partition the parameters
    assert sorted(n for g, ns in groups.items() if g.count(".") <= 1 for n in ns) == sorted(names)
    return groups


def _norm_of(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


@pytest.mark.parametrize("case", CASES)
def test_grad_norm_by_layer_matches_hand_computation(case):
    model = _model(**CASES[case])
    _backward(model)
    params = dict(model.named_parameters())
    got = grad_norm_by_layer(model)
    hand = _hand_groups(model)
    assert set(got) == set(hand)
    for group, names in hand.items():
        want = _norm_of([params[n].grad for n in names if params[n].grad is not None])
        assert got[group] == pytest.approx(want, rel=1e-5, abs=1e-12), group
    assert any(v > 0 for k, v in got.items() if k.endswith(".attn"))
    # the whole model: sqrt of the sum of squares of the top-level groups equals the global grad norm
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    top = [v for k, v in got.items() if not k.startswith("blocks.") or k.count(".") == 1]
    assert math.sqrt(sum(v * v for v in top)) == pytest.approx(float(total), rel=1e-5)


def test_groups_are_in_model_order_and_wrappers_are_ignored():
    model = _model(placement="hybridnorm", tie_embeddings=False)
    _backward(model)
    keys = list(grad_norm_by_layer(model))
    assert keys[:4] == ["embed", "blocks.0", "blocks.0.attn", "blocks.0.ffn"]
    assert keys[-2:] == ["final_norm", "lm_head"]
    assert param_groups_of("module._orig_mod.blocks.2.ffn_norm.weight") == ("blocks.2", "blocks.2.ffn")
    assert param_groups_of("module.blocks.0.attn.q_norm.weight") == ("blocks.0", "blocks.0.attn")
    wrapped = torch.nn.Module()
    wrapped.module = model  # what DDP looks like from named_parameters
    assert grad_norm_by_layer(wrapped) == grad_norm_by_layer(model)


def test_missing_grads_count_as_zero():
    model = _model(placement="pre")
    assert all(v == 0.0 for v in grad_norm_by_layer(model).values())


def test_update_and_weight_norms_match_hand_computation():
    model = _model(placement="hybridnorm_star")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _backward(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tracker = UpdateTracker(model)
    tracker.snapshot()
    opt.step()
    got = tracker.norms()
    params = dict(model.named_parameters())
    weights = weight_norm_by_layer(model)
    for group, names in _hand_groups(model).items():
        want = _norm_of([params[n].detach() - before[n] for n in names])
        assert got[group] == pytest.approx(want, rel=1e-5), group
        assert weights[group] == pytest.approx(_norm_of([params[n].detach() for n in names]), rel=1e-6), group
    assert all(v > 0 for v in got.values())
    with pytest.raises(RuntimeError, match="snapshot"):
        tracker.norms()  # the copy is freed after one use


def test_config_defaults_off_and_validation_names_the_field():
    cfg = TrainConfig()
    assert cfg.diagnostics == DiagnosticsConfig() and cfg.diagnostics.every == 0 and not cfg.diagnostics.enabled
    for override, field in (("every=-1", "diagnostics.every"), ("spike_window=5", "diagnostics.spike_window"),
                            ("spike_zscore=-1", "diagnostics.spike_zscore"),
                            ("spike_zscore=.nan", "diagnostics.spike_zscore")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            TrainConfig.from_dict(apply_overrides({}, [f"--diagnostics.{override}"]))
    with pytest.raises(ConfigError, match="skip_spikes"):
        TrainConfig.from_dict(apply_overrides({}, ["--diagnostics.skip_spikes=true", "--diagnostics.spike_zscore=0"]))
    with pytest.raises(ConfigError, match="every"):
        TrainConfig.from_dict(apply_overrides({}, ["--diagnostics.every=often"]))
    with pytest.raises(ConfigError, match="evry"):
        TrainConfig.from_dict(apply_overrides({}, ["--diagnostics.evry=10"]))


def test_cli_override_and_yaml_roundtrip(tmp_path):
    cfg = TrainConfig.from_dict(apply_overrides({}, ["--diagnostics.every=10", "--diagnostics.attention=false",
                                                     "--diagnostics.skip_spikes=true"]))
    assert (cfg.diagnostics.every, cfg.diagnostics.attention, cfg.diagnostics.skip_spikes) == (10, False, True)
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml(), encoding="utf-8")
    again = TrainConfig.load(path, ["--diagnostics.spike_zscore=4"])
    assert again.diagnostics == DiagnosticsConfig(every=10, attention=False, skip_spikes=True, spike_zscore=4.0)
