"""Diagnostics inside real (tiny) training runs: they do not perturb training, a NaN run stops with a useful
divergence.json and an intact checkpoint, and skip_spikes skips the same step straight or resumed."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import poison_weight_at, read_metrics, tiny_overrides

import hybridnorm.train.step as train_step
import hybridnorm.train.trainer as trainer
from hybridnorm import TransformerLM, cli
from hybridnorm.train.checkpoint import latest_checkpoint, load_checkpoint, verify_checkpoint
from hybridnorm.train.config import TrainConfig

MOE = ("--model.moe={num_experts: 4, top_k: 2}", "--model.ffn_hidden_size=32", "--model.tie_embeddings=false")


def _weights(run, step: int, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step_{step:06d}" / name)


@pytest.mark.parametrize(("precision", "extra"), [("fp32", ("--grad_accum=2",)), ("bf16", MOE)],
                         ids=["fp32-accum", "bf16-moe"])
def test_diagnostics_do_not_perturb_training(make_cfg, tmp_path, capfd, precision, extra):
    common = (f"--precision={precision}", "--max_steps=6", "--eval_interval=3", *extra)
    off = trainer.train(make_cfg(tmp_path / "off", *common))
    capfd.readouterr()
    on = trainer.train(make_cfg(tmp_path / "on", *common, "--diagnostics.every=2"))
    err = capfd.readouterr().err
    assert "[diag]" not in err and "act_rms" not in err  # diag records stay off the console

    a, b = read_metrics(tmp_path / "off"), read_metrics(tmp_path / "on")
    assert [r["step"] for r in b] == list(range(1, 7))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert on.val_loss == off.val_loss
    for name in ("model.safetensors", "optimizer.safetensors"):
        wa, wb = _weights(tmp_path / "off", 6, name), _weights(tmp_path / "on", 6, name)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), name

    diag = read_metrics(tmp_path / "on", "diag")
    assert [r["step"] for r in diag] == [1, 2, 4, 6] and read_metrics(tmp_path / "off", "diag") == []
    keys = set(diag[0])
    for i in range(2):
        for k in ("grad_norm/blocks.{i}.attn", "grad_norm/blocks.{i}.ffn", "act_rms/blocks.{i}",
                  "attn_max_logit/blocks.{i}", "attn_entropy/blocks.{i}", "update_norm/blocks.{i}",
                  "weight_norm/blocks.{i}", "cos_sim/blocks.{i}"):
            assert k.format(i=i) in keys
    assert ("expert_load_cv/blocks.1" in keys) == (extra == MOE)
    assert all(math.isfinite(v) for r in diag for k, v in r.items() if k not in ("kind",))
    tb = list((tmp_path / "on" / "tb").iterdir())
    assert tb  # TensorBoard got them too (as diag/<key>)


def test_cli_flag_turns_diagnostics_on(corpus, cache_dir, make_cfg, tmp_path):  # make_cfg: no peak timing
    run = tmp_path / "cli"
    assert cli.main(["train", *tiny_overrides(corpus, cache_dir, run), "--max_steps=3", "--diagnostics.every=2"]) == 0
    assert [r["step"] for r in read_metrics(run, "diag")] == [1, 2]
    assert TrainConfig.load(run / "config.yaml").diagnostics.every == 2


def test_nan_run_reports_step_and_module_and_keeps_checkpoint(make_cfg, tmp_path, monkeypatch):
    run = tmp_path / "run"
    common = ("--max_steps=8", "--ckpt_interval=2", "--diagnostics.every=2")
    with monkeypatch.context() as m:
        poison_weight_at(m, layer=1, train_forward=5)
        result = trainer.train(make_cfg(run, *common))
    assert result.diverged and result.step == 4

    report = json.loads((run / "divergence.json").read_text(encoding="utf-8"))
    assert report["step"] == 5 and report["completed_steps"] == 4
    assert not math.isfinite(report["loss"])
    assert (report["first_nonfinite"], report["first_nonfinite_from"]) == ("blocks.1.attn.w_o", "forward")
    assert report["first_nonfinite_param"] == "blocks.1.attn.w_o.weight"
    losses = [r["loss"] for r in read_metrics(run)]
    assert len(losses) == 4 and report["recent_losses"] == losses
    assert report["last_diagnostics"]["step"] == 4 and "grad_norm/blocks.1.attn" in report["last_diagnostics"]
    assert report["last_checkpoint"].endswith("step_000004")

    # the last good checkpoint is intact, loads, and the run resumes from it to the end
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt.name == "step_000004"
    verify_checkpoint(ckpt)
    model = TransformerLM(TrainConfig.load(run / "config.yaml").model)  # the run's resolved config
    assert load_checkpoint(ckpt, model).step == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())
    resumed = trainer.train(make_cfg(run, *common), resume=True)
    assert resumed.step == 8 and not resumed.diverged and math.isfinite(resumed.train_loss)
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 9))
    assert [r["loss"] for r in read_metrics(run)][:4] == losses


def _spike_loss_at(monkeypatch, step: int, first_step: int = 0, factor: float = 50.0) -> None:
    """Multiply the training loss (and so its gradients) by ``factor`` at optimizer step ``step`` (1-based),
    for a run whose first step is ``first_step + 1`` (grad_accum 1)."""
    original, calls = train_step.training_loss, [first_step]

    def training_loss(model, x, y):  # called once per micro-batch of training, never by evaluation
        loss, aux = original(model, x, y)
        calls[0] += 1
        return (loss * factor if calls[0] == step else loss), aux

    monkeypatch.setattr(train_step, "training_loss", training_loss)  # the loss of the training step (train/step.py)


def test_skip_spikes_skips_the_same_step_straight_and_resumed(make_cfg, tmp_path, monkeypatch):
    spike, stop = 14, 12
    common = ("--max_steps=16", "--ckpt_interval=1", "--keep_last=100", "--eval_interval=1000",
              "--diagnostics.skip_spikes=true", "--diagnostics.every=7")
    with monkeypatch.context() as m:
        _spike_loss_at(m, spike)
        straight = trainer.train(make_cfg(tmp_path / "straight", *common))
    with monkeypatch.context() as m:
        _spike_loss_at(m, spike)
        trainer.train(make_cfg(tmp_path / "resumed", *common, f"--stop_after_steps={stop}"))
    with monkeypatch.context() as m:
        _spike_loss_at(m, spike, first_step=stop)  # only 2 steps of this invocation before the spike
        resumed = trainer.train(make_cfg(tmp_path / "resumed", *common), resume=True)
    assert straight.step == resumed.step == 16

    for run in ("straight", "resumed"):
        events = read_metrics(tmp_path / run, "event")
        assert [(e["step"], e["event"], e["skipped"]) for e in events] == [(spike, "spike", True)], run
        assert events[0]["metric"] in ("loss", "grad_norm") and events[0]["zscore"] > 6
        # the step counted but did not update: weights and optimizer state unchanged across it
        for name in ("model.safetensors", "optimizer.safetensors"):
            before, after = _weights(tmp_path / run, spike - 1, name), _weights(tmp_path / run, spike, name)
            assert all(torch.equal(before[k], after[k]) for k in before), (run, name)
        assert not torch.equal(_weights(tmp_path / run, spike)["embed.weight"],
                               _weights(tmp_path / run, spike + 1)["embed.weight"])
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    for key in ("loss", "grad_norm", "lr", "tokens"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    for name in ("model.safetensors", "optimizer.safetensors"):
        wa, wb = _weights(tmp_path / "straight", 16, name), _weights(tmp_path / "resumed", 16, name)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), name
