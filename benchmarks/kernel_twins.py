#!/usr/bin/env python
"""Time each fast kernel of ``hybridnorm.nn.kernels`` against its plain twin, forward + backward.

For every case the two are interleaved call by call (fast, plain, fast, plain, ...) after warmup, and the
median time of each and their ratio ``plain / fast`` are printed (> 1: the kernel is faster). The shapes are
those of the benchmark models and the default job: the LM loss over 1k and 4k rows of an 8192 vocabulary
(studies / d512 batches, the default job's batch), the LM head fused with the loss against ``F.linear`` +
the chunked loss (1k rows at d=64: the studies; 4k rows at d=256: the default job; 1k at d=512), and
attention at the studies' (head dim 16), the default job's (32) and d512's (64) shapes. Nothing is
asserted: correctness is pytest's business (tests/nn/test_kernels.py, tests/nn/test_loss_kernels.py).

    python benchmarks/kernel_twins.py
    python benchmarks/kernel_twins.py --reps 40 --only cross_entropy
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridnorm.nn import kernels
from hybridnorm.nn.attention import SDPA
from hybridnorm.nn.model import lm_loss

BF16, F32 = torch.bfloat16, torch.float32


def fwd_bwd(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    """A closure running fn(*inputs) forward and backward (a fixed random cotangent for tensor outputs)."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    cot = torch.randn_like(out) if out.dim() else None

    def run() -> None:
        for t in leaves:
            t.grad = None
        y = fn(*leaves)
        y.backward(cot)
    return run


def cases() -> dict[str, list[tuple[str, Callable[[], None], Callable[[], None]]]]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, list[tuple[str, Callable[[], None], Callable[[], None]]]] = {
        "cross_entropy": [], "head+loss": [], "attention": []}
    for rows, dtype in ((1024, F32), (1024, BF16), (4096, F32), (4096, BF16)):
        logits = torch.randn(1, rows, 8192, generator=g).to(dtype)
        targets = torch.randint(0, 8192, (1, rows), generator=g)
        out["cross_entropy"].append((
            f"{rows} x 8192 {str(dtype)[6:]}",
            fwd_bwd(lambda x, t=targets: lm_loss(x, t), logits),
            fwd_bwd(lambda x, t=targets: lm_loss(x, t, fast=False), logits)))
    # the LM head fused with the loss, against F.linear + the chunked loss (what the trainer ran before; the
    # rows above time that loss against the plain one): hidden (N, d), weight (8192, d) fp32, bf16 as the
    # trainer runs it (autocast over fp32 master weights)
    for rows, d, bf16 in ((1024, 64, False), (1024, 64, True), (4096, 256, False), (4096, 256, True),
                          (1024, 512, False), (1024, 512, True)):
        hidden, weight = torch.randn(rows, d, generator=g), torch.randn(8192, d, generator=g) * d**-0.5
        targets = torch.randint(0, 8192, (rows,), generator=g)

        def autocast(fn: Callable[..., torch.Tensor], on: bool = bf16) -> Callable[..., torch.Tensor]:
            def run(*a: torch.Tensor) -> torch.Tensor:
                with torch.autocast("cpu", dtype=BF16, enabled=on):
                    return fn(*a)
            return run
        out["head+loss"].append((
            f"{rows} x {d} -> 8192 {'bf16 autocast' if bf16 else 'fp32'}",
            fwd_bwd(autocast(lambda h, w, t=targets: kernels.linear_cross_entropy(h, w, t)), hidden, weight),
            fwd_bwd(autocast(lambda h, w, t=targets: lm_loss(F.linear(h, w)[None], t[None])),
                    hidden, weight)))
    fast, plain = SDPA(fast=True), SDPA(fast=False)
    for B, H, Hkv, T, D in ((8, 4, 2, 128, 16), (16, 8, 4, 256, 32), (4, 8, 4, 256, 64)):
        q = torch.randn(B, H, T, D, generator=g).to(BF16)
        k, v = (torch.randn(B, Hkv, T, D, generator=g).to(BF16) for _ in range(2))
        out["attention"].append((
            f"B{B} H{H}/{Hkv} T{T} D{D} bf16" + ("" if kernels.upcasts_attention(q) else " (same kernel)"),
            fwd_bwd(lambda q, k, v: fast(q, k, v, None, True), q, k, v),
            fwd_bwd(lambda q, k, v: plain(q, k, v, None, True), q, k, v)))
    return out


def interleaved(a: Callable[[], None], b: Callable[[], None], warmup: int, reps: int) -> tuple[float, float]:
    for _ in range(warmup):
        a(), b()
    ta, tb = [], []
    for _ in range(reps):
        for f, ts in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", choices=("cross_entropy", "head+loss", "attention"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'kernel':14s} {'case':34s} {'fast ms':>9s} {'plain ms':>9s} {'plain/fast':>10s}")
    for name, rows in cases().items():
        if args.only and name != args.only:
            continue
        for label, fast, plain in rows:
            tf, tp = interleaved(fast, plain, args.warmup, args.reps)
            print(f"{name:14s} {label:34s} {tf * 1e3:9.2f} {tp * 1e3:9.2f} {tp / tf:10.2f}")


if __name__ == "__main__":
    main()
