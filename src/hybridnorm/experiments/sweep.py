"""``hybridnorm sweep``: vary one knob per placement and report where each one stops training.

The knob is any dotted config field (``optim.lr``, ``model.n_layers``, ``model.init`` …; the short names
``lr``, ``depth``, ``init`` are aliases). A run counts as **failed** when the non-finite guard stopped it
or its final train loss is no better than ``fail_ratio`` × its first logged loss (it did not learn).
The summary reports, per placement, the largest value that still trained — for ``lr`` the max stable
learning rate, for ``depth`` the depth at which a placement breaks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridnorm.experiments import plots
from hybridnorm.experiments.runs import RunRecord, read_run, slug
from hybridnorm.train.config import TrainConfig, apply_overrides
from hybridnorm.train.trainer import train

KNOB_ALIASES = {"lr": "optim.lr", "depth": "model.n_layers", "layers": "model.n_layers", "init": "model.init",
                "warmup": "optim.warmup_steps"}


def failed(run: RunRecord, fail_ratio: float = 0.95) -> bool:
    if run.diverged or not run.train:
        return True
    return not run.final_loss < fail_ratio * run.train[0]["loss"]


def run_sweep(base: TrainConfig, placement_names: Sequence[str], knob: str, values: Sequence[Any],
              out_dir: str | Path, seed: int = 0, command: str | None = None, fail_ratio: float = 0.95) -> Path:
    out = Path(out_dir)
    key = KNOB_ALIASES.get(knob, knob)
    runs: list[RunRecord] = []
    for name in placement_names:
        for value in values:
            overrides = [f"--{key}={value}", f"--model.placement={name}", f"--seed={seed}"]
            run_dir = out / "runs" / f"{slug(name)}-{slug(key)}={slug(str(value))}"
            overrides.append(f"--out_dir={run_dir}")
            cfg = TrainConfig.from_dict(apply_overrides(base.to_dict(), overrides))
            print(f"[sweep] {name} {key}={value} -> {run_dir}", flush=True)
            if train(cfg, resume=True, quiet=True).interrupted:
                raise KeyboardInterrupt  # stop the whole sweep; re-running it continues where it stopped
            runs.append(read_run(run_dir, name, seed, knob=value))
    out.mkdir(parents=True, exist_ok=True)
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if numeric:
        points = {name: [(float(r.knob), r.final_loss if not failed(r, fail_ratio) else math.nan)
                         for r in runs if r.placement == name] for name in placement_names}
        plots.knob_curve(points, out / "sweep.png", key, log_x=key == "optim.lr")
    (out / "summary.md").write_text(_summary(runs, placement_names, key, values, numeric, command, fail_ratio),
                                    encoding="utf-8")
    return out / "summary.md"


def _cell(run: RunRecord, fail_ratio: float) -> str:
    if run.diverged:
        return f"diverged @ {run.diverged_at}"
    if failed(run, fail_ratio):
        return f"no progress ({run.final_loss:.3f})"
    return f"{run.final_loss:.3f}"


def _summary(runs: list[RunRecord], names: Sequence[str], key: str, values: Sequence[Any], numeric: bool,
             command: str | None, fail_ratio: float) -> str:
    lines = [f"# Sweep over `{key}`", ""]
    if command:
        lines += ["```", command, "```", ""]
    header = "| placement | " + " | ".join(f"{key}={v}" for v in values) + (
        " | largest value that trained |" if numeric else " |")
    lines += ["Final train loss per run; *diverged* = stopped by the non-finite guard; *no progress* = final "
              f"loss not below {fail_ratio:g} × the first logged loss.", "", header,
              "|---" * (len(values) + 1 + int(numeric)) + "|"]
    for name in names:
        row = [r for r in runs if r.placement == name]
        cells = [_cell(r, fail_ratio) for r in row]
        if numeric:
            ok = [r.knob for r in row if not failed(r, fail_ratio)]
            cells.append(f"{max(ok):g}" if ok else "none")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines += ["", "![sweep](sweep.png)" if numeric else "", ""]
    return "\n".join(lines)
