#!/usr/bin/env python
"""Everything GPU-shaped in one sitting: one command, one JSON and one Markdown table.

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check      # on a GPU machine, < 9 min target
    python benchmarks/gpu_check.py --device cpu --size tiny --out /tmp/gc  # the same code on the CPU (CI smoke)

Checks, in this order (a check whose turn comes after ``--budget-s`` is "not run"; ``--resume`` keeps the
checks an earlier sitting of the same commit finished and runs the rest):

==================  ==========================================================================================
environment         torch / CUDA / GPU / transformers versions and the code commit (always passes)
numerics            tiny model, 20 steps, identical weights and batches: device fp32 (TF32 off) vs CPU float64,
                    device bf16 vs device fp32, each within a bound taken from the CPU's own gap (steps file)
cuda_tests          ``pytest -m cuda`` over ``gpu_check_steps.CUDA_TEST_FILES`` (parity, float8, host sync,
                    profiler, the current device, generate on the GPU)
train_*             the README's "1 GPU" ``hybridnorm train`` (bf16, compile) for HybridNorm* and Pre-Norm,
                    ± activation checkpointing, at fewer steps and micro-batches: graphs, graph breaks and
                    recompiles from the trainer's own metrics, tokens/s, peak memory
fsdp_resume         ``torchrun`` one rank, FSDP2 (nccl on a GPU), bf16 mixed precision: sharded save, exact resume
generate_export     ``hybridnorm generate`` / ``export`` of a GPU run; the HF folder's logits and greedy
                    ``generate()`` on the device against our model on the CPU and a full forward per token
mfu                 benchmarks/gpu_mfu.py's measurement of the size's HybridNorm* and Pre-Norm, seq 4096 (GPU),
                    ± checkpointing, at the planner's largest micro-batch (stepping down on out-of-memory)
memory_vs_plan      each MFU row's ``torch.cuda.max_memory_allocated`` against ``hybridnorm plan``'s estimate
==================  ==========================================================================================

Writes ``OUT/gpu_check.json`` (every number, per-check details, the commit) and ``OUT/gpu_check.md`` after
every check, so a sitting cut short keeps what it measured; subprocess logs go to ``OUT/gpu_check.log``.
Exit 0 when every check that ran passed. Without a GPU (``--device cuda``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gpu_check_steps as steps
import gpu_mfu
import torch

from hybridnorm.train.plan import PlanOptions, plan

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Settings:
    """Sizes of the runs: the GPU sitting's, or a CPU smoke test's (``--device cpu``)."""

    size: str
    seq: int
    batch: int
    grad_accum: int
    train_steps: int
    fsdp_seq: int
    mfu_seq: int
    mfu_warmup: int
    mfu_steps: int

    @classmethod
    def for_device(cls, device: str, size: str) -> Settings:
        if device.startswith("cuda"):  # the README's micro-batch and sequence; 2 micro-batches, 3 steps
            return cls(size, 4096, 8, 2, 3, 128, 4096, 3, 10)  # fsdp: the tiny model's max_seq_len
        return cls(size, 64, 2, 2, 3, 64, 64, 1, 2)


class Context:
    def __init__(self, args: argparse.Namespace, out: Path, work: Path) -> None:
        self.args, self.device, self.out, self.work = args, args.device, out, work
        self.settings = Settings.for_device(args.device, args.size)
        self.runs: dict[tuple[str, bool], Path | None] = {}
        self.mfu_rows: list[dict[str, Any]] = []
        self.results: dict[str, dict[str, Any]] = {}  # finished checks, in CHECKS order when written
        self.commit, self.dirty, self.dirty_files = "unknown", False, []  # set by main from git
        self.deadline = time.monotonic() + args.budget_s

    def sh(self, cmd: list[str], name: str, limit: float = 240) -> tuple[int, str]:
        """Run ``cmd`` from the repository root; its output is appended to gpu_check.log. Returns (exit
        code, output); a command past its limit (or the sitting's budget) is killed and returns 124."""
        limit = max(30.0, min(limit, self.deadline - time.monotonic() + 60))
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit)
            rc, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out = 124, f"{_text(e.stdout)}{_text(e.stderr)}\n(killed after {limit:.0f} s)"
        with open(self.out / "gpu_check.log", "a", encoding="utf-8") as log:
            log.write(f"\n===== {name}: exit {rc} in {time.monotonic() - t0:.1f} s\n$ {' '.join(cmd)}\n{out[-6000:]}\n")
        return rc, out


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _free_memory() -> None:
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- speed and memory ------------------------------------------------------------------------------------------

