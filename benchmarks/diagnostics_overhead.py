#!/usr/bin/env python
"""Step-time overhead of the training diagnostics (``hybridnorm.diagnostics``), measured side by side.

Three identical models (same init) train on the same random batches, each through the trainer's step
sequence (forward/backward → per-layer grad norms → clip → AdamW → metrics to metrics.jsonl + TensorBoard):

    none      no Diagnostics object at all (the trainer before diagnostics existed)
    off       Diagnostics with every=0 (the default): every call is a no-op
    every10   Diagnostics with every=10, activations and attention on: one collection step per block

Load on a shared machine swings step times by several times within seconds, so the modes are
INTERLEAVED STEP BY STEP (step i of each mode back to back, the order rotating each step) and compared on
paired ratios: each step's time over the ``off`` step timed next to it. Each round is 10 steps, exactly one
of them a collection step of ``every10``; the overhead of collecting every 10 steps is

    (sum over the round of every10 step times) / (same for off) - 1        median over rounds

and, from the medians of the paired ratios, 0.9 · (non-collection ratio − 1) + 0.1 · (collection ratio − 1).
Nothing is asserted: this script only prints.

    python benchmarks/diagnostics_overhead.py                       # d 256, 6 layers, seq 256, batch 8
    python benchmarks/diagnostics_overhead.py --rounds 12 --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hybridnorm import ModelConfig, TransformerLM, lm_loss
from hybridnorm.diagnostics import Diagnostics, DiagnosticsConfig
from hybridnorm.train.logger import MetricsLogger

BLOCK = 10


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--placement", default="hybridnorm_star")
    p.add_argument("--rounds", type=int, default=8, help="timed blocks of 10 steps per mode")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", default="cpu")
    return p.parse_args()


class Runner:
    def __init__(self, mode: str, cfg: ModelConfig, args: argparse.Namespace, log_dir: Path) -> None:
        torch.manual_seed(0)
        self.mode, self.args, self.device = mode, args, torch.device(args.device)
        self.model = TransformerLM(cfg).to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        every = {"none": 0, "off": 0, "every10": 10}[mode]
        self.diag = Diagnostics(self.model, DiagnosticsConfig(every=every)) if mode != "none" else None
        self.log = MetricsLogger(log_dir / mode, 10**9, echo=False)
        self.step = 0

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.step += 1
        diag = self.diag
        amp = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.args.precision == "bf16" \
            else contextlib.nullcontext()
        with diag.capture(self.step) if diag else contextlib.nullcontext(), amp:
            lm_loss(self.model(x), y).backward()
        if diag:
            diag.after_backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        float(grad_norm)  # the trainer reads it every step (non-finite guard)
        if diag:
            diag.before_update()
        self.opt.step()
        if diag:
            diag.after_update()
        self.opt.zero_grad(set_to_none=True)
        if diag and (metrics := diag.pop_metrics()):
            self.log.log(self.step, metrics, "diag")

    def timed_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, bool]:
        """Seconds for one step and whether it was a collection step."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        collect = bool(self.diag and self.diag.should_collect(self.step + 1))
        sync()
        t0 = time.perf_counter()
        self.train_step(x, y)
        sync()
        return time.perf_counter() - t0, collect


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, ffn_hidden_size=int(8 * args.d_model / 3 // 16 * 16),
                      max_seq_len=args.seq, placement=args.placement)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(t.to(args.device) for t in torch.randint(0, args.vocab, (2, args.batch, args.seq), generator=g))
               for _ in range(BLOCK)]
    modes = ("none", "off", "every10")
    with tempfile.TemporaryDirectory() as tmp:
        runners = [Runner(m, cfg, args, Path(tmp)) for m in modes]
        for r in runners:  # warm-up: steps 1..10 (every10 collects at 1 and 10), untimed
            for x, y in batches:
                r.train_step(x, y)
        # times[mode][round][i]: seconds of step i of the round; collect[round][i]: every10 collected
        times: dict[str, list[list[float]]] = {m: [] for m in modes}
        collect: list[list[bool]] = []
        for rnd in range(args.rounds):
            for m in modes:
                times[m].append([])
            collect.append([])
            for i, (x, y) in enumerate(batches):
                k = (rnd * BLOCK + i) % 3
                for r in runners[k:] + runners[:k]:
                    t, c = r.timed_step(x, y)
                    times[r.mode][-1].append(t)
                    if r.mode == "every10":
                        collect[-1].append(c)
            sums = {m: sum(times[m][-1]) for m in modes}
            print(f"round {rnd + 1}/{args.rounds}: " + "  ".join(f"{m} {t:.2f}s" for m, t in sums.items())
                  + f"  every10/off {sums['every10'] / sums['off'] - 1:+.1%}", flush=True)
        for r in runners:
            r.log.close()
    report(args, times, collect)


def report(args: argparse.Namespace, times: dict[str, list[list[float]]], collect: list[list[bool]]) -> None:
    med = statistics.median

    def paired(mode: str, which: bool | None) -> list[float]:  # ratio of each step to its off neighbour
        return [t / o for rt, ro, rc in zip(times[mode], times["off"], collect, strict=True)
                for t, o, c in zip(rt, ro, rc, strict=True) if which is None or c == which]

    block = {m: [sum(r) for r in times[m]] for m in times}
    print(f"\nmodel d={args.d_model} layers={args.layers} seq={args.seq} batch={args.batch} {args.placement} "
          f"{args.precision} on {args.device} ({torch.get_num_threads()} threads); {args.rounds} rounds of "
          f"{BLOCK} steps, modes interleaved step by step")
    for m in times:
        steps = [t for r in times[m] for t in r]
        print(f"  {m:8s} median {med(steps) * 1e3:8.1f} ms/step   (min {min(steps) * 1e3:.1f})")
    coll = paired("every10", True)
    plain = paired("every10", False)
    print(f"  collection step / off step (paired): median {med(coll):.3f}  (n={len(coll)})")
    print(f"  every10 non-collection step / off:   median {med(plain):.3f}")
    print(f"  off / none (paired):                 median {med(paired('none', None)) ** -1:.3f}  (zero overhead: 1)")
    per_round = [e / o - 1 for e, o in zip(block["every10"], block["off"], strict=True)]
    print(f"  overhead every10 vs off, per round:  median {med(per_round):+.2%}  "
          f"(range {min(per_round):+.2%} .. {max(per_round):+.2%})")
    print(f"  overhead every10 vs off, from paired medians: {0.9 * (med(plain) - 1) + 0.1 * (med(coll) - 1):+.2%}"
          f"  (target <= +10%)")


if __name__ == "__main__":
    main()
