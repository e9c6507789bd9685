"""The LR schedule, the weight-decay groups and gradient clipping as the trainer applies it."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from train_helpers import read_metrics

from hybridnorm.config import ModelConfig
from hybridnorm.nn.model import TransformerLM
from hybridnorm.nn.norms import Norm
from hybridnorm.train.optim import OptimConfig, build_optimizer, lr_at, param_groups, short_warmup_note
from hybridnorm.train.trainer import train


def test_warmup_is_linear_and_cosine_ends_at_min_lr():
    cfg = OptimConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    max_steps = 110
    warm = [lr_at(s, cfg, max_steps) for s in range(10)]
    assert warm == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])
    assert lr_at(10, cfg, max_steps) == pytest.approx(1e-3)  # peak right after warmup
    assert lr_at(60, cfg, max_steps) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half way down the cosine
    assert lr_at(max_steps, cfg, max_steps) == pytest.approx(1e-4)
    assert lr_at(max_steps + 50, cfg, max_steps) == pytest.approx(1e-4)  # stays at the floor
    decay = [lr_at(s, cfg, max_steps) for s in range(10, max_steps + 1)]
    assert all(a > b for a, b in itertools.pairwise(decay))  # strictly decreasing
    expected = [1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * (s - 10) / 100)) for s in range(10, max_steps + 1)]
    assert decay == pytest.approx(expected)


def test_no_warmup_and_degenerate_schedules():
    cfg = OptimConfig(lr=2.0, warmup_steps=0, min_lr_ratio=0.0)
    assert lr_at(0, cfg, 100) == pytest.approx(2.0)
    assert lr_at(100, cfg, 100) == pytest.approx(0.0)
    short = OptimConfig(lr=1.0, warmup_steps=5, min_lr_ratio=0.5)  # max_steps <= warmup: no division by 0
    assert [lr_at(s, short, 3) for s in range(3)] == pytest.approx([0.2, 0.4, 0.6])


def test_a_warmup_longer_than_the_run_is_named_with_the_lr_it_reaches():
    cfg = OptimConfig(lr=2e-3, warmup_steps=50)
    note = short_warmup_note(cfg, 8)
    assert note is not None and "0.00032 at the last step" in note and "optim.lr=0.002 is never reached" in note
    assert 2e-3 * 8 / 50 == pytest.approx(3.2e-4)  # the hand value: step 7 of a linear 50-step ramp
    assert short_warmup_note(cfg, 50) is None  # reaches lr at its last step
    assert short_warmup_note(cfg, 480) is None
    assert short_warmup_note(OptimConfig(lr=1.0, warmup_steps=0), 1) is None


def _groups(**kw):
    model = ModelConfig.from_preset("tiny").build()
    groups = param_groups(model, OptimConfig(**kw))
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    no_decay = {names[id(p)] for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    norms = {f"{mn}.{pn}" for mn, m in model.named_modules() if isinstance(m, Norm)
             for pn, _ in m.named_parameters()}
    assert decay | no_decay == set(names.values()) and not decay & no_decay
    assert norms and "embed.weight" in names.values()
    return decay, no_decay, norms


@pytest.mark.parametrize("decay_norms", [True, False])
@pytest.mark.parametrize("decay_embeddings", [True, False])
def test_param_groups_follow_config(decay_norms, decay_embeddings):
    decay, no_decay, norms = _groups(decay_norms=decay_norms, decay_embeddings=decay_embeddings,
                                     weight_decay=0.1)
    assert norms <= (decay if decay_norms else no_decay)
    assert ("embed.weight" in decay) == decay_embeddings
    assert "blocks.0.attn.w_qkv.weight" in decay and "blocks.1.ffn.w_out.weight" in decay  # matrices always


def test_optimizer_hyperparameters():
    model = ModelConfig.from_preset("tiny").build()
    opt = build_optimizer(model, OptimConfig(lr=1e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05,
                                             decay_norms=False))
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert all(g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 for g in opt.param_groups)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


@pytest.mark.parametrize("grad_clip", [0.5, 0.0])
def test_trainer_reports_preclip_norm_and_clips(make_cfg, tmp_path, monkeypatch, grad_clip):
    seen = []
    original = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *a, **k):
        params = list(params)
        before = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
        out = original(params, max_norm, *a, **k)
        after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
        seen.append((before, after, max_norm))
        return out

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    train(make_cfg(tmp_path, "--max_steps=3", f"--optim.grad_clip={grad_clip}"))
    records = read_metrics(tmp_path)
    assert len(seen) == len(records) == 3
    for (before, after, max_norm), rec in zip(seen, records, strict=True):
        assert rec["grad_norm"] == pytest.approx(before, rel=1e-5)  # logged: the norm before clipping
        if grad_clip:
            assert before > grad_clip  # the test is meaningful: clipping was active
            assert after == pytest.approx(grad_clip, rel=1e-4)
        else:
            assert max_norm == math.inf and after == pytest.approx(before, rel=1e-6)


def test_default_groups_follow_the_reference_config():
    """The authors' dense config (and OLMo) keep embeddings out of weight decay; norm gains are decayed."""
    cfg = OptimConfig()
    assert cfg.decay_embeddings is False and cfg.decay_norms is True
    model = TransformerLM(ModelConfig.from_preset("tiny"))
    groups = param_groups(model, cfg)
    no_decay = {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert id(model.embed.weight) in no_decay
    assert all(id(m.weight) not in no_decay for m in model.modules() if isinstance(m, Norm))


def test_eps_zero_is_refused_because_adamw_then_divides_zero_by_zero(make_cfg, tmp_path):
    """torch accepts eps=0, and then any element whose gradient has been exactly 0 (an untied embedding row of a
    token not seen yet) gets m/(sqrt(v) + eps) = 0/0: NaN weights after the first step, which the run reported
    as a non-finite embedding with no word of eps. Now refused before the first step, naming the field; a run
    folder that records eps 0 still opens (its config is read, as eval and generate read it)."""
    from hybridnorm.errors import ConfigError

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=1e-3, eps=0.0, foreach=False)
    p.grad = torch.tensor([1.0, 0.0, -1.0])
    opt.step()
    assert torch.isnan(p[1]) and not torch.isnan(p[[0, 2]]).any()  # why: torch's own AdamW
    cfg = make_cfg(tmp_path / "run", "--optim.eps=0", "--model.tie_embeddings=false", "--max_steps=2")
    assert cfg.optim.eps == 0.0  # the config itself is readable
    with pytest.raises(ConfigError, match=r"optim\.eps=0 must be > 0 \(default 1e-8\)"):
        train(cfg, quiet=True)
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert build_optimizer(ModelConfig.from_preset("tiny").build(), OptimConfig(eps=1e-12)).defaults["eps"] == 1e-12
