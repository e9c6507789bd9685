"""The report figures (matplotlib, Agg backend: PNG files, no display needed)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from hybridnorm.experiments.runs import RunRecord


def _save(fig: plt.Figure, path: Path, series: dict) -> Path:
    """The PNG, and beside it ``<name>.json`` with exactly the plotted series (to re-plot or test)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    path.with_suffix(".json").write_text(json.dumps(series, indent=1), encoding="utf-8")
    return path


def _by_placement(runs: Sequence[RunRecord]) -> dict[str, list[RunRecord]]:
    groups: dict[str, list[RunRecord]] = defaultdict(list)
    for r in runs:
        groups[r.label or r.placement].append(r)
    return dict(groups)


def loss_curves(runs: Sequence[RunRecord], path: Path, title: str = "training loss") -> Path:
    """Train loss against step: the mean over seeds per placement, shaded between min and max."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, dict] = {}
    for name, group in _by_placement(runs).items():
        steps = sorted({rec["step"] for r in group for rec in r.train})
        per_step = [[rec["loss"] for r in group for rec in r.train if rec["step"] == s and math.isfinite(rec["loss"])]
                    for s in steps]
        keep = [(s, v) for s, v in zip(steps, per_step, strict=True) if v]
        if not keep:
            continue
        xs, ys = [s for s, _ in keep], [sum(v) / len(v) for _, v in keep]
        series[name] = {"x": xs, "y": ys}
        line, = ax.plot(xs, ys, label=name)
        if len(group) > 1:
            ax.fill_between(xs, [min(v) for _, v in keep], [max(v) for _, v in keep], alpha=0.2,
                            color=line.get_color())
        for r in group:
            if r.diverged and r.diverged_at is not None:
                ax.axvline(r.diverged_at, color=line.get_color(), linestyle=":", linewidth=1)
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7 if len(series) > 6 else 10)
    return _save(fig, path, series)


def by_depth(runs: Sequence[RunRecord], path: Path, prefix: str, steps: Sequence[int], ylabel: str,
             title: str, log: bool = True) -> Path:
    """One panel per requested step: ``prefix/blocks.<i>`` against block index, mean over seeds."""
    fig, axes = plt.subplots(1, len(steps), figsize=(5.5 * len(steps), 4.2), squeeze=False)
    series: dict[str, dict] = {}
    for ax, step in zip(axes[0], steps, strict=True):
        for name, group in _by_placement(runs).items():
            profiles = [r.by_layer(r.diag_at(step), prefix) for r in group]
            profiles = [p for p in profiles if p]
            if not profiles:
                continue
            depth = min(map(len, profiles))
            mean = [sum(p[i] for p in profiles) / len(profiles) for i in range(depth)]
            series[f"{name}@step{step}"] = {"x": list(range(1, depth + 1)), "y": mean}
            ax.plot(range(1, depth + 1), mean, marker="o", markersize=3, label=name)
        ax.set(xlabel="block", ylabel=ylabel, title=f"{title} — step {step}")
        if not ax.lines:
            ax.text(0.5, 0.5, "no diagnostics recorded at this step\n(train with --diagnostics.every=N)",
                    ha="center", va="center", transform=ax.transAxes)
            continue
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path, series)


def knob_curve(points: dict[str, list[tuple[float, float]]], path: Path, knob: str, log_x: bool,
               ylabel: str = "final val loss, mean over seeds (× = not trained)") -> Path:
    """Final loss against the swept value per group; points that did not train (NaN) are drawn as crosses."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, dict] = {}
    for name, pts in points.items():
        pts = sorted(pts)
        series[name] = {"x": [x for x, _ in pts], "y": [y if math.isfinite(y) else None for _, y in pts]}
        ok = [(x, y) for x, y in pts if math.isfinite(y)]
        line, = ax.plot([x for x, _ in ok], [y for _, y in ok], marker="o", label=name)
        bad = [x for x, y in pts if not math.isfinite(y)]
        if bad:
            top = max((y for _, y in ok), default=1.0)
            ax.scatter(bad, [top] * len(bad), marker="x", s=60, color=line.get_color())
    ax.set(xlabel=knob, ylabel=ylabel, title=f"sweep over {knob}")
    if log_x:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path, series)