def _plan_gib(size: str, placement: str, seq: int, batch: int, ac: bool, gpu_gib: float, loss: str) -> float:
    """``hybridnorm plan``'s bytes for one process (its DDP row: no sharding) at this micro-batch."""
    mode = plan(PlanOptions(size=size, gpus=1, gpu_mem=gpu_gib, seq_len=seq, micro_batch=batch,
                            precision="bf16", placement=placement, headroom=0.0, loss=loss)).modes[0]
    return (mode.states + (mode.act_ckpt if ac else mode.act)) / 2**30


def mfu(ctx: Context) -> steps.Result:
    """Tokens/s and MFU (trainer's FLOPs per token over the datasheet bf16 peak) of ``gpu_mfu.measure`` for
    HybridNorm* and Pre-Norm, ± activation checkpointing, at the planner's largest micro-batch."""
    s, device = ctx.settings, torch.device(ctx.device)
    peak, source = gpu_mfu.peak_flops(device, False)
    gpu_gib = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 0.0
    loss = steps.head_loss(ctx.device)  # what the trainer runs here: measured, and planned for, alike
    planning = argparse.Namespace(size=s.size, seq=s.mfu_seq, set=[], gpu_mem=None)  # this GPU's memory
    for placement in ("hybridnorm_star", "pre"):
        for ac in (False, True):
            if device.type == "cuda":
                batch = min(ctx.args.mfu_max_batch, gpu_mfu.planned_batch(planning, placement, ac, loss, device))
            else:
                batch = s.batch
            row: dict[str, Any] = {"placement": placement, "ac": ac, "seq": s.mfu_seq, "peak_flops": peak,
                                   "peak_source": source, "oom_at": []}
            while batch >= 1 and time.monotonic() < ctx.deadline:
                ns = argparse.Namespace(size=s.size, batch=batch, seq=s.mfu_seq, steps=s.mfu_steps,
                                        warmup=s.mfu_warmup, no_compile=False, loss=loss)
                try:
                    r = gpu_mfu.measure(ns, placement, ac, device)
                except torch.OutOfMemoryError:
                    r = None  # handled below: the failed attempt's tensors are freed once the except ends
                if r is None:
                    row["oom_at"].append(batch)
                    batch = batch - 1 if batch <= 4 else batch * 3 // 4
                    _free_memory()
                    continue
                row.update(r, batch=batch, mfu=r["tokens_per_s"] * r["flops_per_token"] / peak)
                if device.type == "cuda":
                    row["plan_gib"] = _plan_gib(s.size, placement, s.mfu_seq, batch, ac, gpu_gib, loss)
                break
            _free_memory()
            ctx.mfu_rows.append(row)
            write_report(ctx)  # each row on disk at once: a command killed at its limit keeps the rows so far
    done = [r for r in ctx.mfu_rows if "mfu" in r]
    if len(done) < 4:  # out of time is "not run" (--resume measures again), anything else a failure
        late = time.monotonic() >= ctx.deadline
        return ("not run" if late else steps.FAIL), f"{len(done)} of 4 configurations measured" + \
            (f" before the {ctx.args.budget_s:.0f} s budget ran out" if late else ""), {"rows": ctx.mfu_rows}
    by = {(r["placement"], r["ac"]): r for r in done}
    # HybridNorm*'s tokens/s deficit against Pre-Norm's, where both ran the same micro-batch
    star, pre = ({ac: by[p, ac] for ac in (False, True)} for p in ("hybridnorm_star", "pre"))
    overhead = {f"ac_{'on' if ac else 'off'}": 1 - star[ac]["tokens_per_s"] / pre[ac]["tokens_per_s"]
                for ac in (False, True) if star[ac]["batch"] == pre[ac]["batch"]}
    finite = all(r["finite"] for r in done)
    summary = "; ".join(f"{p} AC {'on' if a else 'off'} b{r['batch']}: {r['mfu']:.1%}" for (p, a), r in by.items())
    summary += "; HybridNorm* tokens/s vs Pre-Norm's: " + ", ".join(f"{-v:+.1%} ({k})" for k, v in overhead.items())
    # the check is that it measures and trains finitely; the 50 % MFU goal is reported, not asserted
    return (steps.PASS if finite else steps.FAIL), summary, {"rows": ctx.mfu_rows, "overhead": overhead}


