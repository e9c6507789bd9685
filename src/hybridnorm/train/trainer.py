"""The training loop: one function, :func:`train`, from a :class:`TrainConfig` to a run folder.

Per optimizer step: LR from the schedule → ``grad_accum`` micro-batches (bf16 autocast if asked; DDP
syncs only on the last) → clip → non-finite guard → spike guard → AdamW → log / eval / checkpoint.
SIGINT and SIGTERM finish the current step, save a checkpoint and return ``interrupted``. ``resume=True``
continues from the newest good checkpoint of ``out_dir`` exactly: weights, optimizer, RNG, data
position and step, so N + N resumed steps reproduce 2N uninterrupted steps bitwise on CPU.

Run folder: ``config.yaml`` (resolved), ``metrics.jsonl``, ``tb/``, ``checkpoints/step_*``,
``tokenizer.json``; ``divergence.json`` if the guard stopped the run.

Diagnostics (``cfg.diagnostics``, :mod:`hybridnorm.diagnostics`): per-layer statistics on collection steps,
logged as ``diag`` records; a loss / grad-norm spike is logged as an ``event`` record and, with
``skip_spikes``, its update is dropped: the step still counts (step number, LR schedule, tokens and data
position advance as if it had been taken; AdamW's own step count does not), and the spike detector's window
is checkpointed, so a resumed run skips exactly the same steps.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hybridnorm.data import PreparedData, TokenBatches, prepare_data
from hybridnorm.diagnostics import Diagnostics, SpikeDetector, divergence_report
from hybridnorm.errors import ConfigError
from hybridnorm.nn.model import TransformerLM, lm_loss
from hybridnorm.train.checkpoint import (
    TrainState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.distributed import (
    Dist,
    all_reduce_max,
    all_reduce_mean,
    barrier,
    init_distributed,
    resolve_device,
)
from hybridnorm.train.flops import flops_per_token, measured_peak_flops
from hybridnorm.train.lock import claim_run_dir
from hybridnorm.train.logger import MetricsLogger
from hybridnorm.train.optim import build_optimizer, lr_at, set_lr
from hybridnorm.train.parallel import data_parallel, shard_model
from hybridnorm.train.preflight import check_fits
from hybridnorm.train.retention import ResumePoint, checkpoint_for_resume
from hybridnorm.train.step import autocast, clip_gradients, evaluate, forward_backward
from hybridnorm.train.stop import StopFlag


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    train_loss: float
    val_loss: float | None
    unigram_entropy: float | None
    interrupted: bool = False
    diverged: bool = False


def _prepare_data(cfg: TrainConfig, d: Dist) -> PreparedData:
    """Rank 0 tokenizes into the shared cache while the others wait; then every rank maps the files."""
    def prepare() -> PreparedData:
        return prepare_data(cfg.data.source, tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.vocab_size,
                            cache_dir=cfg.data.cache_dir)

    data = prepare() if d.is_main else None
    barrier(d)
    return data if data is not None else prepare()


def _log_header(log: MetricsLogger, cfg: TrainConfig, model: TransformerLM, data: PreparedData, step: int,
                ckpt: Path | None) -> None:
    train_n, val_n = len(data.train_tokens()), len(data.val_tokens())
    log.message(f"model: {cfg.model.resolved_placement().name}, {model.num_params() / 1e6:.2f}M params, "
                f"vocab {cfg.model.vocab_size}; data: {cfg.data.source} ({train_n:,} train / {val_n:,} val tokens); "
                f"unigram entropy {data.stats.unigram_entropy:.3f} nats" + (f"; resumed from {ckpt}" if ckpt else ""))
    # what a reader of metrics.jsonl needs to judge the run without the data: the baseline a model that
    # ignores context reaches (the unigram cross-entropy of val) and what was actually built
    log.log(step, {"placement": cfg.model.resolved_placement().name, "init": cfg.model.resolved_init(),
                   "params": model.num_params(), "unigram_entropy": data.stats.unigram_entropy,
                   "train_tokens_available": train_n, "val_tokens_available": val_n}, "meta")


def _wrap_for_training(model: TransformerLM, cfg: TrainConfig, device: torch.device, d: Dist) -> torch.nn.Module:
    """The module the step calls; ``model`` itself stays the raw module (checkpoints, eval, clipping). Under
    ``--parallel=fsdp`` this shards ``model`` in place (train/parallel.py), so call it before building the
    optimizer: the optimizer must hold the sharded parameters."""
    shard_model(model, cfg, device, d)
    step_model: torch.nn.Module = torch.compile(model) if cfg.compile else model
    return data_parallel(step_model, model, cfg, device, d)  # DDP, FSDP's no_sync adapter, or itself


def _check_run_dir(run_dir: Path, resume: bool, d: Dist) -> ResumePoint:
    if not resume:
        if list_checkpoints(run_dir / "checkpoints"):
            raise ConfigError(f"run folder {run_dir} already has checkpoints: pass --resume to continue it "
                              f"or choose another --out")
        return ResumePoint(None)
    found = checkpoint_for_resume(run_dir / "checkpoints", set_aside_bad=d.is_main)  # rank 0 moves corrupt ones
    barrier(d)
    return found if d.is_main else checkpoint_for_resume(run_dir / "checkpoints", set_aside_bad=False)


def train(cfg: TrainConfig, *, resume: bool = False, quiet: bool = False) -> TrainResult:
    """Train ``cfg`` into ``cfg.out_dir``, which is checked and locked first (one trainer per folder)."""
    cfg.validate()
    with claim_run_dir(cfg.out_dir, enabled=int(os.environ.get("RANK", "0")) == 0):  # rank 0 writes the folder
        return _train(cfg, resume=resume, quiet=quiet)


def _train(cfg: TrainConfig, *, resume: bool, quiet: bool) -> TrainResult:
    device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")))
    d = init_distributed(device)
    if device.type == "cpu" and d.enabled:  # share the cores between the local processes
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    run_dir = Path(cfg.out_dir)
    found = _check_run_dir(run_dir, resume, d)
    ckpt = found.path

    data = _prepare_data(cfg, d)
    vocab = data.tokenizer.vocab_size
    if cfg.model.vocab_size != vocab:  # the model's vocab always follows the tokenizer's
        cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab))
    train_tokens, val_tokens = data.train_tokens(), data.val_tokens()

    torch.manual_seed(cfg.seed)
    check_fits(cfg.model, device, training=True, what=f"training this model on {device}")
    model = TransformerLM(cfg.model).to(device)
    step_model = _wrap_for_training(model, cfg, device, d)
    optimizer = build_optimizer(model, cfg.optim)
    batches = TokenBatches(train_tokens, cfg.batch_size, cfg.seq_len, seed=cfg.seed, rank=d.rank,
                           world_size=d.world_size)
    state = TrainState()
    spikes = SpikeDetector(cfg.diagnostics.spike_window, cfg.diagnostics.spike_zscore)
    if ckpt is not None:
        state = load_checkpoint(ckpt, model, optimizer)
        if state.data:  # empty in an imported model's step-0 checkpoint: the data starts from the top
            batches.load_state_dict(state.data)
        spikes.load_state_dict(state.extra.get("spike_detector", {}))
    if d.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
        data.tokenizer.save(run_dir)
    log = MetricsLogger(run_dir, cfg.max_steps, state.step, enabled=d.is_main, echo=not quiet)
    _log_header(log, cfg, model, data, state.step, ckpt)
    for moved in found.set_aside:  # corrupt checkpoints skipped by --resume: moved, never deleted
        log.log(state.step, {"event": "corrupt_checkpoint_set_aside", "checkpoint": str(moved.checkpoint),
                             "moved_to": str(moved.moved_to), "reason": moved.reason}, "event")

    peak = measured_peak_flops(str(device), torch.bfloat16 if cfg.precision == "bf16" else torch.float32)
    peak *= d.world_size if device.type == "cuda" else 1  # CPU ranks share one machine's cores
    fpt = flops_per_token(model, cfg.seq_len)
    global_tokens = cfg.tokens_per_step * d.world_size
    # rank 0 only: nothing in it communicates, and the other ranks would only throw the numbers away
    diag = Diagnostics(model, cfg.diagnostics, enabled=d.is_main, forward_probes=not cfg.compile)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the divergence report's re-run
        with autocast(cfg.precision, device):
            return lm_loss(model(x), y)

    def run_eval() -> None:
        result.val_loss, n_scored = evaluate(model, val_tokens, cfg, device, d)
        log.log(state.step, {"val_loss": result.val_loss, "val_ppl": math.exp(min(result.val_loss, 50)),
                             "val_tokens": n_scored}, "eval")

    def save() -> None:
        state.data = batches.state_dict()
        state.extra["spike_detector"] = spikes.state_dict()
        save_checkpoint(run_dir / "checkpoints", model, optimizer, state, cfg.keep_last, d)  # FSDP: every rank writes
        barrier(d)

    result = TrainResult(run_dir, state.step, float("nan"), None, data.stats.unigram_entropy)
    t_start, tick, last_step, first_step = time.perf_counter(), time.perf_counter(), state.step, state.step
    model.train()
    with StopFlag() as stop:
        while state.step < cfg.max_steps:
            set_lr(optimizer, lr := lr_at(state.step, cfg.optim, cfg.max_steps))
            with diag.capture(state.step + 1):  # hooks on collection steps only
                step = forward_backward(step_model, batches, cfg, device, d)
            diag.after_backward()  # per-layer gradient norms before clipping
            grad_norm = clip_gradients(model, cfg.optim.grad_clip)
            loss_avg, aux = all_reduce_mean(step.loss, d), step.aux
            loss_v, grad_norm_v = loss_avg.item(), grad_norm.item()
            if not (math.isfinite(loss_v) and math.isfinite(grad_norm_v)):
                diag.pop_metrics()  # a collected step's own statistics become diag.last
                report = divergence_report(
                    step=state.step + 1, loss=loss_v, grad_norm=grad_norm_v, model=model,
                    batches=step.micro_batches, loss_fn=loss_of, recent_losses=spikes.state_dict()["loss"],
                    last_diagnostics=diag.last, last_checkpoint=str(latest_checkpoint(run_dir / "checkpoints")))
                _report_divergence(run_dir, report, d, log)
                result.diverged = True
                break
            # loss and grad norm are the same on every rank (all-reduced / synced): so is the skip decision
            spike = spikes.check(loss_v, grad_norm_v)
            skip = spike is not None and cfg.diagnostics.skip_spikes
            if spike is not None:
                log.log(state.step + 1, {"event": "spike", **spike.to_dict(), "skipped": skip}, "event")
            if not skip:
                diag.before_update()
                optimizer.step()
                diag.after_update()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.tokens += global_tokens
            result.train_loss = loss_avg.item()

            if state.step % cfg.log_interval == 0 or state.step == cfg.max_steps:
                now = time.perf_counter()
                tps = global_tokens * (state.step - last_step) / max(now - tick, 1e-9)
                tick, last_step = now, state.step
                metrics = {"loss": result.train_loss, "grad_norm": grad_norm.item(), "lr": lr,
                           "tokens": state.tokens, "tokens_per_s": tps, "mfu": tps * fpt / peak}
                if aux:
                    metrics.update({k: all_reduce_mean(v.detach(), d).item() for k, v in aux.items()})
                log.log(state.step, metrics)
            if diag_metrics := diag.pop_metrics():
                log.log(state.step, diag_metrics, "diag")
            if state.step % cfg.eval_interval == 0 or state.step == cfg.max_steps:
                run_eval()
            out_of_time = cfg.max_minutes > 0 and time.perf_counter() - t_start > 60 * cfg.max_minutes
            out_of_steps = cfg.stop_after_steps > 0 and state.step - first_step >= cfg.stop_after_steps
            stop_now = all_reduce_max(torch.tensor(float(stop.signal is not None or out_of_time or out_of_steps)),
                                      d).item() > 0
            if state.step % cfg.ckpt_interval == 0 or state.step == cfg.max_steps or stop_now:
                save()
            if stop_now:
                result.interrupted = stop.signal is not None
                if out_of_time and state.step % cfg.eval_interval:  # report the loss of the model we stop with
                    run_eval()
                why = " (signal)" if stop.signal else " (time limit)" if out_of_time else " (stop_after_steps)"
                log.message(f"stopped at step {state.step}{why}"
                            + f"; checkpoint saved in {run_dir / 'checkpoints'}")
                break
    if result.val_loss is None and not result.diverged and state.step >= cfg.max_steps:
        # resumed a finished run: nothing to train, but report where it ended
        result.val_loss, _ = evaluate(model, val_tokens, cfg, device, d)
        log.message(f"run already complete at step {state.step}; val loss {result.val_loss:.4f}")
    result.step = state.step
    log.close()
    return result


def _report_divergence(run_dir: Path, report: dict, d: Dist, log: MetricsLogger) -> None:
    """Write ``divergence.json`` (see :func:`hybridnorm.diagnostics.divergence_report`) and say so."""
    if d.is_main:
        (run_dir / "divergence.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    log.message(f"[red]non-finite loss or gradient at step {report['step']} (loss {report['loss']}, grad norm "
                f"{report['grad_norm']}, first non-finite: {report['first_nonfinite']}, found by "
                f"{report['first_nonfinite_from']}); stopped without stepping — the last checkpoint is intact. "
                f"Report: {run_dir / 'divergence.json'}")
