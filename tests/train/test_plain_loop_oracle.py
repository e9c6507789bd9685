"""The trainer against a plain PyTorch loop written from the docs: the same initial weights and windows, the
learning rate from the stated formula (linear warmup from lr/warmup, then cosine to min_lr_ratio·lr), the two
weight-decay groups by parameter name, ``torch.optim.AdamW`` (for-loop implementation), ``F.cross_entropy`` on
the logits of one big batch (no accumulation) and ``torch.nn.utils.clip_grad_norm_``. The trainer accumulates
micro-batches, picks fused AdamW and fuses the LM head with its loss, so it agrees to rounding only: AdamW's
m/√v turns a rounding difference of a near-zero gradient into an update difference of up to lr, in a handful
of elements (seen: 18 of 16k, 1.5e-5 at lr 1e-2), hence the weights' absolute tolerance."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from checkpoint_helpers import rewrite
from train_helpers import read_metrics

from hybridnorm.data import TokenBatches
from hybridnorm.nn.model import TransformerLM
from hybridnorm.nn.norms import Norm
from hybridnorm.train.checkpoint import latest_checkpoint
from hybridnorm.train.checkpoint.layout import CheckpointError
from hybridnorm.train.checkpoint.load import load_weights
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.trainer import train

STEPS = 6


def hand_lr(step: int, lr: float, warmup: int, max_steps: int, min_ratio: float) -> float:
    """The documented schedule for 0-based optimizer step ``step``."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return lr * min_ratio + lr * (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def plain_loop(cfg: TrainConfig, steps: int, change_at: int | None = None,
               changed: dict | None = None) -> tuple[TransformerLM, list[dict]]:
    """``steps`` steps of the run ``cfg`` describes, as a user would write them; at step ``change_at`` (0-based)
    the groups take the hyperparameters ``changed`` (a resume with other optimizer settings)."""
    o = cfg.optim
    torch.manual_seed(cfg.seed)
    model = TransformerLM(cfg.model)
    decay, no_decay = decay_groups(model, o.decay_norms, o.decay_embeddings)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=o.lr, betas=tuple(o.betas), eps=o.eps, foreach=False)
    # one batch of global_batch windows per step: the trainer's split into micro-batches reads the same ones
    batches = TokenBatches(cfg.data.prepare().train_tokens(), cfg.global_batch, cfg.seq_len, seed=cfg.seed)
    out = []
    for step in range(steps):
        if step == change_at:
            changed = dict(changed or {})
            if {"decay_norms", "decay_embeddings"} & set(changed):  # torch keeps a moved parameter's moments
                moved = decay_groups(model, changed.pop("decay_norms", o.decay_norms),
                                     changed.pop("decay_embeddings", o.decay_embeddings))
                for group, params in zip(opt.param_groups, moved, strict=True):
                    group["params"] = params
            for group in opt.param_groups:
                group.update({k: v for k, v in changed.items() if k != "weight_decay"})
            opt.param_groups[0]["weight_decay"] = (changed or {}).get("weight_decay", o.weight_decay)
        lr = hand_lr(step, o.lr, o.warmup_steps, cfg.max_steps, o.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = next(batches)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bf16")
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip or math.inf)
        opt.step()
        opt.zero_grad()
        out.append({"step": step + 1, "lr": lr, "loss": loss.item(), "grad_norm": norm.item()})
    return model, out


def decay_groups(model: TransformerLM, decay_norms: bool, decay_embeddings: bool) -> tuple[list, list]:
    """The decayed and the not-decayed parameters, by name, as the docs describe the two groups."""
    norm_params = {id(p) for m in model.modules() if isinstance(m, Norm) for p in m.parameters()}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if name == "embed.weight":
            (decay if decay_embeddings else no_decay).append(p)
        elif id(p) in norm_params:
            (decay if decay_norms else no_decay).append(p)
        else:
            decay.append(p)
    return decay, no_decay