def memory_vs_plan(ctx: Context) -> steps.Result:
    """The planner must not underestimate (a micro-batch it calls safe must fit) nor overestimate by more
    than 1/0.6 (else it wastes the micro-batch): 0.6 <= measured / planned <= 1.0 for every MFU row."""
    rows = [r for r in ctx.mfu_rows if "plan_gib" in r]
    if not ctx.device.startswith("cuda"):
        return steps.SKIP, "the CPU has no CUDA allocator to measure", {}
    if not rows:
        return steps.FAIL, "no MFU row to compare", {}
    ratios = {f"{r['placement']} AC {'on' if r['ac'] else 'off'} b{r['batch']}": r["peak_gib"] / r["plan_gib"]
              for r in rows}
    ok = all(0.6 <= v <= 1.0 for v in ratios.values())
    return ((steps.PASS if ok else steps.FAIL),
            "measured/planned: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()), {"ratios": ratios})


# -- the sitting ---------------------------------------------------------------------------------------------

def environment(ctx: Context) -> steps.Result:
    import transformers

    d = {"commit": ctx.commit, "dirty": ctx.dirty, "torch": torch.__version__, "cuda": torch.version.cuda,
         "transformers": transformers.__version__, "python": platform.python_version(), "device": ctx.device,
         "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
         "settings": asdict(ctx.settings)}
    where = d["gpu"] or "cpu"
    return steps.PASS, f"torch {d['torch']} (CUDA {d['cuda']}), transformers {d['transformers']}, {where}", d


CHECKS = [("environment", environment), ("numerics", steps.numerics), ("cuda_tests", steps.cuda_tests),
          *((f"train_{p}_ac_{'on' if ac else 'off'}", lambda ctx, p=p, ac=ac: steps.train_run(ctx, p, ac))
            for p in ("hybridnorm_star", "pre") for ac in (False, True)),
          ("fsdp_resume", steps.fsdp_resume), ("generate_export", steps.generate_export), ("mfu", mfu),
          ("memory_vs_plan", memory_vs_plan)]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def write_report(ctx: Context) -> None:
    order = [n for n, _ in CHECKS]
    results = dict(sorted(ctx.results.items(), key=lambda kv: order.index(kv[0])))
    doc = {"commit": ctx.commit, "dirty": ctx.dirty, "dirty_files": ctx.dirty_files[:50], "started": ctx.started,
           "device": ctx.device,
           "argv": sys.argv[1:], "checks": results, "mfu": ctx.mfu_rows}
    (ctx.out / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str), encoding="utf-8")
    env = results.get("environment", {}).get("details", {})
    lines = [f"# gpu_check: {env.get('gpu') or ctx.device}", "",
             f"commit `{ctx.commit}`{' (uncommitted changes)' if ctx.dirty else ''}; torch {env.get('torch')} "
             f"(CUDA {env.get('cuda')}), transformers {env.get('transformers')}; started {ctx.started}", "",
             "| check | status | seconds | result |", "| --- | --- | ---: | --- |"]
    lines += [f"| {n} | {r['status']} | {r['seconds']:.0f} | {r['summary']} |" for n, r in results.items()]
    if ctx.mfu_rows:
        lines += ["", "MFU = tokens/s × the trainer's FLOPs per token (6·N_matmul + 6·L·d·T, causal attention "
                  "counted once: hybridnorm.train.flops) / the peak.", "",
                  "| placement | AC | micro-batch × seq | tokens/s | TFLOP/s | MFU | step s | peak GiB | plan GiB "
                  "| OOM at | compile+warmup s |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
        for r in ctx.mfu_rows:
            if "mfu" not in r:
                lines.append(f"| {r['placement']} | {'on' if r['ac'] else 'off'} | not measured | | | | | | | "
                             f"{r['oom_at']} | |")
                continue
            lines.append(f"| {r['placement']} | {'on' if r['ac'] else 'off'} | {r['batch']} × {r['seq']} | "
                         f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] * r['flops_per_token'] / 1e12:.1f} | "
                         f"{r['mfu']:.1%} | {r['step_s']:.3f} | {r['peak_gib']:.1f} | "
                         f"{r.get('plan_gib', float('nan')):.1f} "
                         f"| {r['oom_at'] or ''} | {r['warmup_s']:.0f} |")
        lines += ["", f"Peak: {ctx.mfu_rows[0]['peak_flops'] / 1e12:.0f} TFLOP/s ({ctx.mfu_rows[0]['peak_source']})."]
    (ctx.out / "gpu_check.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="550m", help="model preset of the training runs and the MFU table")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check"))
    p.add_argument("--work", default=None, help="run folders (default: a temporary folder, removed)")
    p.add_argument("--budget-s", type=float, default=510, help="no check starts after this many seconds")
    p.add_argument("--only", default="", help="comma-separated check names (default: all)")
    p.add_argument("--resume", action="store_true", help="keep finished checks of OUT/gpu_check.json (same commit)")
    p.add_argument("--mfu-max-batch", type=int, default=32)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU here (torch {torch.__version__}); nothing checked. "
              "--device cpu --size tiny runs the same checks on the CPU as a smoke test.")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(args, out, work)
        # the sitting script names the code commit (the device copy may have no .git, or a later HEAD)
        ctx.commit = os.environ.get("HYBRIDNORM_COMMIT") or _git("rev-parse", "HEAD") or "unknown"
        # tracked files that differ from the named commit where the copy's .git has it, else from its HEAD (on
        # a warm lent machine the copy's .git kept an older HEAD: its status flagged a clean tree as changed)
        base = ctx.commit if _git("cat-file", "-t", ctx.commit) == "commit" else _git("rev-parse", "HEAD")
        ctx.dirty_files = _git("diff", "--name-only", base).splitlines() if base else []
        ctx.dirty = bool(ctx.dirty_files)
        ctx.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        results = ctx.results
        old = out / "gpu_check.json"
        if args.resume and old.exists():
            prev = json.loads(old.read_text())
            if prev.get("commit") == ctx.commit:
                results.update({n: r for n, r in prev["checks"].items()
                                if r["status"] != "not run" and n != "environment"})
                ctx.mfu_rows = prev.get("mfu", []) if "mfu" in results else []
        only = {n.strip() for n in args.only.split(",") if n.strip()}
        for name, check in CHECKS:
            if (only and name not in only and name != "environment") or (name in results and name != "environment"):
                continue
            t0 = time.monotonic()
            if t0 > ctx.deadline:
                status, summary, details = "not run", f"past the {args.budget_s:.0f} s budget", {}
            else:
                try:
                    status, summary, details = check(ctx)
                except Exception as e:  # one broken check must not cost the sitting the others
                    status, summary, details = steps.FAIL, f"{type(e).__name__}: {e}"[:500], {}
                    _free_memory()
            results[name] = {"status": status, "seconds": time.monotonic() - t0, "summary": summary,
                             "details": details}
            print(f"[{status}] {name} ({results[name]['seconds']:.0f} s): {summary}", flush=True)
            write_report(ctx)
    failed = [n for n, r in results.items() if r["status"] == steps.FAIL]
    print(f"gpu_check: {len(results) - len(failed)} of {len(results)} checks did not fail"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"; report: {out / 'gpu_check.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
