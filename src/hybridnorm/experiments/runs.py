"""Reading runs back: metrics.jsonl records grouped by kind, the grid point that made the run, its verdict
and its one machine-readable record.

A grid run folder holds ``point.json`` (the grid point and the full train config it was trained with),
``done.json`` once training has ended (finished or stopped by the non-finite guard), and everything the
trainer writes (``metrics.jsonl`` with its ``meta``/``train``/``eval``/``diag``/``event`` records,
``divergence.json``, checkpoints).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridnorm.experiments.verdict import Verdict, collapse_signals, judge


@dataclass
class RunRecord:
    """What one training run left behind in its folder."""

    path: Path
    placement: str
    seed: int
    init: str = "paper"                                         # the grid's init axis value
    knobs: dict[str, Any] = field(default_factory=dict)         # dotted config key -> value of this point
    config: dict[str, Any] = field(default_factory=dict)        # the full train config (point.json)
    done: bool = False                                          # training ended (finished or diverged)
    meta: dict[str, Any] = field(default_factory=dict)          # the trainer's "meta" record
    train: list[dict[str, Any]] = field(default_factory=list)   # kind "train", in step order
    eval: list[dict[str, Any]] = field(default_factory=list)    # kind "eval"
    diag: list[dict[str, Any]] = field(default_factory=list)    # kind "diag"
    events: list[dict[str, Any]] = field(default_factory=list)  # spikes and other events
    divergence: dict[str, Any] | None = None
    label: str = ""                                             # the report's name for the run's group

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

    @property
    def n_layers(self) -> int:
        layers = self.config.get("model", {}).get("n_layers")
        if isinstance(layers, int):
            return layers
        last = self.diag[-1] if self.diag else {}
        return sum(1 for k in last if re.fullmatch(r"grad_norm/blocks\.\d+", k))

    @property
    def resolved_init(self) -> str:
        """The init scheme the model was really built with (the trainer's meta record)."""
        return str(self.meta.get("init", self.init))

    @property
    def verdict(self) -> Verdict:
        return judge(diverged=self.diverged, diverged_at=self.diverged_at,
                     final_val_loss=self.eval[-1]["val_loss"] if self.eval else None,
                     unigram_entropy=self.meta.get("unigram_entropy"),
                     first_train_loss=self.train[0]["loss"] if self.train else None,
                     final_train_loss=self.train[-1]["loss"] if self.train else None,
                     last_diag=self.diag[-1] if self.diag else None, n_layers=self.n_layers)

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

    def to_record(self, root: Path | None = None) -> dict[str, Any]:
        """The run's one machine-readable record (the report's ``runs.json`` holds a list of them)."""
        cfg, optim, model = self.config, self.config.get("optim", {}), self.config.get("model", {})
        # a run still training has no verdict yet (its loss so far would read as stalled): null, and why
        v = self.verdict if self.done else None
        verdict, reason = ((v.verdict, v.reason) if v else
                           (None, f"unfinished: step {self.last_step} of {cfg.get('max_steps', '?')}"))
        last_eval = self.eval[-1] if self.eval else {}
        return {
            "run": str(self.path.relative_to(root)) if root else str(self.path),
            "placement": self.placement, "init": self.resolved_init, "init_axis": self.init,
            "knobs": self.knobs, "seed": self.seed, "verdict": verdict, "verdict_reason": reason,
            "done": self.done,
            "final_train_loss": _num(self.train[-1]["loss"]) if self.train else None,
            "final_val_loss": _num(last_eval.get("val_loss")), "val_tokens": last_eval.get("val_tokens"),
            "unigram_entropy": self.meta.get("unigram_entropy"),
            "tokens_seen": self.train[-1].get("tokens") if self.train else 0, "steps": self.last_step,
            "max_steps": cfg.get("max_steps"), "lr": optim.get("lr"), "warmup_steps": optim.get("warmup_steps"),
            "grad_clip": optim.get("grad_clip"), "n_layers": self.n_layers, "d_model": model.get("d_model"),
            "params": self.meta.get("params"), "precision": cfg.get("precision"),
            "diverged_at": self.diverged_at, "code": self.meta.get("code"),  # None: made before it was logged
            **{k: _num(x) for k, x in collapse_signals(self.diag[-1] if self.diag else None, self.n_layers).items()},
        }


def _num(x: Any) -> float | None:
    """JSON has no NaN/inf: they become null (the verdict says why)."""
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def read_run(path: str | Path, placement: str | None = None, seed: int | None = None, init: str | None = None,
             knobs: dict[str, Any] | None = None) -> RunRecord:
    """A run folder's record; placement, seed, init and knobs come from ``point.json`` when the grid wrote
    one, else from the arguments (a grid point not started yet)."""
    path = Path(path)
    point: dict[str, Any] = {}
    point_file = path / "point.json"
    if point_file.is_file():
        point = json.loads(point_file.read_text(encoding="utf-8"))
    p = point.get("point", {})
    rec = RunRecord(path, p.get("placement", placement or "?"), int(p.get("seed", seed or 0)),
                    init=p.get("init", init or "paper"), knobs=dict(p.get("knobs", knobs or {})),
                    config=point.get("config", {}),
                    done=(path / "done.json").is_file())
    metrics = path / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill: the trainer purges it on resume
            kind = r.get("kind")
            if kind == "meta":
                rec.meta = r
            else:
                {"train": rec.train, "eval": rec.eval, "diag": rec.diag}.get(kind, rec.events).append(r)
    div = path / "divergence.json"
    if div.is_file():
        rec.divergence = json.loads(div.read_text(encoding="utf-8"))
    return rec


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)
