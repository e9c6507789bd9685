"""Grids of runs: placement × init × any config knobs × seed, resumable, optionally several at a time.

    grid = Grid(placements=["pre", "hybridnorm"], inits=["megatron"], axes=[("optim.lr", [1e-3, 1e-2])],
                seeds=[0, 1, 2], warmup_frac=0.1)
    records = run_grid(base_config, grid, "reports/x", jobs=2)

Every point trains in its own run folder ``<out>/runs/<placement>-init=<init>-<knob>=<value>...-seed<k>``
holding ``point.json`` (the point and the full config). Re-running the same grid skips finished runs
(``done.json``) and continues interrupted ones from their last checkpoint; a point whose folder was made
with a different config is refused, naming the fields that differ. ``init`` is an axis of its own:
``paper`` is each placement's paper default (Pre-Norm → normal, HybridNorm(*) → megatron), any other
value is one init for every placement. ``warmup_frac`` sets ``optim.warmup_steps`` to that fraction of
``max_steps`` at every point (so a steps or depth axis keeps the same schedule shape).

``jobs > 1`` trains that many points side by side, each in its own process (``python -m
hybridnorm.experiments.grid RUN_DIR``, :mod:`.grid_workers`) with the machine's cores split between them.
Ctrl-C or SIGTERM stops every worker after its current step with a checkpoint; running the command again
continues. A point whose worker fails is marked failed in its folder and report. What a grid refuses before
it trains (two names of one placement, a missing data source) or reports is in :mod:`.grid_checks`.

Under ``torchrun`` (:func:`join_ranks`) the points train one after another, each on every rank with DDP (FSDP
runs collect no per-layer diagnostics, which the verdicts need), the global batch split over the ranks as in
``train``; rank 0 alone writes the grid's files (``point.json``, ``done.json``, the report) and prints, so N
ranks make the grid that one process makes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hybridnorm import placements as registry
from hybridnorm.config_base import config_differences
from hybridnorm.errors import ConfigError
from hybridnorm.experiments.grid_checks import (
    PAUSE_FIELDS,
    check_data_sources,
    check_placement_spellings,
    check_points_train,
    check_report_folder,
    check_trained_with,
    no_repeats,
    with_pause_of,
)
from hybridnorm.experiments.grid_workers import (
    clear_failure,
    record_failure,
    run_parallel,
    sigterm_as_interrupt,
    train_point,
    worker_main,
)
from hybridnorm.experiments.runs import RunRecord, read_point, read_run_or_unreadable, slug
from hybridnorm.placements.spec import INITS
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.distributed import Dist, agree, current_dist, init_distributed, resolve_device
from hybridnorm.train.precision import choose_precision

KNOB_ALIASES = {"lr": "optim.lr", "depth": "model.n_layers", "layers": "model.n_layers", "warmup": "optim.warmup_steps",
                "width": "model.d_model", "steps": "max_steps", "clip": "optim.grad_clip"}
INIT_AXIS = ("paper", *INITS)


def knob_key(name: str) -> str:
    return KNOB_ALIASES.get(name, name)


GRID_OPTION_FIELDS = ("model.placement", "model.init", "seed", "out_dir")  # --placements, --init, --seeds, --out


def check_knob(option: str, name: str) -> None:
    """Refuse a knob that is no config field, naming it as typed (``--knob nope``, ``--axis nope``) with the
    valid fields and the short names; the override it becomes was named instead (``option --nope``)."""
    # the grid's own options set these, point by point (also as train's option names: --placement, --init)
    if knob_key(name) in GRID_OPTION_FIELDS or name.replace("-", "_") in ("placement", "placements", "init", "seeds",
                                                                          "out"):
        raise ConfigError(f"{option} {name}: use --placements / --init / --seeds / --out instead")
    try:
        section = TrainConfig.check_key(knob_key(name), f"{option} {name}")
    except ConfigError as e:
        short = ", ".join(f"{k} ({v})" for k, v in KNOB_ALIASES.items())
        raise ConfigError(f"{e}; or a short name: {short}") from None
    if section is not None:  # a knob is one value; a whole section's value replaced its fields' defaults
        names = [f.name for f in fields(section)]
        raise ConfigError(f"{option} {name}: {knob_key(name)} is a section of fields ({', '.join(names)}), not one "
                          f"value; name one of its fields ({knob_key(name)}.{names[0]}, ...)")


@dataclass(frozen=True)
class GridPoint:
    placement: str
    init: str                                  # "paper" or one of INITS
    knobs: tuple[tuple[str, Any], ...]         # (dotted config key, value), in axis order
    seed: int

    @property
    def name(self) -> str:
        parts = [slug(self.placement), f"init={self.init}", *(f"{slug(k)}={slug(str(v))}" for k, v in self.knobs)]
        return "-".join(parts) + f"-seed{self.seed}"

    def to_dict(self) -> dict[str, Any]:
        return {"placement": self.placement, "init": self.init, "knobs": dict(self.knobs), "seed": self.seed}


@dataclass
class Grid:
    placements: Sequence[str]
    inits: Sequence[str] = ("paper",)
    axes: Sequence[tuple[str, Sequence[Any]]] = ()
    seeds: Sequence[int] = (0,)
    warmup_frac: float | None = None
    diag_every: int | None = None              # None: chosen from max_steps (see with_diagnostics)
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> Grid:
        for name in self.placements:
            registry.get(name)  # a typo fails here, before hours of training
        for init in self.inits:
            if init not in INIT_AXIS:
                raise ConfigError(f"--init {init!r} is not one of {', '.join(INIT_AXIS)}")
        if not self.placements or not self.seeds or not self.inits:
            raise ConfigError("a grid needs at least one placement, one init and one seed")
        for key, _ in self.axes:
            check_knob("--axis", key)
        keys = [knob_key(k) for k, _ in self.axes]  # check_knob above refused the grid's own fields
        if len(set(keys)) != len(keys):
            raise ConfigError(f"the same knob appears twice among the axes: {', '.join(keys)}")
        if any(not values for _, values in self.axes):
            raise ConfigError("every --axis needs at least one value")
        if self.warmup_frac is not None and not 0 <= self.warmup_frac < 1:
            raise ConfigError(f"--warmup-frac={self.warmup_frac} must be in [0, 1)")
        for option, values in (("--placements", self.placements), ("--init", self.inits),
                               ("--seeds", self.seeds), *((f"--axis {k}", v) for k, v in self.axes)):
            no_repeats(option, values)
        check_placement_spellings(self.placements)  # hybridnorm and QKV-Post: one model, trained twice
        names = [p.name for p in self.points()]
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:  # two values that differ but name the same run folder
            raise ConfigError(f"two grid points would share the run folder {twice!r}; make their values distinct")
        return self

    def points(self) -> list[GridPoint]:
        """Seeds outermost, placements innermost: a partial grid holds whole comparisons, seed by seed."""
        combos: list[tuple[tuple[str, Any], ...]] = [()]
        for key, values in self.axes:
            combos = [(*c, (knob_key(key), v)) for c in combos for v in values]
        return [GridPoint(p, init, knobs, seed) for seed in self.seeds for knobs in combos
                for init in self.inits for p in self.placements]


def with_diagnostics(cfg: TrainConfig, every: int | None = None) -> TrainConfig:
    """The verdicts and the depth plots need per-layer statistics at step 1, step 100 and near the end:
    every 10 steps for short runs, every 50 for long ones (≈ +0.2% step time at every 10)."""
    if every is None:
        every = cfg.diagnostics.every if cfg.diagnostics.every and 100 % cfg.diagnostics.every == 0 else (
            10 if cfg.max_steps <= 300 else 50)
    return dataclasses.replace(cfg, diagnostics=dataclasses.replace(cfg.diagnostics, every=every))


def point_config(base: TrainConfig, grid: Grid, point: GridPoint, run_dir: Path) -> TrainConfig:
    overrides = [f"--{k}={v}" for k, v in point.knobs]
    overrides += [f"--model.placement={point.placement}", f"--seed={point.seed}", f"--out_dir={run_dir}",
                  f"--model.init={'default' if point.init == 'paper' else point.init}"]
    try:
        cfg = base.with_overrides(overrides)
    except ConfigError as e:  # a knob's value: which of the grid's points it is
        raise ConfigError(f"{e} (grid point {point.name})") from None
    if grid.warmup_frac is not None:
        cfg.optim.warmup_steps = round(grid.warmup_frac * cfg.max_steps)
    return with_diagnostics(cfg, grid.diag_every).validate()


def one_precision(configs: list[TrainConfig], quiet: bool = False) -> list[TrainConfig]:
    """The points' configs with ``precision="auto"`` resolved ONCE for all of them: what ``auto`` picks for
    each point's model on this device if that is the same for all of them, else fp32. Per point, a width or
    depth axis could otherwise train some runs in bf16 and others in fp32, a difference no report would name.
    A point whose precision is set (not ``auto``) keeps it."""
    auto = [c for c in configs if c.precision == "auto"]
    if not auto:
        return configs
    picks = {choose_precision("auto", resolve_device(c.device), c.model.d_model)[0] for c in auto}
    chosen = picks.pop() if len(picks) == 1 else "fp32"
    if current_dist().is_main and not quiet:
        print(f"[grid] precision auto -> {chosen} for every run", file=sys.stderr, flush=True)
    return [dataclasses.replace(c, precision=chosen) if c.precision == "auto" else c for c in configs]


def prepare_point(cfg: TrainConfig, point: GridPoint, run_dir: Path) -> None:
    """Write ``point.json``, or check that the one there is this point's with this config. The pause fields
    (grid_checks.PAUSE_FIELDS) are not compared: an unfinished point takes this command's, so that a grid
    paused with --stop_after_steps is finished by the command without it."""
    want = {"point": point.to_dict(), "config": json.loads(json.dumps(cfg.to_dict()))}
    path = run_dir / "point.json"
    if path.is_file():
        have = read_point(path)
        # out_dir is the folder itself: a grid moved, cloned or started from another directory is the same grid
        diff = [k for k in config_differences(have.get("config", {}), want["config"], common_only=True)
                if k not in ("out_dir", *PAUSE_FIELDS)]
        if have.get("point") != want["point"] or diff:
            diff = diff or ["point"]
            raise ConfigError(f"run folder {run_dir} was trained with a different config ({', '.join(diff)} "
                              "differ); use another --out, or delete that folder to retrain it")
        paused = with_pause_of(have["config"], cfg)
        if paused != have["config"] and not (run_dir / "done.json").is_file():
            _write_point(path, {**have, "config": paused})
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_point(path, want)


def _write_point(path: Path, spec: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(spec, indent=1), encoding="utf-8")
    tmp.replace(path)


def check_report_only(base: TrainConfig, grid: Grid, out: Path) -> None:
    """``--report-only``: ``out`` is a grid's report folder and these options give each started point the
    config it was trained with (grid_checks); ConfigError otherwise, before anything is written."""
    check_report_folder(out)
    points = grid.points()
    configs = one_precision([point_config(base, grid, p, out / "runs" / p.name) for p in points], quiet=True)
    recorded, wanted = [], []
    for p, cfg in zip(points, configs, strict=True):
        try:
            have = read_point(out / "runs" / p.name / "point.json")
        except ConfigError:  # not started, or damaged: the report says so for that run
            continue
        recorded.append((p.name, have["config"]))
        wanted.append(cfg)
    check_trained_with(recorded, wanted)


def join_ranks(base: TrainConfig, jobs: int) -> Dist:
    """Join torchrun's process group (a no-op in one process): every point then trains on all the ranks.
    ``jobs > 1`` is refused there: its worker processes would each start a group of their own."""
    device = resolve_device(base.device, int(os.environ.get("LOCAL_RANK", "0")))
    d = init_distributed(device, base.dist_timeout)
    if d.enabled and jobs > 1:
        raise ConfigError(f"--jobs={jobs} under torchrun: each run of the grid already trains on all "
                          f"{d.world_size} process(es), one run after another; use --jobs 1 (the default)")
    if d.enabled and base.parallel == "fsdp":  # refused here, before any run folder is written
        raise ConfigError("parallel='fsdp' in a grid: its verdicts and depth plots need per-layer diagnostics, "
                          "which FSDP runs do not collect; use parallel='ddp' (the default) for compare/sweep")
    return d


def run_grid(base: TrainConfig, grid: Grid, out_dir: str | Path, jobs: int = 1,
             on_progress: Callable[[list[RunRecord]], None] | None = None, train: bool = True) -> list[RunRecord]:
    """Train every point of ``grid`` not yet done; return the records of all its points (finished or not).
    ``on_progress`` is called with all records after each run that finishes (e.g. to rewrite the report).
    ``train=False`` only reads what is there (a report of a grid that another process is still running).
    Under torchrun (joined with :func:`join_ranks`) every rank calls this; only rank 0 writes and prints."""
    if jobs < 1:
        raise ConfigError(f"--jobs={jobs} must be >= 1")
    grid.validate()
    out = Path(out_dir)
    points = grid.points()
    dirs = {p: out / "runs" / p.name for p in points}
    d = current_dist()

    def say(text: str) -> None:
        if d.is_main:
            print(text, file=sys.stderr, flush=True)

    warned: set[Path] = set()  # records() runs after every finished run: say each unreadable folder once

    def records() -> list[RunRecord]:  # a point not started yet still has its placement, init, knobs, seed
        recs = [read_run_or_unreadable(dirs[p], p.placement, p.seed, p.init, dict(p.knobs)) for p in points]
        for r in recs:
            if r.problem and r.path not in warned:
                warned.add(r.path)
                say(f"[grid] {r.path.name} left out of the report: {r.problem}")
        return recs

    if not train:
        return records()
    configs = [point_config(base, grid, p, dirs[p]) for p in points]
    check_points_train(configs, [p.name for p in points])  # steps=0: no record to judge (every rank alike)
    configs = one_precision(configs)
    failed_prepare: ConfigError | None = None
    try:  # rank 0 writes the point.json files; the other ranks learn whether it could
        check_data_sources(configs, [p.name for p in points])  # a missing file: before any run trains
        if d.is_main:
            for p, cfg in zip(points, configs, strict=True):
                prepare_point(cfg, p, dirs[p])
    except ConfigError as e:
        failed_prepare = e
    agree(failed_prepare, d, f"preparing the run folders of {out}")
    todo = [dirs[p] for p in points if not (dirs[p] / "done.json").is_file()]  # what every rank trains
    at_a_time = f"one at a time, each on all {d.world_size} processes" if d.enabled else f"{jobs} at a time"
    say(f"[grid] {len(points)} runs, {len(points) - len(todo)} already done, {len(todo)} to train "
        f"({at_a_time}) -> {out}")

    def progress(_: Path) -> None:
        if on_progress is not None and d.is_main:
            on_progress(records())

    failed: list[tuple[Path, int]] = []
    with sigterm_as_interrupt():
        if jobs == 1:
            for i, run_dir in enumerate(todo, 1):
                say(f"[grid] {i}/{len(todo)} {run_dir.name}")
                status = _train_here(run_dir, d.is_main)
                if status == "interrupted":
                    raise KeyboardInterrupt  # stop the whole grid; re-running it continues where it stopped
                if status == "done":
                    progress(run_dir)
        else:
            failed = run_parallel(todo, jobs, progress)
    if failed:
        print(f"[grid] {len(failed)} run(s) failed and are left out of the verdicts: "
              + ", ".join(p.name for p, _ in failed), file=sys.stderr, flush=True)
    return records()


def _train_here(run_dir: Path, is_main: bool) -> str:
    """:func:`train_point` in this process; a point that fails on bad input is marked failed (its report
    row says why) before the error stops the grid."""
    if is_main:
        clear_failure(run_dir)
    try:
        return train_point(run_dir)
    except ConfigError as e:
        if is_main:
            record_failure(run_dir, 2, " ".join(str(e).split()))
        raise


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
