"""The paper's Figure 2 redrawn from ``gradprofile``'s JSON: gradient norm of each block's attention and FFN
weights against the block index, one line per placement (mean over seeds, each seed as a faint dot).

    python -m hybridnorm.experiments.figure2 docs/results/figure2/step1.json

writes ``step1.png`` beside the JSON. Step 100 comes from training runs (the documented ``hybridnorm train``
command, one folder per size and placement, diagnostics every 100 steps); their diagnostics records become
profiles of the same shape, then the same plot::

    python -m hybridnorm.experiments.figure2 --from-runs RUNS_DIR --step 100 docs/results/figure2/step100.json

The balance measure the claim table uses is here too: |log10(‖∇ last block‖ / ‖∇ first block‖)| per
profile, 0 for perfectly even gradients across depth.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from hybridnorm import plain_data
from hybridnorm.config import SIZES
from hybridnorm.errors import ConfigError, one_line
from hybridnorm.experiments.runs import _metric_records
from hybridnorm.train.config import TrainConfig


def load(path: Path) -> list[dict[str, Any]]:
    return plain_data.loads(path.read_bytes())["profiles"] if path.is_file() else []


def size_of(cfg: TrainConfig) -> str:
    """The size preset whose width and depth the run's model has (``custom`` if none)."""
    m = cfg.model
    experts = m.moe.num_experts if m.moe is not None else None  # moe-1b-7b and moe-1b-2b differ only there
    return next((name for name, p in SIZES.items() if (p["d_model"], p["n_layers"], p["ffn_hidden_size"],
                                                       p.get("moe", {}).get("num_experts"))
                 == (m.d_model, m.n_layers, m.ffn_hidden_size, experts)), "custom")


def from_runs(root: Path, step: int) -> list[dict[str, Any]]:
    """One profile per run folder under ``root`` whose ``metrics.jsonl`` has a diagnostics record at
    ``step``; runs that have not reached it are left out (listed on stderr)."""
    out = []
    for run in sorted(p for p in root.iterdir() if (p / "metrics.jsonl").is_file()):
        records = _metric_records(run / "metrics.jsonl")
        diag = next((r for r in records if r.get("kind") == "diag" and r.get("step") == step), None)
        if diag is None:
            print(f"{run}: no diagnostics at step {step} yet", file=sys.stderr)
            continue
        cfg = TrainConfig.load(run / "config.yaml")
        meta = next((r for r in records if r.get("kind") == "meta"), {})
        train = next((r for r in records if r.get("kind") == "train" and r.get("step") == step), {})
        n = cfg.model.n_layers
        out.append({"size": size_of(cfg), "placement": cfg.model.placement, "init": cfg.model.init,
                    "resolved_init": meta.get("init", cfg.model.resolved_init()), "seed": cfg.seed, "step": step,
                    "loss": train.get("loss"), "tokens": cfg.tokens_per_step, "run": run.name,
                    **{part: [float(diag.get(f"grad_norm/blocks.{i}{suffix}", 0.0)) for i in range(n)]
                       for part, suffix in (("attn", ".attn"), ("ffn", ".ffn"), ("block", ""))}})
    return out


def imbalance(profile: dict[str, Any], skip: int = 0) -> float:
    """|log10(last block's gradient norm / first block's)| of one profile (whole blocks); with ``skip``,
    the first ``skip`` blocks are left out (block ``skip + 1`` is the first; it must exist)."""
    first, last = profile["block"][skip], profile["block"][-1]
    return abs(math.log10(last / first)) if first > 0 and last > 0 else math.inf


def cells(profiles: Sequence[dict[str, Any]]) -> dict[tuple[str, str, str], dict[int, dict[str, Any]]]:
    """(size, init, placement) -> seed -> profile."""
    out: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = defaultdict(dict)
    for p in profiles:
        out[(p["size"], p["init"], p["placement"])][p["seed"]] = p
    return dict(out)


def plot(profiles: Sequence[dict[str, Any]], path: Path) -> Path:
    """Rows: size × init; columns: attention, FFN. Log y, integer block ticks."""
    rows = sorted({(p["size"], p["init"]) for p in profiles})
    fig, axes = plt.subplots(max(1, len(rows)), 2, figsize=(11, 3.4 * max(1, len(rows))), squeeze=False)
    by_cell = cells(profiles)
    for (size, init), ax_row in zip(rows, axes, strict=False):
        for ax, part in zip(ax_row, ("attn", "ffn"), strict=True):
            for (s, i, placement), seeds in sorted(by_cell.items()):
                if (s, i) != (size, init):
                    continue
                n = min(len(p[part]) for p in seeds.values())
                xs = list(range(1, n + 1))
                mean = [sum(p[part][k] for p in seeds.values()) / len(seeds) for k in range(n)]
                inits = "/".join(sorted({p["resolved_init"] for p in seeds.values()}))
                line, = ax.plot(xs, mean, marker="o", markersize=3,
                                label=f"{placement} ({inits} init, {len(seeds)} seed{'s' * (len(seeds) > 1)})")
                for p in seeds.values():
                    ax.scatter(xs, p[part][:n], s=6, alpha=0.35, color=line.get_color())
            ax.set_yscale("log")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set(xlabel="block", ylabel=f"‖∇‖ of the {'attention' if part == 'attn' else 'FFN'} weights",
                   title=f"{size}, init {init}: {part}, step {profiles[0].get('step', 1)}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridnorm.experiments.figure2", description=__doc__.split("\n")[0])
    ap.add_argument("json", type=Path, nargs="?", default=Path("docs/results/figure2/step1.json"))
    ap.add_argument("--from-runs", type=Path, help="collect the profiles from the run folders under this folder")
    ap.add_argument("--step", type=int, default=100, help="with --from-runs: the diagnostics step")
    a = ap.parse_args(argv)
    try:
        if a.from_runs:
            if not a.from_runs.is_dir():
                raise ConfigError(f"--from-runs {a.from_runs}: not a folder")
            found = from_runs(a.from_runs, a.step)
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps({"profiles": found}, indent=1), encoding="utf-8")
        profiles = load(a.json)
    except (ConfigError, OSError, ValueError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    if not profiles:
        print(f"no profiles in {a.json}", file=sys.stderr)
        return 1
    print(plot(profiles, a.json.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
