#!/usr/bin/env python
"""Training-step time with regional ``torch.compile`` (``--compile=true``) against eager mode.

Two models with the same weights: ``eager`` (the fast hand-written kernels, the default) and ``compiled``
(``hybridnorm.nn.regional.compile_blocks``: every block compiled in place, which runs the plain math that
inductor fuses). A step is forward → ``lm_loss`` → backward → AdamW → zero_grad, as in ``train_step.py``,
whose interleaving and ratio helpers this script reuses: after warmup, round r times each model once, the
order alternating, and the medians and the median of per-round ratios are printed. The first compiled step
(the compile itself) is timed apart, and dynamo's counters give the graphs made and the graph breaks.
Nothing is asserted: this script only prints.

    python benchmarks/compile_step.py                          # small preset, HybridNorm*, bf16, batch 16x256
    python benchmarks/compile_step.py --dtype fp32 --reps 20
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch._dynamo.utils import counters
from train_step import make_step, paired_ratio, retain_malloc, time_alternating

import hybridnorm as hn
from hybridnorm.nn.regional import compile_blocks


def model_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of the step benchmarks that pick the model and the batch (``doc``: the module docstring)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", default="small", help="ModelConfig preset")
    p.add_argument("--placement", default="hybridnorm_star")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = model_parser(__doc__)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16", help="bf16 = autocast")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--reps", type=int, default=10, help="timed steps per model (after warmup)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model after the compiling one")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def shifted_loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The LM loss of the logits of every position but the last (``targets`` = ``ids[:, 1:]``)."""
    return hn.lm_loss(model(ids)[:, :-1], targets)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    malloc = retain_malloc()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = hn.ModelConfig.from_preset(args.size, placement=args.placement)
    torch.manual_seed(args.seed)
    eager = hn.TransformerLM(cfg).to(device)
    compiled = hn.TransformerLM(cfg).to(device)
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled, backend=args.backend)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    steps = {name: make_step(m, shifted_loss, torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True), ids,
                             ids[:, 1:], args.dtype)
             for name, m in (("eager", eager), ("compiled", compiled))}

    print(f"torch {torch.__version__}, {args.threads} threads, {device} | {args.size} {args.placement}: "
          f"{eager.num_params() / 1e6:.1f}M params, batch {args.batch} x seq {args.seq}, {args.dtype} | "
          f"backend {args.backend} | malloc {malloc}")
    counters.clear()
    compile_s = steps["compiled"]()[0]
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    print(f"first compiled step (compiles): {compile_s:.1f} s; graphs {graphs}, graph breaks {breaks}")
    wall, cpu = time_alternating(steps, args.warmup, args.reps)
    recompiled = counters["stats"]["unique_graphs"] - graphs
    med = {name: statistics.median(t) for name, t in wall.items()}
    for name, t in wall.items():
        print(f"  {name:>9}: median {med[name]:.4f} s  min {min(t):.4f}  max {max(t):.4f}  "
              f"cpu median {statistics.median(cpu[name]):.4f} | {' '.join(f'{x:.3f}' for x in t)}")
    print(f"compiled/eager = {med['compiled'] / med['eager']:.3f}  (median of per-round ratios: wall "
          f"{paired_ratio(wall['compiled'], wall['eager']):.3f}, cpu {paired_ratio(cpu['compiled'], cpu['eager']):.3f})"
          f"; graphs made after the first step: {recompiled}")


if __name__ == "__main__":
    main()
