"""The paper's Figure 2 at its own model sizes: per-block gradient norms (attention and FFN weights) at step 1.

For each model size preset × placement × init × seed: build the model as ``hybridnorm train --size …`` would
(vocab from the KJV tokenizer), take one batch of the training split chosen by the seed, run one
forward-backward in fp32 and record ‖∇‖ of each block's attention group, FFN group and whole block
(``hybridnorm.diagnostics.groups``). No optimizer step is taken: the step-1 gradient does not depend on
the optimizer. The step-100 profile needs training: it is the documented ``hybridnorm sweep`` invocation
in docs/results/README.md, whose diagnostics record the same groups.

Resumable: every finished profile is appended to the JSON at once and skipped when the command is run
again, so a run cut off by a deadline keeps what it measured (with the same --batch-size and --seq-len: a
file holds one measurement). Run one at a time: a 550M model with its
gradients takes ~5 GB in fp32.

    python -m hybridnorm.experiments.gradprofile --out docs/results/figure2/step1.json
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridnorm import plain_data
from hybridnorm.data.tokenizer import atomic_write
from hybridnorm.diagnostics.groups import group_params
from hybridnorm.errors import ConfigError, OneLineArgumentParser, escape_unencodable_output, one_line
from hybridnorm.experiments.grid_checks import check_placement_spellings, no_repeats
from hybridnorm.nn.model import TransformerLM
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.preflight import check_output_file

SIZES = ("550m", "543m-deep")
PLACEMENTS = ("pre", "post", "hybridnorm", "hybridnorm_star")
INITS = ("default", "megatron")  # each placement's paper default (the pairing), and one init for all


def key_of(size: str, placement: str, init: str, seed: int) -> str:
    return f"{size}|{placement}|{init}|{seed}"


def config_of(size: str, placement: str, init: str, seed: int, batch_size: int, seq_len: int,
              overrides: Sequence[str] = ()) -> TrainConfig:
    """The training config of one profile (raises ConfigError naming a bad size, placement, init, …)."""
    return TrainConfig.from_cli(None, [f"--model.placement={placement}", f"--model.init={init}", f"--seed={seed}",
                                       "--data.source=kjv-bigval", f"--seq_len={seq_len}",
                                       f"--batch_size={batch_size}", "--precision=fp32", *overrides], size=size)


def read_profiles(out: Path) -> dict[str, Any]:
    """The profiles already in ``out`` (none if it does not exist); a file that is not ours names itself."""
    if not out.is_file():
        return {"profiles": []}
    try:
        found = plain_data.loads(out.read_bytes())
    except ValueError as e:
        raise ConfigError(f"--out {out}: {plain_data.describe_error(e)}") from None
    keys = ("size", "placement", "init", "seed", "block")
    if not (isinstance(found, dict) and isinstance(found.get("profiles"), list)
            and all(isinstance(p, dict) and all(k in p for k in keys) for p in found["profiles"])):
        raise ConfigError(f"--out {out}: not a gradprofile file (an object with a 'profiles' list of records "
                          f"with {', '.join(keys)})")
    return found


def check_same_measure(out: Path, profiles: Sequence[dict[str, Any]], batch_size: int, seq_len: int) -> None:
    """The file's profiles were measured on batches of this shape: a resume with another --seq-len or
    --batch-size once skipped every cell already there without a word (the file kept the old shape, and new
    cells came out in the new one, drawn side by side in one figure)."""
    for p in profiles:
        had = (p.get("batch_size", batch_size), p.get("seq_len", seq_len))  # a record without them: not known
        if had != (batch_size, seq_len):
            raise ConfigError(f"--out {out} holds profiles measured with --batch-size {had[0]} --seq-len {had[1]} "
                              f"(given: --batch-size {batch_size} --seq-len {seq_len}); one file holds one "
                              "measurement: give its options to continue it, or another --out; nothing was measured")


def profile(size: str, placement: str, init: str, seed: int, batch_size: int, seq_len: int,
            overrides: Sequence[str] = ()) -> dict[str, Any]:
    """One forward-backward of a freshly initialised model: per-block gradient norms and the loss.
    ``overrides``: more ``--key=value`` config fields (another corpus or cache folder)."""
    cfg = config_of(size, placement, init, seed, batch_size, seq_len, overrides)
    source = cfg.data.source
    data = cfg.data.prepare()
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=data.tokenizer.vocab_size))
    tokens = torch.from_numpy(np.array(data.train_tokens(), dtype=np.int64))  # a copy: the cache is read-only
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=gen)
    x = torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1:s + 1 + seq_len] for s in starts.tolist()])
    torch.manual_seed(seed)  # the init generator, as the trainer seeds it
    model = TransformerLM(cfg.model)
    t0 = time.perf_counter()
    loss = model(x, targets=y)
    loss.backward()
    groups = group_params(model.named_parameters())
    norms = {g: math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in ps if p.grad is not None))
             for g, ps in groups.items()}
    n = cfg.model.n_layers
    return {"size": size, "placement": placement, "init": init, "resolved_init": cfg.model.resolved_init(),
            "seed": seed, "step": 1, "loss": float(loss.detach()), "tokens": batch_size * seq_len,
            "batch_size": batch_size, "seq_len": seq_len, "data": str(source), "vocab": cfg.model.vocab_size,
            "params": model.num_params(), "d_model": cfg.model.d_model, "n_layers": n,
            "attn": [norms.get(f"blocks.{i}.attn", 0.0) for i in range(n)],
            "ffn": [norms.get(f"blocks.{i}.ffn", 0.0) for i in range(n)],
            "block": [norms.get(f"blocks.{i}", 0.0) for i in range(n)],
            "seconds": time.perf_counter() - t0, "threads": torch.get_num_threads()}


def run(out: Path, sizes: Sequence[str], placements: Sequence[str], inits: Sequence[str], seeds: Sequence[int],
        batch_size: int, seq_len: int, overrides: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Every profile not yet in ``out``, seed-major (seed 0 of every cell first), each saved when done."""
    check_output_file(out, "--out", example="gradprofile.json")  # a folder: refused now, not after hours
    found = read_profiles(out)
    check_same_measure(out, found["profiles"], batch_size, seq_len)
    for size in sizes:  # every bad name is an error now, not hours into the grid
        for placement in placements:
            for init in inits:
                config_of(size, placement, init, 0, batch_size, seq_len, overrides)
    # as compare and sweep: one model under two names (pre, Pre-Pre, pre_ln) was measured once per name and
    # drawn as so many placements; a name listed twice, measured twice, counted twice in the plot's mean
    for option, values in (("--sizes", sizes), ("--placements", placements), ("--inits", inits), ("--seeds", seeds)):
        no_repeats(option, values)
    # and a file continued under another name of a placement it holds ('pre' then 'Pre-Pre'): measured again
    check_placement_spellings(placements, [p["placement"] for p in found["profiles"]], f"--out {out}")
    done = {key_of(p["size"], p["placement"], p["init"], p["seed"]) for p in found["profiles"]}
    for seed in seeds:
        for size in sizes:
            for init in inits:
                for placement in placements:
                    if key_of(size, placement, init, seed) in done:
                        continue
                    rec = profile(size, placement, init, seed, batch_size, seq_len, overrides)
                    found["profiles"].append(rec)
                    atomic_write(out, json.dumps(found, indent=1))  # never a half file; no name of the user's taken
                    print(f"[gradprofile] {size} {placement} init={init} seed={seed}: loss {rec['loss']:.3f}, "
                          f"last/first block ‖∇‖ {rec['block'][-1] / rec['block'][0]:.3g} "
                          f"({rec['seconds']:.0f} s)", flush=True)
    return found["profiles"]


def main(argv: Sequence[str] | None = None, debug: bool = False) -> int:
    ap = OneLineArgumentParser(prog="hybridnorm gradprofile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--debug", action="store_true", help="show tracebacks")  # as after every other command
    ap.add_argument("--out", required=True, help="JSON file (resumed when it exists)")  # str: "" is refused
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--inits", default=",".join(INITS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    try:
        a = ap.parse_args(argv)
        try:
            seeds = [int(s) for s in a.seeds.split(",")]
        except ValueError:
            ap.error(f"--seeds: comma-separated integers, got {a.seeds!r}")
        run(Path(a.out), a.sizes.split(","), a.placements.split(","), a.inits.split(","), seeds, a.batch_size,
            a.seq_len)
    except (ConfigError, OSError) as e:
        if debug or "--debug" in (sys.argv[1:] if argv is None else argv):
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: every finished profile is saved; run the same command again to continue",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    escape_unencodable_output()  # as `hybridnorm gradprofile` does: its progress line holds ‖∇‖
    raise SystemExit(main())
