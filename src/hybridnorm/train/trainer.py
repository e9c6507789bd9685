"""The training loop: one function, :func:`train`, from a :class:`TrainConfig` to a run folder.

Per optimizer step: LR from the schedule → ``grad_accum`` micro-batches (bf16 autocast if asked; DDP
syncs only on the last) → clip → non-finite guard → spike guard → AdamW → log / eval / checkpoint. With
``host_sync=log`` (the CUDA default) the guards read the step's loss and grad norm only at the next log / eval
/ checkpoint step, the non-finite guard holding the updates back on the device meanwhile (train/host_sync.py).
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

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hybridnorm.data import PreparedData, TokenBatches
from hybridnorm.data.tokenizer import stop_token_ids
from hybridnorm.diagnostics import Diagnostics, SpikeDetector, divergence_report
from hybridnorm.diagnostics.guards import has_nonfinite_weight
from hybridnorm.errors import ConfigError
from hybridnorm.nn.attention import set_attention_backend
from hybridnorm.nn.kernels.float8 import convert_to_float8, float8_unsupported
from hybridnorm.nn.model import TransformerLM
from hybridnorm.nn.regional import checkpoint_blocks, compile_blocks, compile_counts, compile_head_loss
from hybridnorm.train.batch_split import per_step_state, resolve_split
from hybridnorm.train.checkpoint import (
    TrainState,
    claim_run_dir,
    latest_checkpoint,
    load_checkpoint,
    start_checkpoint,
)
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.distributed import (
    Dist,
    agree,
    all_reduce_max,
    all_reduce_mean,
    collective_error,
    init_distributed,
    resolve_device,
)
from hybridnorm.train.flops import cpu_or_measured_peak, flops_per_token, gpu_datasheet_peak, measured_peak_flops
from hybridnorm.train.host_sync import PendingSteps, StepRecord, deferred
from hybridnorm.train.logger import MetricsLogger
from hybridnorm.train.optim import build_optimizer, describe_optimizer, lr_at, set_lr, short_warmup_note
from hybridnorm.train.parallel import data_parallel, shard_model
from hybridnorm.train.plan import activation_bytes
from hybridnorm.train.precision import choose_precision
from hybridnorm.train.preflight import check_fits
from hybridnorm.train.provenance import code_versions, hardware
from hybridnorm.train.resume_guard import check_resume, resume_events
from hybridnorm.train.run import write_run_files
from hybridnorm.train.shared_folders import (
    check_every_rank_sees_the_run_folder,
    prepare_data_on_ranks,
    resume_point,
)
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
    bigram_entropy: float | None = None


def _log_header(log: MetricsLogger, cfg: TrainConfig, model: TransformerLM, data: PreparedData, step: int,
                ckpt: Path | None, train_n: int, val_n: int, ran_on: dict[str, Any], peak: float,
                peak_source: str) -> None:
    log.message(f"model: {cfg.model.resolved_placement().name}, {model.num_params() / 1e6:.2f}M params, "
                f"vocab {cfg.model.vocab_size}; data: {cfg.data.source} ({train_n:,} train / {val_n:,} val tokens); "
                f"unigram entropy {data.stats.unigram_entropy:.3f} nats, bigram {data.stats.bigram_entropy:.3f} nats"
                + (f"; resumed from {ckpt}" if ckpt else ""))
    log.message(f"MFU against {peak / 1e12:,.3g} TFLOP/s ({peak_source})")
    # what a reader of metrics.jsonl needs to judge the run without the data: the baseline a model that
    # ignores context reaches (the unigram cross-entropy of val), a bigram's, and what was actually built
    # and trained (tokens per step over every process: cfg holds the resolved global batch here)
    log.log(step, {"placement": cfg.model.resolved_placement().name, "init": cfg.model.resolved_init(),
                   "precision": cfg.precision, "params": model.num_params(),
                   "tokens_per_step": cfg.global_batch * cfg.seq_len,
                   "unigram_entropy": data.stats.unigram_entropy, "bigram_entropy": data.stats.bigram_entropy,
                   "train_tokens_available": train_n, "val_tokens_available": val_n,
                   "data_sha256": data.data_sha256,  # the files' content: the counts cannot tell same-size edits
                   "code": code_versions(), "hardware": ran_on,
                   "matmul_peak_flops": peak, "mfu_peak_source": peak_source},
            "meta")  # MFU's denominator: a GPU's datasheet, else measured (per-machine cache: flops.py)


def _wrap_for_training(model: TransformerLM, cfg: TrainConfig, device: torch.device, d: Dist) -> torch.nn.Module:
    """The module the step calls; ``model`` itself stays the raw module (checkpoints, eval, clipping). Under
    ``--parallel=fsdp`` this shards ``model`` in place (train/parallel.py), so call it before building the
    optimizer: the optimizer must hold the sharded parameters."""
    if cfg.float8:  # before sharding: FSDP then holds the same parameters of the swapped modules
        convert_to_float8(model)
    shard_model(model, cfg, device, d)
    set_attention_backend(model, cfg.attention)  # before compiling: a compiled block calls that kernel
    checkpoint_blocks(model, cfg.activation_checkpointing)
    step_model: torch.nn.Module = compile_blocks(model) if cfg.compile else model  # in place, per block
    if cfg.compiles_head_loss(device.type):
        compile_head_loss(model)  # in place: the model's own _loss, so DDP / FSDP call it too
    return data_parallel(step_model, model, cfg, device, d)  # DDP, FSDP's no_sync adapter, or itself


def train(cfg: TrainConfig, *, resume: bool = False, quiet: bool = False) -> TrainResult:
    """Train ``cfg`` into ``cfg.out_dir``, which is checked and locked first (one trainer per folder)."""
    cfg.validate()
    device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")))
    d = init_distributed(device, cfg.dist_timeout)
    with contextlib.ExitStack() as held:
        failed = None
        try:
            if d.is_main:  # rank 0 writes the folder; the others learn whether it could claim it
                held.enter_context(claim_run_dir(cfg.out_dir))
        except ConfigError as e:
            failed = e
        try:
            agree(failed, d, f"claiming out_dir={cfg.out_dir}")
            check_every_rank_sees_the_run_folder(Path(cfg.out_dir), d, cfg.dist_timeout)
            return _train(cfg, device, d, resume=resume, quiet=quiet)
        except RuntimeError as e:  # a late or lost rank: one error naming this rank and the cause
            lost = collective_error(e, d, cfg.dist_timeout)
            if lost is None:
                raise
            raise lost from e


def _train(cfg: TrainConfig, device: torch.device, d: Dist, *, resume: bool, quiet: bool) -> TrainResult:
    if device.type == "cpu" and d.enabled:  # share the cores between the local processes
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    run_dir = Path(cfg.out_dir)
    found = resume_point(run_dir, resume, d, cfg.dist_timeout)
    ckpt = found.path

    data = prepare_data_on_ranks(cfg, d)
    stop_token_ids(cfg.data.stop_tokens, data.tokenizer, "the run's config")  # generation's: checked now, not then
    vocab = data.tokenizer.vocab_size
    if cfg.model.vocab_size != vocab:  # the model's vocab always follows the tokenizer's
        cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab))
    precision, why = choose_precision(cfg.precision, device, cfg.model.d_model)
    if cfg.float8 and (reason := float8_unsupported(precision, device)):  # before the config check of fp32
        raise ConfigError(f"float8=true: {reason} ({why})")
    cfg = replace(cfg, precision=precision)  # config.yaml records what was chosen, not "auto"
    # a resume continues the run's model with its tokenizer (checked before config.yaml is rewritten)
    changed = check_resume(run_dir, cfg, data.tokenizer, ckpt) if ckpt is not None else {}
    train_tokens, val_tokens = data.train_tokens(), data.val_tokens()

    torch.manual_seed(cfg.seed)
    shards = d.world_size if d.enabled and cfg.parallel == "fsdp" else 1
    act = activation_bytes(cfg.model, cfg.batch_size * cfg.seq_len, precision, cfg.activation_checkpointing)[0]
    check_fits(cfg.model, device, training=True, shards=shards, what=f"training this model on {device}",
               activations=(act, f"batch_size={cfg.batch_size} x seq_len={cfg.seq_len}"))
    model = TransformerLM(cfg.model).to(device)
    step_model = _wrap_for_training(model, cfg, device, d)
    pending = PendingSteps(deferred(cfg.host_sync, device, cfg.diagnostics.skip_spikes))
    optimizer = build_optimizer(model, cfg.optim, fused=True if pending.deferred else None)  # skip needs fused
    pending.attach(optimizer, device)
    state = TrainState()
    spikes = SpikeDetector(cfg.diagnostics.spike_window, cfg.diagnostics.spike_zscore)
    if ckpt is not None:
        state = load_checkpoint(ckpt, model, optimizer)
        spikes.load_state_dict(state.extra.get("spike_detector", {}))
    # the global batch is kept from the checkpoint (empty data state: an imported model's step 0); only its
    # split over this many processes may change
    state.data = per_step_state(state.data, cfg.grad_accum)
    split = resolve_split(cfg.global_batch, state.data.get("global_batch") if state.data else None,
                          d.world_size, cfg.batch_size, cfg.grad_accum)
    cfg = replace(cfg, batch_size=split.batch_size, grad_accum=split.grad_accum, global_batch=split.global_batch)
    batches = TokenBatches(train_tokens, cfg.batch_size, cfg.seq_len, seed=cfg.seed, rank=d.rank,
                           world_size=d.world_size, grad_accum=cfg.grad_accum, what=data.label("train"))
    if state.data:
        batches.load_state_dict(state.data)
    # kept in every checkpoint too: a checkpoint folder opens on its own
    run_files = write_run_files(run_dir, cfg.to_yaml(), data.tokenizer, ckpt) if d.is_main else {}
    log = MetricsLogger(run_dir, cfg.max_steps, state.step, enabled=d.is_main, echo=not quiet)
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    # a GPU's datasheet peak where known (flops.py: a timed matmul reads far under it on a GPU), else measured
    peak, peak_source = gpu_datasheet_peak(device, dtype) or cpu_or_measured_peak(device, dtype, measured_peak_flops)
    # the job's peak: one device per process, a GPU or its threads' share of a CPU (whose peak is measured
    # at this process's thread count); tokens/s counts every process's tokens
    peak_source += f", {d.world_size} processes × {peak / 1e12:,.3g}" if d.world_size > 1 else ""
    peak *= d.world_size
    _log_header(log, cfg, model, data, state.step, ckpt, len(train_tokens), len(val_tokens),
                hardware(device, d.world_size), peak, peak_source)
    float8 = "; float8 matmuls in the blocks' linears" if cfg.float8 else ""
    head = "; LM head + loss compiled" if cfg.compiles_head_loss(device.type) else ""
    log.message(f"precision: {precision} ({why}){float8}{head}; AdamW: {describe_optimizer(optimizer)}")
    log.message(split.describe(d.world_size) + (" (derived to keep the global batch)" if split.changed else ""))
    for note in filter(None, (short_warmup_note(cfg.optim, cfg.max_steps), *data.notes(cfg.data))):
        log.message(f"note: {note}")
    if split.changed:
        log.log(state.step, {"event": "batch_split_derived", "global_batch": split.global_batch,
                             "batch_size": split.batch_size, "grad_accum": split.grad_accum,
                             "world_size": d.world_size}, "event")
    for event in resume_events(changed, state.extra, data.data_sha256):  # printed too: worth a console line
        log.log(state.step, event, "event")
    for moved in found.set_aside:  # corrupt checkpoints skipped by --resume: moved, never deleted
        log.log(state.step, {"event": "corrupt_checkpoint_set_aside", "checkpoint": str(moved.checkpoint),
                             "moved_to": str(moved.moved_to), "reason": moved.reason}, "event")

    fpt = flops_per_token(model, cfg.seq_len)
    global_tokens = cfg.tokens_per_step * d.world_size
    # rank 0 only: nothing in it communicates, and the other ranks would only throw the numbers away
    diag = Diagnostics(model, cfg.diagnostics, enabled=d.is_main, forward_probes=not cfg.compile)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the divergence report's re-run
        with autocast(cfg.precision, device):
            return model(x, targets=y)

    def run_eval() -> None:
        result.val_loss, n_scored = evaluate(model, val_tokens, cfg, device, d)
        log.log(state.step, {"val_loss": result.val_loss, "val_ppl": math.exp(min(result.val_loss, 50)),
                             "val_tokens": n_scored}, "eval")

    saving: dict[str, Any] = {}  # the save in flight, alike on every rank: {"step": N, "pending": PendingSave}

    def finish_save(failed: ConfigError | None = None) -> None:
        """Publish the save in flight (one at a time). FSDP: every rank wrote its part and agrees inside;
        DDP: rank 0 alone wrote it, so the others must learn its fate."""
        if not saving:
            return
        try:
            if saving["pending"] is not None and failed is None:
                saving["pending"].wait()
        except ConfigError as e:
            failed = e
        step_saved = saving.pop("step")
        saving.clear()
        agree(failed, d, f"saving the checkpoint of step {step_saved}")

    def save() -> None:
        finish_save()
        state.data = batches.state_dict()
        state.extra["spike_detector"] = spikes.state_dict()
        state.extra["data_sha256"] = data.data_sha256  # what the next resume compares its data with
        saving.update(step=state.step, pending=None)
        try:  # with async_checkpoint the files are written while the next steps run
            saving["pending"] = start_checkpoint(run_dir / "checkpoints", model, optimizer, state, cfg.keep_last,
                                                 d, background=cfg.async_checkpoint, run_files=run_files)
        except ConfigError as e:
            return finish_save(e)
        if not cfg.async_checkpoint:
            finish_save()

    def collects(n: int) -> bool:  # a diagnostics step, decided alike on every rank (diag runs on rank 0)
        return cfg.diagnostics.enabled and (n == 1 or n % cfg.diagnostics.every == 0)

    def stop_on_nonfinite(rec: StepRecord, n: int, what: str = "loss or gradient") -> None:
        """Write divergence.json for the non-finite step ``rec`` (found while taking step ``n``); the run stops
        with the state before it, its last checkpoint intact."""
        if pending.deferred:  # every update from rec.step on was skipped on the device: redo its gradients
            optimizer.zero_grad(set_to_none=True)
            forward_backward(step_model, iter(rec.grads.micro_batches), cfg, device, d)
            clip_gradients(model, cfg.optim.grad_clip)
        earlier = diag.last
        diag.pop_metrics()  # a collected step's own statistics become diag.last; a later step's are not its past
        finish_save()  # the report names the newest published checkpoint
        report = divergence_report(
            step=rec.step, loss=rec.loss, grad_norm=rec.grad_norm, model=model,
            batches=rec.grads.micro_batches, loss_fn=loss_of, recent_losses=spikes.state_dict()["loss"],
            last_diagnostics=diag.last if rec.step == n else earlier,
            last_checkpoint=str(latest_checkpoint(run_dir / "checkpoints")))
        _report_divergence(run_dir, report, d, log, what)
        result.diverged = True
        state.tokens -= (state.step - rec.step + 1) * global_tokens  # deferred: steps past it did not count
        state.step = rec.step - 1

    def read_back(n: int) -> bool:
        """Read the pending steps' loss and grad norm (one copy) and run the guards on them in order: the
        spike detector, and the non-finite guard, which stops the run (returns True)."""
        for rec in pending.read():
            if not rec.finite:
                stop_on_nonfinite(rec, n)
                return True
            # loss and grad norm are the same on every rank (all-reduced / synced): so is the skip decision
            spike = spikes.check(rec.loss, rec.grad_norm)
            rec.skip = spike is not None and cfg.diagnostics.skip_spikes
            if spike is not None:
                log.log(rec.step, {"event": "spike", **spike.to_dict(), "skipped": rec.skip}, "event")
            result.train_loss = rec.loss
        return False

    def weights_nonfinite(rec: StepRecord, n: int) -> bool:
        """Before a save: step n's update left a weight non-finite though its loss and gradient were finite (a
        learning rate far too large). Stop as diverged, as at a non-finite loss: that state is never saved."""
        if all_reduce_max(torch.tensor(float(has_nonfinite_weight(model))), d).item() == 0:
            return False
        stop_on_nonfinite(rec, n, "weights after the update")
        return True

    result = TrainResult(run_dir, state.step, float("nan"), None, data.stats.unigram_entropy,
                         bigram_entropy=data.stats.bigram_entropy)
    t_start, tick, last_step, first_step = time.perf_counter(), time.perf_counter(), state.step, state.step
    model.train()
    with StopFlag() as stop:
        while state.step < cfg.max_steps:
            n = state.step + 1  # the step being taken, 1-based
            set_lr(optimizer, lr := lr_at(state.step, cfg.optim, cfg.max_steps))
            with diag.capture(n):  # hooks on collection steps only
                step = forward_backward(step_model, batches, cfg, device, d)
            diag.after_backward()  # per-layer gradient norms before clipping
            grad_norm = clip_gradients(model, cfg.optim.grad_clip)
            rec = pending.record(n, all_reduce_mean(step.loss, d), grad_norm, step)
            # the plain path reads every step before its update (host_sync.py); a collection step reads its
            # statistics back anyway, so it does too
            if (not pending.deferred or collects(n)) and read_back(n):
                break
            if not rec.skip:
                diag.before_update()
                optimizer.step()  # deferred: skipped on the device once a step was non-finite
                diag.after_update()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.tokens += global_tokens

            log_now = state.step % cfg.log_interval == 0 or state.step == cfg.max_steps
            eval_now = state.step % cfg.eval_interval == 0 or state.step == cfg.max_steps
            if (log_now or eval_now) and read_back(n):  # deferred: the check step; plain: nothing pending
                break
            if log_now:
                now = time.perf_counter()
                tps = global_tokens * (state.step - last_step) / max(now - tick, 1e-9)
                tick, last_step = now, state.step
                metrics = {"loss": rec.loss, "grad_norm": rec.grad_norm, "lr": lr,
                           "tokens": state.tokens, "tokens_per_s": tps, "mfu": tps * fpt / peak}
                if cfg.compile:
                    metrics.update(compile_counts())
                if device.type == "cuda":  # the allocator's own count: no device sync
                    metrics["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                if step.aux:
                    metrics.update({k: all_reduce_mean(v.detach(), d).item() for k, v in step.aux.items()})
                log.log(state.step, metrics)
            if diag_metrics := diag.pop_metrics():
                log.log(state.step, diag_metrics, "diag")
            if eval_now:
                run_eval()
            out_of_time = cfg.max_minutes > 0 and time.perf_counter() - t_start > 60 * cfg.max_minutes
            out_of_steps = cfg.stop_after_steps > 0 and state.step - first_step >= cfg.stop_after_steps
            signalled, out_of_time, out_of_steps = stop.agreed(out_of_time, out_of_steps, d)  # alike on every rank
            stop_now = signalled or out_of_time or out_of_steps
            save_now = state.step % cfg.ckpt_interval == 0 or state.step == cfg.max_steps or stop_now
            if save_now and (read_back(n) or weights_nonfinite(rec, n)):  # never a checkpoint of a non-finite state
                break
            if save_now:
                save()
            if stop_now:
                finish_save()
                result.interrupted = signalled
                if out_of_time and not eval_now:  # report the loss of the model we stop with (once: not at max_steps)
                    run_eval()
                why = " (signal)" if signalled else " (time limit)" if out_of_time else " (stop_after_steps)"
                log.message(f"stopped at step {state.step}{why}"
                            + f"; checkpoint saved in {run_dir / 'checkpoints'}")
                break
        finish_save()  # every way out of the loop publishes the save in flight first
    if result.val_loss is None and not result.diverged and state.step >= cfg.max_steps:
        # resumed a finished run: nothing to train, but report where it ended
        result.val_loss, _ = evaluate(model, val_tokens, cfg, device, d)
        log.message(f"run already complete at step {state.step}; val loss {result.val_loss:.4f}")
    result.step = state.step
    log.close()
    return result


def _report_divergence(run_dir: Path, report: dict, d: Dist, log: MetricsLogger, what: str) -> None:
    """Write ``divergence.json`` (see :func:`hybridnorm.diagnostics.divergence_report`) and say so."""
    if d.is_main:
        (run_dir / "divergence.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    log.message(f"non-finite {what} at step {report['step']} (loss {report['loss']}, grad norm "
                f"{report['grad_norm']}, first non-finite: {report['first_nonfinite']}, found by "
                f"{report['first_nonfinite_from']}); stopped "
                f"{'without stepping' if what == 'loss or gradient' else 'without saving that state'} — the last "
                "checkpoint is intact. "
                f"Report: {run_dir / 'divergence.json'}", style="red")
