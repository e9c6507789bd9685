"""Reading finished runs back: metrics.jsonl records grouped by kind, and a run's outcome."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunRecord:
    """What one training run left behind in its folder."""

    path: Path
    placement: str
    seed: int
    knob: Any = None
    train: list[dict[str, Any]] = field(default_factory=list)   # kind "train", in step order
    eval: list[dict[str, Any]] = field(default_factory=list)    # kind "eval"
    diag: list[dict[str, Any]] = field(default_factory=list)    # kind "diag"
    events: list[dict[str, Any]] = field(default_factory=list)  # spikes and other events
    divergence: dict[str, Any] | None = None

    @property
    def diverged(self) -> bool:
        return self.divergence is not None or any(not math.isfinite(r.get("loss", 0.0)) for r in self.train)

    @property
    def diverged_at(self) -> int | None:
        if self.divergence is not None:
            return int(self.divergence.get("step", -1))
        return next((r["step"] for r in self.train if not math.isfinite(r.get("loss", 0.0))), None)

    @property
    def final_loss(self) -> float:
        return self.train[-1]["loss"] if self.train and not self.diverged else math.nan

    @property
    def final_val_loss(self) -> float:
        return self.eval[-1]["val_loss"] if self.eval and not self.diverged else math.nan

    @property
    def last_step(self) -> int:
        return self.train[-1]["step"] if self.train else 0

    def diag_at(self, step: int) -> dict[str, Any] | None:
        """The diagnostics record collected at ``step``, or the nearest earlier one."""
        before = [r for r in self.diag if r["step"] <= step]
        return before[-1] if before else None

    def by_layer(self, record: dict[str, Any] | None, prefix: str) -> list[float]:
        """Values of ``<prefix>/blocks.<i>`` ordered by block index (empty if not collected)."""
        if record is None:
            return []
        pat = re.compile(re.escape(prefix) + r"/blocks\.(\d+)$")
        found = sorted((int(m.group(1)), v) for k, v in record.items() if (m := pat.match(k)))
        return [v for _, v in found]


def read_run(path: str | Path, placement: str, seed: int, knob: Any = None) -> RunRecord:
    path = Path(path)
    rec = RunRecord(path, placement, seed, knob)
    metrics = path / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill: the trainer purges it on resume
            {"train": rec.train, "eval": rec.eval, "diag": rec.diag}.get(r.get("kind"), rec.events).append(r)
    div = path / "divergence.json"
    if div.is_file():
        rec.divergence = json.loads(div.read_text(encoding="utf-8"))
    return rec


def mean_std(values: list[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    m = sum(finite) / len(finite)
    var = sum((v - m) ** 2 for v in finite) / (len(finite) - 1) if len(finite) > 1 else 0.0
    return m, math.sqrt(var)


def fmt_mean_std(values: list[float], digits: int = 4) -> str:
    m, s = mean_std(values)
    if not math.isfinite(m):
        return "—"
    return f"{m:.{digits}f} ± {s:.{digits}f}" if len(values) > 1 else f"{m:.{digits}f}"


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