def trained_weights(run: Path, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    model = TransformerLM(cfg.model)
    load_weights(latest_checkpoint(run / "checkpoints"), model)
    return model.state_dict()


def saved_config(run: Path) -> TrainConfig:
    return TrainConfig.from_dict(yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8")))


@pytest.mark.parametrize(("precision", "rel"), [
    ("fp32", 1e-5),
    # bf16 autocast keeps 8 significant bits (2^-8 ≈ 0.4 % per rounding); the loss itself is computed in fp32
    # from bf16 matmuls, and the two sides round differently (the fused head + loss kernel against bf16 logits):
    # seen 5e-4 over 10 steps on an AVX512-BF16 CPU, so 1 % is two roundings' worth of headroom, far below
    # the step-to-step change of the loss (≥ 3 % here)
    ("bf16", 1e-2),
])
def test_the_trainer_takes_the_steps_of_a_plain_pytorch_loop(make_cfg, tmp_path, precision, rel):
    """3 micro-batches of 2 windows per step against one batch of 6; clipping active (0.5 < every norm);
    warmup, the peak and the cosine's tail all inside the run; norms left out of decay, embeddings decayed."""
    run = tmp_path / "run"
    train(make_cfg(run, f"--max_steps={STEPS}", "--batch_size=2", "--grad_accum=3", "--optim.warmup_steps=2",
                   "--optim.lr=1e-2", "--optim.grad_clip=0.5", "--optim.decay_norms=false",
                   "--optim.decay_embeddings=true", "--optim.weight_decay=0.3", "--optim.min_lr_ratio=0.2",
                   f"--precision={precision}"), quiet=True)
    cfg = saved_config(run)
    assert cfg.precision == precision and cfg.global_batch == 6
    model, want = plain_loop(cfg, STEPS)
    got = read_metrics(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for g, w in zip(got, want, strict=True):
        assert g["lr"] == pytest.approx(w["lr"], rel=1e-12), g["step"]
        assert g["loss"] == pytest.approx(w["loss"], rel=rel), g["step"]
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=max(rel, 1e-5)), g["step"]
        assert w["grad_norm"] > 0.5  # clipping was active at every step
    weights = trained_weights(run, cfg)
    for name, p in model.state_dict().items():
        assert weights[name].dtype == torch.float32, name  # master weights (and the checkpoint) stay fp32
        if precision == "fp32":
            torch.testing.assert_close(weights[name], p, rtol=0, atol=1e-4, msg=name)


def test_a_resume_trains_with_the_optimizer_settings_it_was_given(make_cfg, tmp_path):
    """A resume that changes weight decay, betas and eps logs the change and rewrites config.yaml; the steps
    after it must use them. Before, the optimizer took the checkpoint's groups whole, settings included, and
    trained on with the old ones."""
    run = tmp_path / "run"
    base = (f"--max_steps={STEPS}", "--optim.warmup_steps=2", "--optim.lr=1e-2", "--optim.grad_clip=0")
    train(make_cfg(run, *base, "--stop_after_steps=3", "--optim.weight_decay=0.1"), quiet=True)
    changed = {"weight_decay": 0.9, "betas": (0.5, 0.6), "eps": 1e-3}
    train(make_cfg(run, *base, "--optim.weight_decay=0.9", "--optim.betas=[0.5,0.6]", "--optim.eps=1e-3"),
          resume=True, quiet=True)
    event = next(e for e in read_metrics(run, "event") if e["event"] == "config_changed_on_resume")
    assert set(event["fields"]) == {"optim.weight_decay", "optim.betas", "optim.eps"}
    cfg = saved_config(run)
    first = TrainConfig.from_dict({**cfg.to_dict(), "optim": {**cfg.optim.to_dict(), "weight_decay": 0.1,
                                                              "betas": [0.9, 0.95], "eps": 1e-8}})
    model, want = plain_loop(first, STEPS, change_at=3, changed=changed)
    _, unchanged = plain_loop(first, STEPS)
    got = read_metrics(run)
    assert got[-1]["loss"] == pytest.approx(want[-1]["loss"], rel=1e-5)
    assert got[-1]["loss"] != pytest.approx(unchanged[-1]["loss"], rel=1e-3)  # the settings matter here
    weights = trained_weights(run, cfg)
    for name, p in model.state_dict().items():
        torch.testing.assert_close(weights[name], p, rtol=0, atol=1e-4, msg=name)


def test_a_resume_that_moves_parameters_between_decay_groups_keeps_their_moments(make_cfg, tmp_path):
    """``--optim.decay_norms`` / ``--optim.decay_embeddings`` changed on resume move parameters from one group
    to the other; their AdamW moments go with them (paired by the weight names the checkpoint records). Before,
    the state was paired by position within each group and the resume was refused ("decay settings
    changed?"), though the README lists optimizer settings among the changes a resume allows."""
    run = tmp_path / "run"
    base = (f"--max_steps={STEPS}", "--optim.warmup_steps=2", "--optim.lr=1e-2", "--optim.grad_clip=0",
            "--optim.weight_decay=0.5")
    train(make_cfg(run, *base, "--stop_after_steps=3"), quiet=True)
    train(make_cfg(run, *base, "--optim.decay_norms=false", "--optim.decay_embeddings=true"),
          resume=True, quiet=True)
    event = next(e for e in read_metrics(run, "event") if e["event"] == "config_changed_on_resume")
    assert set(event["fields"]) == {"optim.decay_norms", "optim.decay_embeddings"}
    cfg = saved_config(run)
    first = TrainConfig.from_dict({**cfg.to_dict(), "optim": {**cfg.optim.to_dict(), "decay_norms": True,
                                                              "decay_embeddings": False}})
    model, want = plain_loop(first, STEPS, change_at=3, changed={"decay_norms": False, "decay_embeddings": True})
    got = read_metrics(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert got[-1]["loss"] == pytest.approx(want[-1]["loss"], rel=1e-5)
    weights = trained_weights(run, cfg)
    for name, p in model.state_dict().items():
        torch.testing.assert_close(weights[name], p, rtol=0, atol=1e-4, msg=name)
    # the move matters here: the embedding, decayed from step 4 on, ends elsewhere than without the change
    unchanged_model, _ = plain_loop(first, STEPS)
    assert (unchanged_model.embed.weight - model.embed.weight).abs().max() > 1e-3


def test_a_checkpoint_without_parameter_names_resumes_by_position_and_names_the_settings_it_cannot_move(
        make_cfg, tmp_path):
    """Checkpoints written before ``param_names`` was recorded pair their state by position: the same groups
    resume as an uninterrupted run does; groups of other sizes are refused naming the two options that change
    them."""
    base = (f"--max_steps={STEPS}", "--optim.warmup_steps=2", "--optim.lr=1e-2")
    whole = tmp_path / "whole"
    train(make_cfg(whole, *base), quiet=True)
    for resume_with, refused in (((), False), (("--optim.decay_embeddings=true",), True)):
        run = tmp_path / f"run{int(refused)}"
        train(make_cfg(run, *base, "--stop_after_steps=3"), quiet=True)
        ckpt = latest_checkpoint(run / "checkpoints")
        body = json.loads((ckpt / "state.json").read_text(encoding="utf-8"))
        del body["optimizer"]["param_names"]
        rewrite(ckpt, "state.json", json.dumps(body).encode())  # as an older trainer wrote it
        if refused:
            with pytest.raises(CheckpointError, match=r"optim\.decay_norms or optim\.decay_embeddings changed"):
                train(make_cfg(run, *base, *resume_with), resume=True, quiet=True)
        else:
            train(make_cfg(run, *base, *resume_with), resume=True, quiet=True)
            assert [r["loss"] for r in read_metrics(run)] == [r["loss"] for r in read_metrics(whole)]
