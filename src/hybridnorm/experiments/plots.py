"""The report figures (matplotlib, Agg backend: PNG files, no display needed)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

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
    if series:  # a grid whose runs all diverged before their first train record has no curve to label
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
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # blocks are whole numbers
        if not ax.lines:
            ax.text(0.5, 0.5, "no diagnostics recorded at this step\n(train with --diagnostics.every=N)",
                    ha="center", va="center", transform=ax.transAxes)
            continue
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path, series)


@dataclass(frozen=True)
class NotTrained:
    """A seed that did not train at a swept value: its verdict and real val loss (None: no finite loss)."""
    seed: int
    verdict: str
    val_loss: float | None


@dataclass(frozen=True)
class KnobPoint:
    """One swept value of a group: the mean val loss of its trained seeds (NaN: none trained) and the
    seeds that did not train."""
    x: float
    trained_mean: float
    not_trained: list[NotTrained] = field(default_factory=list)


_MARKERS = {"stalled": "s", "collapsed": "x", "diverged": "^"}


def knob_curve(points: dict[str, list[KnobPoint]], path: Path, knob: str, log_x: bool,
               ylabel: str = "final val loss") -> Path:
    """Final loss against the swept value per group. The line joins the means over the seeds that trained;
    each seed that did not train is drawn on its own, hollow, at its real val loss with a marker per verdict
    (never at a made-up height); a seed with no finite loss (diverged) sits in a labelled band above the
    plot, in axes coordinates, so no height is read from it."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    series: dict[str, dict] = {}
    seen_verdicts: set[str] = set()
    band = ax.get_xaxis_transform()  # x in data, y in axes fraction
    for name, pts in points.items():
        pts = sorted(pts, key=lambda p: p.x)
        series[name] = {"x": [p.x for p in pts],
                        "y": [p.trained_mean if math.isfinite(p.trained_mean) else None for p in pts],
                        "not_trained": [{"x": p.x, "seed": n.seed, "verdict": n.verdict, "val_loss": n.val_loss}
                                        for p in pts for n in p.not_trained]}
        ok = [(p.x, p.trained_mean) for p in pts if math.isfinite(p.trained_mean)]
        line, = ax.plot([x for x, _ in ok], [y for _, y in ok], marker="o", label=f"{name} (trained, mean)")
        for p in pts:
            for n in p.not_trained:
                seen_verdicts.add(n.verdict)
                marker = _MARKERS.get(n.verdict, "x")
                face = "none" if marker != "x" else line.get_color()
                if n.val_loss is not None:
                    ax.scatter([p.x], [n.val_loss], marker=marker, s=50, facecolors=face,
                               edgecolors=line.get_color())
                else:
                    ax.scatter([p.x], [1.03], marker=marker, s=50, facecolors=face, edgecolors=line.get_color(),
                               transform=band, clip_on=False)
    if any(n.val_loss is None for pts in points.values() for p in pts for n in p.not_trained):
        ax.text(0.0, 1.03, "no finite loss ▸", transform=ax.transAxes, ha="right", va="center", fontsize=7)
    for v in sorted(seen_verdicts):
        ax.scatter([], [], marker=_MARKERS.get(v, "x"), facecolors="none" if _MARKERS.get(v) != "x" else "gray",
                   edgecolors="gray", label=f"{v} seed (its real val loss)")
    ax.set(xlabel=knob, ylabel=ylabel)
    ax.set_title(f"sweep over {knob}", pad=18)
    if log_x:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path, series)
