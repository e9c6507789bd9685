#!/usr/bin/env python
"""Tokens/s and MFU of the trainer's step on one GPU: the 550M presets, compiled, bf16, ± activation checkpointing.

For each placement (default HybridNorm* and Pre-Norm, ``ModelConfig.from_preset("550m", placement=...)``)
and each activation-checkpointing setting, the script runs the trainer's own step pieces as ``hybridnorm
train --device=cuda --compile=true --precision=bf16`` does: regional ``torch.compile`` of every block
(``nn.regional``), bf16 autocast, ``train.step.forward_backward`` (batches through pinned memory),
``clip_gradients``, and the deferred host sync of ``train.host_sync`` (fused AdamW gated by a device-side
non-finite flag; the values read back once at the end). After ``--warmup`` steps (the compile) it times
``--steps`` steps between two synchronisations and prints a table:

    tokens/s = steps · batch · seq / seconds        MFU = tokens/s · FLOPs per token / peak

with the trainer's FLOPs per token (``train.flops``: 6·N_matmul + 6·L·d·T, causal attention counted once)
and the peak the GPU's dense bf16 datasheet number (H100/H200 SXM 989 TFLOP/s, H100 PCIe 756, A100 312),
or, for an unlisted GPU or with ``--measured-peak``, a measured large bf16 matmul. Without a GPU the script
says so and exits 0 (``--device cpu --size tiny`` runs the same code on the CPU, as a smoke test).

    python benchmarks/gpu_mfu.py                              # 550m, hybridnorm_star + pre, AC off + on
    python benchmarks/gpu_mfu.py --batch 8 --ac on            # a bigger batch fits with checkpointing
    python benchmarks/gpu_mfu.py --loss compiled               # the LM head + loss compiled instead (also: plain)
    python benchmarks/gpu_mfu.py --size moe-1b-2b --batch plan   # the MoE that fits one GPU, planner's batch
    python benchmarks/gpu_mfu.py --batch 6,8,10 --loss fast,compiled --json OUT/rows.json   # a grid, rows kept
    python benchmarks/gpu_mfu.py --ac off --profile OUT/prof   # + where the time goes (step_profile.py)

``--batch`` and ``--loss`` take comma lists and every combination is measured (``--batch plan``: for each
configuration the largest micro-batch ``hybridnorm plan`` fits in this GPU's memory, or ``--gpu-mem``);
``--json`` rewrites the rows measured so far after each one, so a command killed at its time limit keeps
them. ``--profile DIR`` runs ``--profile-steps`` more steps of each configuration under torch.profiler and
writes DIR/profile.md (time per step by category: matmul, attention, norms, LM head and loss, optimizer,
compiled, copies, eager rest; the busiest kernels; the GPU's idle share) and DIR/profile.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

import hybridnorm as hn
from hybridnorm.nn.attention import ATTENTION_BACKENDS, attention_backend, set_attention_backend
from hybridnorm.nn.kernels.float8 import convert_to_float8
from hybridnorm.nn.regional import checkpoint_blocks, compile_blocks, compile_head_loss
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.distributed import Dist
from hybridnorm.train.flops import flops_per_token, gpu_datasheet_peak, measured_peak_flops
from hybridnorm.train.host_sync import PendingSteps
from hybridnorm.train.optim import OptimConfig, build_optimizer
from hybridnorm.train.plan import PlanOptions, plan
from hybridnorm.train.step import clip_gradients, forward_backward

LOSSES = ("fast", "plain", "compiled")
ON_OFF = {"off": (False,), "on": (True,), "both": (False, True)}
PLAN = "plan"  # --batch plan: the planner's largest micro-batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", default="550m", help="ModelConfig preset")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelConfig field of the preset, VALUE in YAML, e.g. --set n_layers=8 "
                        "--set 'moe={num_experts: 8, top_k: 2}'")
    p.add_argument("--placements", default="hybridnorm_star,pre")
    p.add_argument("--ac", choices=("off", "on", "both"), default="both", help="activation checkpointing")
    p.add_argument("--float8", choices=("off", "on", "both"), default="off",
                   help="the blocks' linears in float8 (TrainConfig.float8; needs an H100-class GPU to pay)")
    p.add_argument("--batch", type=_batch_list, default=[4],
                   help="sequences per step (one micro-batch); a comma list measures each, e.g. 4,6,8; 'plan': "
                        "the largest micro-batch `hybridnorm plan` fits in the GPU's memory for each configuration "
                        "(placement, checkpointing, head + loss)")
    p.add_argument("--gpu-mem", type=float, metavar="GIB",
                   help="memory --batch plan plans for (default: the GPU's own; needed without a GPU)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (the first one compiles)")
    p.add_argument("--no-compile", action="store_true", help="eager blocks (for comparison)")
    p.add_argument("--loss", type=_choice_list(LOSSES), default=["compiled"],
                   help="LM head + loss: compiled = the plain line under torch.compile (compile_head_loss: the "
                        "trainer's on a GPU under --compile=true, head_loss=auto); fast = the head fused with a "
                        "chunked cross-entropy, no logits tensor (eager, fast_kernels=true); plain = F.linear, "
                        "then F.cross_entropy on an fp32 copy (fast_kernels=false); a comma list measures each")
    p.add_argument("--attention", type=_choice_list(ATTENTION_BACKENDS), default=["auto"],
                   help="the SDPA kernel tried first (TrainConfig.attention): auto = torch's order (FlashAttention-2 "
                        "first); cudnn = cuDNN's fused attention first (Hopper); a comma list measures each")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="after timing each configuration, torch.profiler --profile-steps more steps and write "
                        "where they go (step_profile.py: by category, busiest kernels, idle share) to "
                        "DIR/profile.md and DIR/profile.json")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--json", type=Path, metavar="PATH",
                   help="write the rows measured so far to PATH after each configuration (a sitting cut short "
                        "keeps them)")
    p.add_argument("--measured-peak", action="store_true", help="MFU against a measured bf16 matmul peak")
    p.add_argument("--device", default="cuda")
    return p.parse_args(argv)


def _batch_list(text: str) -> list[int | str]:
    return [PLAN] if text.strip() == PLAN else list(_int_list(text))


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more positive integers")
    return values


def _choice_list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: each must be one of {', '.join(choices)}")
        return values
    return parse


def model_overrides(pairs: list[str]) -> dict[str, object]:
    """``["n_layers=8", "moe={num_experts: 16}"]`` -> {"n_layers": 8, "moe": {...}}: YAML values (safe_load:
    data only), checked by ModelConfig like any config."""
    out: dict[str, object] = {}
    for pair in pairs:
        field, sep, value = pair.partition("=")
        if not sep or not field.strip():
            raise SystemExit(f"gpu_mfu: --set {pair!r} is not FIELD=VALUE")
        out[field.strip()] = yaml.safe_load(value)
    return out


def planned_batch(args: argparse.Namespace, placement: str, ac: bool, loss: str, device: torch.device) -> int:
    """``hybridnorm plan``'s largest micro-batch for one process (its DDP row) at this configuration: the GPU's
    memory (or ``--gpu-mem``) less the planner's 10 % headroom; 0 where nothing fits in this mode."""
    if args.set:  # the planner builds the preset: it would plan a different model
        raise SystemExit("gpu_mfu: --batch plan plans the preset as it is; with --set give --batch numbers")
    gib = args.gpu_mem
    if gib is None:
        if device.type != "cuda":
            raise SystemExit("gpu_mfu: --batch plan needs --gpu-mem GIB on a machine without a GPU")
        gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    try:
        mode = plan(PlanOptions(size=args.size, gpus=1, gpu_mem=gib, seq_len=args.seq, precision="bf16",
                                placement=placement, loss=loss)).modes[0]
    except hn.ConfigError as e:  # nothing fits in any mode
        print(f"gpu_mfu: {e}")
        return 0
    return mode.max_micro_batch_ckpt if ac else mode.max_micro_batch


