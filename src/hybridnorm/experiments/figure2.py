"""The paper's Figure 2 redrawn from ``gradprofile``'s JSON: gradient norm of each block's attention and FFN
weights against the block index, one line per placement (mean over seeds, each seed as a faint dot).

    python -m hybridnorm.experiments.figure2 docs/results/figure2/step1.json

writes ``step1.png`` beside the JSON. The balance measure the claim table uses is here too:
|log10(‖∇ last block‖ / ‖∇ first block‖)| per profile, 0 for perfectly even gradients across depth.
"""

from __future__ import annotations

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


def load(path: Path) -> list[dict[str, Any]]:
    return plain_data.loads(path.read_bytes())["profiles"] if path.is_file() else []


def imbalance(profile: dict[str, Any], skip: int = 0) -> float:
    """|log10(last block's gradient norm / first block's)| of one profile (whole blocks); with ``skip``,
    the first ``skip`` blocks are left out (block ``skip + 1`` is the first)."""
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
                   title=f"{size}, init {init}: {part}, step 1")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    src = Path(args[0] if args else "docs/results/figure2/step1.json")
    profiles = load(src)
    if not profiles:
        print(f"no profiles in {src}", file=sys.stderr)
        return 1
    print(plot(profiles, src.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
