#!/usr/bin/env python
"""lm-eval ``generate_until`` requests: batched (``generate_until_batch``, what ``hybridnorm eval --tasks``
runs at ``--batch-size``) against one request at a time (``generate_until``, its plain twin, what the adapter
ran before 2026-11-29), greedy, on the same model, INTERLEAVED in one run (round r runs the two in an order
rotated by r; the median of each is reported). The replies of the two are compared too (they must be equal).

The model is a trained run (``--run RUN``, e.g. ``make train``'s) or, by default, a random model of the size
options below with the byte tokenizer. The requests are ``--requests`` contexts of 20 to 200 characters cut
from a fixed text, each answered up to ``--max-gen`` tokens or to the stop string ``--until``.

    python benchmarks/generate_until.py                          # defaults: see --help
    python benchmarks/generate_until.py --run runs/kjv-hybridnorm-star --batch-size 16
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch

from hybridnorm import ModelConfig, TransformerLM
from hybridnorm.data import ByteTokenizer
from hybridnorm.eval.batched_generation import generate_until_batch
from hybridnorm.eval.scoring import generate_until

TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
        "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. ") * 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", help="a run folder (its model and tokenizer); default: a random model below")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--placement", default="hybridnorm_star")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-gen", type=int, default=64)
    p.add_argument("--until", default="\n\n", help="a stop string ('' for none)")
    p.add_argument("--reps", type=int, default=3, help="timed rounds (after one untimed)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.run:
        from hybridnorm.loading import load_run

        run = load_run(a.run)
        model, tok = run.model.eval(), run.tokenizer
    else:
        torch.manual_seed(0)
        model = TransformerLM(ModelConfig(placement=a.placement, d_model=a.d_model, n_layers=a.layers,
                                          n_heads=max(1, a.d_model // 64), vocab_size=257, max_seq_len=512)).eval()
        tok = ByteTokenizer()
    rng = random.Random(0)
    contexts = [TEXT[(s := rng.randrange(200)):s + rng.randrange(20, 200)] for _ in range(a.requests)]
    until = [a.until] if a.until else []

    def one_at_a_time() -> list[str]:
        return [generate_until(model, tok, c, until, a.max_gen) for c in contexts]

    def batched() -> list[str]:
        return [t for i in range(0, len(contexts), a.batch_size)
                for t in generate_until_batch(model, tok, contexts[i:i + a.batch_size], until, a.max_gen)]

    fns = {"one at a time": one_at_a_time, f"batched ({a.batch_size})": batched}
    times: dict[str, list[float]] = {k: [] for k in fns}
    replies = {k: fn() for k, fn in fns.items()}  # untimed round
    for r in range(a.reps):
        names = list(fns)[r % 2:] + list(fns)[:r % 2]
        for name in names:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    a_, b_ = replies.values()
    equal = sum(x == y for x, y in zip(a_, b_, strict=True))
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; {model.placement.name}, {model.num_params():,} parameters; {a.requests} requests, "
          f"max_gen {a.max_gen}, until {until!r}; replies equal: {equal}/{len(a_)}, "
          f"{sum(len(tok.encode(x)) for x in a_)} tokens generated")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"  {k:>16}: {v:7.2f} s (median of {a.reps})")
    one, many = med.values()
    print(f"  speed-up: {one / many:.2f}x")


if __name__ == "__main__":
    main()