def peak_flops(device: torch.device, measured: bool) -> tuple[float, str]:
    """The bf16 peak to compute MFU against, and where it comes from."""
    known = None if measured else gpu_datasheet_peak(device, torch.bfloat16)  # the trainer's table (flops.py)
    if known:
        return known
    return measured_peak_flops(str(device), torch.bfloat16, 8192 if device.type == "cuda" else 1024), \
        "measured bf16 matmul"


def random_batches(vocab: int, batch: int, seq: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random (inputs, targets) on the CPU, as the trainer's TokenBatches yields them."""
    g = torch.Generator().manual_seed(0)
    while True:
        rows = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def measure(args: argparse.Namespace, placement: str, ac: bool, device: torch.device,
            profile: int = 0) -> dict[str, Any]:
    """Tokens/s and peak memory of the trainer's step for one configuration (``args.batch``: one int,
    ``args.loss``: one name); with ``profile`` > 0, that many more steps under torch.profiler as "profile"."""
    loss = getattr(args, "loss", "compiled")
    mcfg = hn.ModelConfig.from_preset(args.size, **model_overrides(getattr(args, "set", [])), placement=placement,
                                      fast_kernels=loss != "plain")
    float8 = getattr(args, "float8", False) is True  # one configuration's value (main passes a bool)
    cfg = TrainConfig(model=mcfg, batch_size=args.batch, seq_len=args.seq, precision="bf16",
                      optim=OptimConfig(lr=1e-4, warmup_steps=0), device=str(device), compile=not args.no_compile,
                      activation_checkpointing=ac, host_sync="log", float8=float8,
                      attention=getattr(args, "attention", "auto"))  # one configuration's value
    torch.manual_seed(0)
    model = hn.TransformerLM(mcfg).to(device)
    if float8:  # as the trainer does: before checkpointing and compiling
        convert_to_float8(model)
    set_attention_backend(model, cfg.attention)  # as the trainer does: before compiling
    checkpoint_blocks(model, ac)
    if cfg.compile:
        compile_blocks(model)
    if loss == "compiled":  # the head's matmul and the loss in one compiled region, as the trainer does
        compile_head_loss(model)
    optimizer = build_optimizer(model, cfg.optim, fused=True)
    pending = PendingSteps(True)
    pending.attach(optimizer, device)
    batches = random_batches(mcfg.vocab_size, args.batch, args.seq)
    model.train()

    def step(n: int) -> None:
        grads = forward_backward(model, batches, cfg, device, Dist())
        pending.record(n, grads.loss, clip_gradients(model, cfg.optim.grad_clip), grads)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for n in range(args.warmup):
        step(n)
    sync()
    warmup_s = time.perf_counter() - t0
    pending.read()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for n in range(args.steps):
        step(args.warmup + n)
    sync()
    seconds = time.perf_counter() - t0
    finite = all(r.finite for r in pending.read())  # the check step: one read for all timed steps
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    prof: Any = None
    if profile > 0:  # after the timing and its read-back, so neither disturbs the other
        from step_profile import profile_steps  # beside this script

        try:
            # the JSON keeps the 100 busiest kernels (the table shows 15): enough to re-read a profile offline
            prof = profile_steps(step, profile, device, first=args.warmup + args.steps, top=100)
        except Exception as e:  # a profiler that cannot start here (no CUPTI, say), or a torch whose profiler
            # results lack what step_profile reads, costs the profile only, not the row measured before it
            prof = f"profiler failed: {type(e).__name__}: {e}"
        finite = finite and all(r.finite for r in pending.read())
    return {"profile": prof, "tokens_per_s": args.steps * args.batch * args.seq / seconds,
            "step_s": seconds / args.steps, "flops_per_token": flops_per_token(model, args.seq),
            "warmup_s": warmup_s, "finite": finite, "peak_gib": peak_gib, "params": model.num_params()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_mfu: no CUDA GPU is available here (torch "
              f"{torch.__version__}{', built without CUDA' if torch.version.cuda is None else ''}); nothing "
              "measured. Run it on a GPU machine; --device cpu --size tiny runs the same code as a smoke test.")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 leftovers outside autocast (the loss) on tensor cores
    peak, source = peak_flops(device, args.measured_peak)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {where}; peak {peak / 1e12:.1f} TFLOP/s ({source}); {args.size}, "
          f"seq {args.seq}, bf16 autocast, {'eager' if args.no_compile else 'compiled blocks'}")
    print(f"{'placement':<17}{'AC':>4}{'fp8':>4}{'batch':>6}{'loss':>9}{'attention':>10}{'params':>9}{'step s':>9}"
          f"{'tokens/s':>11}{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>10}{'warmup s':>10}")
    rows: list[dict[str, Any]] = []
    profiles: list[str] = []
    for placement in (p.strip() for p in args.placements.split(",") if p.strip()):
        for ac in ON_OFF[args.ac]:
            for f8, loss, batch, attn in itertools.product(ON_OFF[args.float8], args.loss, args.batch,
                                                           args.attention):
                if batch == PLAN:
                    batch = planned_batch(args, placement, ac, loss, device)
                    if batch < 1:
                        print(f"{placement:<17}{'on' if ac else 'off':>4}  the plan fits no sequence; skipped")
                        continue
                config = argparse.Namespace(**{**vars(args), "batch": batch, "loss": loss, "float8": f8,
                                               "attention": attn})
                label = f"{placement:<17}{'on' if ac else 'off':>4}{'on' if f8 else 'off':>4}{batch:>6}{loss:>9}" \
                        f"{attn:>10}"
                row: dict[str, Any] = {"placement": placement, "ac": ac, "float8": f8, "batch": batch, "loss": loss,
                                       "attention": attn, "sdpa_kernel": sdpa_kernel_chosen(args, placement, attn,
                                                                                            device),
                                       "seq": args.seq, "size": args.size, "set": args.set, "peak_flops": peak,
                                       "peak_source": source, "device": where, "torch": torch.__version__,
                                       "commit": os.environ.get("HYBRIDNORM_COMMIT") or _git_head()}
                try:
                    r = measure(config, placement, ac, device, args.profile_steps if args.profile else 0)
                except torch.OutOfMemoryError:
                    print(f"{label}  out of memory")
                    r = None
                    row["oom"] = True
                if r is not None:
                    achieved = r["tokens_per_s"] * r["flops_per_token"]
                    prof = r.pop("profile")
                    row.update(r, tflops=achieved / 1e12, mfu=achieved / peak)
                    print(f"{label}{r['params'] / 1e6:>8.0f}M{r['step_s']:>9.3f}{r['tokens_per_s']:>11,.0f}"
                          f"{achieved / 1e12:>9.1f}{achieved / peak:>7.1%}{r['peak_gib']:>10.1f}"
                          f"{r['warmup_s']:>10.1f}" + ("" if r["finite"] else "  (non-finite loss!)"))
                    if isinstance(prof, str):
                        row["profile"] = prof
                        print(f"{label}  {prof}")
                    elif prof is not None:
                        row["profile"] = prof.as_dict()
                        profiles.append(profile_markdown(prof, args, row))
                rows.append(row)
                write_outputs(args, rows, profiles)
                torch._dynamo.reset()  # the next model's blocks compile afresh; free this one's memory
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print("MFU: model FLOPs (6·N_matmul + 6·L·d·T per token) per second over the peak; goal >= 50% on one H100.")
    return 0


def sdpa_kernel_chosen(args: argparse.Namespace, placement: str, attention: str, device: torch.device) -> str:
    """The kernel ``F.scaled_dot_product_attention`` picks under ``attention`` for this model's training call
    (bf16, causal, its heads and head size, GQA where it has it): a preference a kernel cannot serve falls
    through to the next, so the row says which one ran."""
    from torch.nn.attention import SDPBackend

    mcfg = hn.ModelConfig.from_preset(args.size, **model_overrides(getattr(args, "set", [])), placement=placement)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.zeros(1, mcfg.n_heads, min(args.seq, 256), mcfg.head_dim, dtype=dtype, device=device)  # (B, H, T, D)
    kv = q[:, :mcfg.kv_heads]  # (B, Hkv, T, D)
    try:  # a private torch function: if this torch's differs, the row loses this field, not its measurement
        with attention_backend(attention):
            chosen = torch._fused_sdp_choice(q, kv, kv, None, 0.0, True, enable_gqa=mcfg.kv_heads != mcfg.n_heads)
    except (RuntimeError, TypeError) as e:
        return f"unknown ({type(e).__name__}: {e})"[:200]
    return next((b.name for b in SDPBackend.__members__.values() if int(b) == chosen), str(chosen)).lower()


def profile_markdown(prof: Any, args: argparse.Namespace, row: dict[str, Any]) -> str:
    from step_profile import to_markdown  # beside this script

    on = {True: "on", False: "off"}
    return to_markdown(prof, f"{args.size} {row['placement']}, AC {on[row['ac']]}, float8 {on[row['float8']]}, "
                             f"batch {row['batch']} x {args.seq}, {row['loss']} head + loss: "
                             f"{row['tokens_per_s']:,.0f} tokens/s unprofiled")


def _git_head() -> str | None:
    """The checkout's commit, for the rows (None outside a git checkout)."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def write_outputs(args: argparse.Namespace, rows: list[dict[str, Any]], profiles: list[str]) -> None:
    """The rows so far as JSON (``--json``) and the profiles so far (``--profile``), rewritten whole."""
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    if args.profile is not None and profiles:
        args.profile.mkdir(parents=True, exist_ok=True)
        (args.profile / "profile.md").write_text("\n".join(profiles))
        (args.profile / "profile.json").write_text(
            json.dumps([r for r in rows if "profile" in r], indent=1, default=str) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
