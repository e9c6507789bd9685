"""``host_sync``: the deferred step (``log``, the CUDA default) against the plain one (``step``).

On CPU both run here with the same fused AdamW (the deferred guard needs its ``found_inf``), so the runs
must agree bit for bit: logged values, spike events, checkpoints, and for a run that goes non-finite
between two check steps, the same ``divergence.json``, result and last checkpoint. The CUDA tests check
that a step does not synchronise with the host (``torch.cuda.set_sync_debug_mode``); they skip without a GPU.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import poison_weight_at, read_metrics

import hybridnorm.train.step as train_step
import hybridnorm.train.trainer as trainer
from hybridnorm.errors import ConfigError
from hybridnorm.train.host_sync import PendingSteps, deferred
from hybridnorm.train.optim import build_optimizer

# checks at steps 3, 6 (log), 4, 8 (checkpoint) and 5, 10 (eval): steps 1, 2, 7, 9 are read late
CHECKS = ("--log_interval=3", "--ckpt_interval=4", "--eval_interval=5", "--keep_last=0")


@pytest.fixture
def fused(monkeypatch):
    """Fused AdamW in both twins (the plain path's foreach rounds differently)."""
    def fused_adamw(model, cfg, fused=False):
        return build_optimizer(model, cfg, fused=True)

    monkeypatch.setattr(trainer, "build_optimizer", fused_adamw)


def _records(run, kind: str) -> list[dict]:
    timing = ("time", "tokens_per_s", "mfu", "peak_mem_gib")
    return [{k: v for k, v in r.items() if k not in timing} for r in read_metrics(run, kind)]


def _same_checkpoints(a, b) -> None:
    names = sorted(p.name for p in (a / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert names == sorted(p.name for p in (b / "checkpoints").iterdir() if p.name.startswith("step_"))
    for step in names:
        for name in ("model.safetensors", "optimizer.safetensors"):
            wa, wb = load_file(a / "checkpoints" / step / name), load_file(b / "checkpoints" / step / name)
            assert all(torch.equal(wa[k], wb[k]) for k in wa), (step, name)


def _spike_at(monkeypatch, step: int, factor: float = 50.0) -> None:
    """The training loss (and its gradients) times ``factor`` at step ``step`` (grad_accum 1)."""
    original, calls = train_step.training_loss, [0]

    def training_loss(model, x, y):  # called once per micro-batch of training, never by evaluation
        loss, aux = original(model, x, y)
        calls[0] += 1
        return (loss * factor if calls[0] == step else loss), aux

    monkeypatch.setattr(train_step, "training_loss", training_loss)


def test_deferred_run_logs_and_saves_what_the_plain_run_does(make_cfg, tmp_path, monkeypatch, fused):
    common = ("--max_steps=13", *CHECKS, "--diagnostics.spike_window=10")
    runs = {}
    for mode in ("step", "log"):
        with monkeypatch.context() as m:
            _spike_at(m, 12)  # a spike at a step read late: its event still names step 12
            runs[mode] = trainer.train(make_cfg(tmp_path / mode, *common, f"--host_sync={mode}"))
    assert runs["step"].train_loss == runs["log"].train_loss and runs["step"].val_loss == runs["log"].val_loss
    for kind in ("train", "eval", "event"):
        assert _records(tmp_path / "step", kind) == _records(tmp_path / "log", kind), kind
    assert [(e["step"], e["event"]) for e in read_metrics(tmp_path / "log", "event")] == [(12, "spike")]
    _same_checkpoints(tmp_path / "step", tmp_path / "log")


@pytest.mark.parametrize("every", [0, 4, 7], ids=["found_at_log_step", "found_at_later_collection_step",
                                                  "found_at_its_own_collection_step"])
def test_deferred_divergence_stops_with_the_plain_runs_report(make_cfg, tmp_path, monkeypatch, fused, every):
    # poisoned at step 7, checks at 3, 6, 9 (log) and 5 (checkpoint); deferred, step 7 is found at step 9, or
    # with diagnostics every 4 steps at step 8, or every 7 steps at step 7 itself (a collection step reads
    # before its update)
    common = ("--max_steps=12", "--log_interval=3", "--ckpt_interval=5", "--eval_interval=1000", "--keep_last=0",
              f"--diagnostics.every={every}")
    results, reports = {}, {}
    for mode in ("step", "log"):
        with monkeypatch.context() as m:
            poison_weight_at(m, layer=1, train_forward=7)  # step 7 (grad_accum 1)
            results[mode] = trainer.train(make_cfg(tmp_path / mode, *common, f"--host_sync={mode}"))
        reports[mode] = json.loads((tmp_path / mode / "divergence.json").read_text(encoding="utf-8"))
    assert results["log"].diverged and results["log"].step == results["step"].step == 6
    assert results["log"].train_loss == results["step"].train_loss
    # the same report: step, module, and the first non-finite parameter is still the poisoned one, so no
    # update with NaN gradients reached the weights after it (they would all be NaN: embed.weight first)
    report, plain = dict(reports["log"]), dict(reports["step"])
    assert report.pop("last_checkpoint").replace("/log/", "/") == plain.pop("last_checkpoint").replace("/step/", "/")
    assert report == plain
    assert (report["step"], report["first_nonfinite"], report["first_nonfinite_param"]) == \
        (7, "blocks.1.attn.w_o", "blocks.1.attn.w_o.weight")
    assert reports["step"]["last_checkpoint"].endswith("step_000005")
    for kind in ("train", "diag"):
        assert _records(tmp_path / "step", kind) == _records(tmp_path / "log", kind), kind
    _same_checkpoints(tmp_path / "step", tmp_path / "log")


def test_host_sync_choices(make_cfg, tmp_path):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not deferred("auto", cpu, False) and deferred("auto", cuda, False)
    assert not deferred("auto", cuda, True)  # skip_spikes decides before each update: it must read every step
    assert deferred("log", cpu, False) and not deferred("step", cuda, False)
    with pytest.raises(ConfigError, match=r"host_sync='log'.*skip_spikes"):
        make_cfg(tmp_path, "--host_sync=log", "--diagnostics.skip_spikes=true")
    with pytest.raises(ValueError, match="fused AdamW"):
        PendingSteps(True).attach(torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], foreach=True), cpu)


def test_pending_steps_gate_fused_adamw_without_reading_back():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    pending = PendingSteps(True)
    pending.attach(opt, torch.device("cpu"))
    for step, loss in enumerate((1.0, math.nan, 1.0), start=1):
        p.grad = torch.full((3,), 0.5)
        pending.record(step, torch.tensor(loss), torch.tensor(0.5), None)
        before = p.detach().clone()
        opt.step()
        assert torch.equal(before, p.detach()) == (step >= 2), step  # sticky: no update from the bad step on
    assert opt.state[p]["step"].item() == 1  # the skipped steps took back their step count
    assert [(r.step, r.finite) for r in pending.read()] == [(1, True), (2, False), (3, True)]
    assert pending.pending == []


cuda = pytest.mark.cuda


@cuda
def test_a_deferred_cuda_step_does_not_synchronise(make_cfg, tmp_path):
    import hybridnorm as hn
    from hybridnorm.data import TokenBatches
    from hybridnorm.train.distributed import Dist
    from hybridnorm.train.step import clip_gradients, forward_backward

    device = torch.device("cuda")
    cfg = make_cfg(tmp_path, "--device=cuda", "--precision=bf16")
    model = hn.TransformerLM(cfg.model).to(device)
    opt = build_optimizer(model, cfg.optim, fused=True)
    pending = PendingSteps(True)
    pending.attach(opt, device)
    tokens = torch.randint(0, 256, (4096,)).numpy()
    batches = TokenBatches(tokens, cfg.batch_size, cfg.seq_len)
    for n in range(1, 5):
        if n > 1:  # the first step warms up kernels and allocators
            torch.cuda.set_sync_debug_mode("error")
        try:
            grads = forward_backward(model, batches, cfg, device, Dist())
            pending.record(n, grads.loss, clip_gradients(model, cfg.optim.grad_clip), grads)
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    records = pending.read()  # the check step: one copy
    assert [r.step for r in records] == [1, 2, 3, 4] and all(r.finite for r in records)


@cuda
def test_cuda_run_deferred_equals_plain(make_cfg, tmp_path, fused):
    common = ("--device=cuda", "--max_steps=8", *CHECKS)
    trainer.train(make_cfg(tmp_path / "step", *common, "--host_sync=step"))
    trainer.train(make_cfg(tmp_path / "log", *common))  # auto: deferred on CUDA
    a, b = _records(tmp_path / "step", "train"), _records(tmp_path / "log", "train")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for key in ("loss", "grad_norm"):  # GPU kernels need not be deterministic: equal to rounding
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-5), key
