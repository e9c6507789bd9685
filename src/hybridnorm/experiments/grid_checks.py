"""What a grid refuses before it trains or reports, each as one ConfigError naming the cause:

- a value listed twice in one option (``--seeds 0,1,0``, ``--axis lr=1e-3,0.001``): it would train once and
  count twice in the report's statistics;
- two spellings of one placement (``hybridnorm`` and ``QKV-Post``, ``pre`` and ``Pre-Pre``): they would
  train the same model twice and the report would count it as two placements (a ``--baseline`` spelled
  unlike the grid's name of it is that placement: :func:`grid_baseline`);
- a point that trains no step (``--axis steps=0``, ``--max-steps 0``): a grid judges trained runs, and a run
  of zero steps has no training record to judge (it was reported as a lost log); or one that AdamW cannot
  train (``optim.eps=0``, which ``train`` refuses at its start: the grid trained the points before it);
- a ``data.source`` that is not there (a missing file, a folder without text files): caught before the
  first run trains, not by a worker half-way through the grid;
- ``--report-only`` on a folder that is not a grid's report folder, or with options that contradict the
  configs the runs were trained with (the report's command block would show a command that did not make
  them);
- a report folder holding runs that are no point of this grid (another grid's): its report would be replaced
  by one that leaves them out.

Also which config fields only pause a run (:data:`PAUSE_FIELDS`): the grid lets a later command change
them, so a grid paused with ``--stop_after_steps`` is finished by the same command without it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from hybridnorm import placements as registry
from hybridnorm.config_base import config_differences, flatten_config
from hybridnorm.data.corpus import source_files
from hybridnorm.errors import ConfigError
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.optim import check_trainable
from hybridnorm.train.preflight import REPORT_POINT, folder_kind

# Fields that decide when a session stops (and checkpoints), not what it trains: a later session may drop them.
PAUSE_FIELDS = ("stop_after_steps", "max_minutes")


def no_repeats(option: str, values: Sequence[Any]) -> None:
    """A value listed twice would train once and then count twice in the report's statistics."""
    for i, v in enumerate(values):
        earlier = [u for u in values[:i] if same_value(u, v)]
        if earlier:
            same = f" ({earlier[0]!r} and {v!r} are one value)" if repr(earlier[0]) != repr(v) else ""
            raise ConfigError(f"{option} lists {v!r} twice{same}; each value may appear once")


def same_value(a: Any, b: Any) -> bool:  # 1e-3 and 0.001 are one lr; True and 1 are not one value
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    return a == b and (numbers or type(a) is type(b))


def _built(name: str) -> tuple[Any, ...]:
    """What a placement name builds: everything of the placement but its name and description."""
    p = registry.get(name)
    return (p.block, p.overrides, p.embed_norm, p.final_norm, p.dual_stream, p.init)


def check_placement_spellings(names: Sequence[str], recorded: Sequence[str] = (), recorded_in: str = "") -> None:
    """Refuse two names of one placement (an alias, a case variant, a grammar name of a preset); with
    ``recorded``, the names a file being continued (``recorded_in``) already holds, also a listed name that
    spells one of those otherwise: the file would hold that model twice, drawn as two placements."""
    on_file: dict[tuple[Any, ...], str] = {}
    for old in dict.fromkeys(recorded):
        try:
            on_file.setdefault(_built(old), old)
        except ConfigError:  # a name this version does not know: no model of the list can be it
            continue
    for name in names:
        old = on_file.get(_built(name), name)
        if old != name:
            raise ConfigError(f"--placements lists {name!r}, but {recorded_in} holds that placement as {old!r}, "
                              f"two names of one placement; list it as {old!r} to continue the file")
    seen: dict[tuple[Any, ...], str] = {}
    for name in names:
        built = _built(name)
        if built in seen and seen[built] != name:
            first = seen[built]
            resolved = registry.get(first).name
            same = resolved if resolved == registry.get(name).name else f"{resolved} = {registry.get(name).name}"
            raise ConfigError(f"--placements lists {first!r} and {name!r}, two names of one placement ({same}); "
                              "each placement may appear once")
        seen.setdefault(built, name)


def grid_baseline(baseline: str | None, placements: Sequence[str]) -> str:
    """The grid's name of ``--baseline``: given as another spelling of a listed placement (``pre-pre`` for
    ``Pre-Pre``) it is that placement, named as the grid names it (the report's groups use the grid's names)."""
    if baseline is None or baseline in placements:
        return placements[0] if baseline is None else baseline
    try:
        built = _built(baseline)
    except ConfigError as e:
        raise ConfigError(f"--baseline {baseline!r}: {e}") from None
    for name in placements:
        if _built(name) == built:
            return name
    raise ConfigError(f"--baseline {baseline!r} is not one of the grid's placements: {', '.join(placements)}")


def check_points_train(configs: Sequence[TrainConfig], names: Sequence[str]) -> None:
    """Every point trains at least one step (max_steps 0 is train's "evaluate the initial model"), with settings
    AdamW can train with (``--axis optim.eps=1e-8,0`` trained the first point, then failed on the second)."""
    for cfg, name in zip(configs, names, strict=True):
        check_trainable(cfg.optim, f" (grid point {name})")
        if cfg.max_steps < 1:
            raise ConfigError(f"max_steps={cfg.max_steps} (grid point {name}) trains no step, and a grid compares "
                              "trained runs: give steps >= 1 (--max-steps or --axis steps=...); nothing was trained")


def check_data_sources(configs: Sequence[TrainConfig], names: Sequence[str]) -> None:
    """Each point's ``data.source`` exists (a stat, no reading: ``hf:`` sources are checked when loaded)."""
    checked: set[str] = set()
    for cfg, name in zip(configs, names, strict=True):
        if cfg.data.source in checked:
            continue
        try:
            source_files(cfg.data.source)
        except ConfigError as e:
            raise ConfigError(f"{e} (grid point {name}); nothing was trained") from None
        checked.add(cfg.data.source)


def check_report_folder(out: Path) -> None:
    """``--report-only`` reads a grid's report folder: one holding a grid point (``runs/*/point.json``)."""
    kind = folder_kind(out)
    if kind != "report":
        what = {"missing": "does not exist", "empty": "is empty", "run": "is a training run's folder"}.get(
            kind, "holds no grid run (runs/<point>/point.json)")
        raise ConfigError(f"--report-only --out {out}: the folder {what}, not a compare/sweep report folder; "
                          "nothing was written (give the --out of the grid to report)")


def check_only_this_grids_runs(out: Path, names: Collection[str], option: str) -> None:
    """Every grid run in the report folder (``runs/<point>/point.json``) is a point of this grid: a report of
    another grid's command once replaced the folder's report with one that left those runs out, beside the
    other grid's ``sweep_<knob>`` plots (a report the new summary.md does not describe). More seeds, values or
    placements than the folder's runs are fine: the same grid, grown."""
    # what makes a folder a report (preflight.folder_kind); none in a new folder: nothing to leave out
    found = sorted(p.parent.name for p in out.glob("/".join(REPORT_POINT)) if p.is_file())
    others = [name for name in found if name not in names]
    if others:
        more = f", and {len(others) - 3} more" if len(others) > 3 else ""
        raise ConfigError(f"{option} {out} holds runs that are no point of this grid ({', '.join(others[:3])}{more}): "
                          "its report would leave them out and replace the report they are in; give another --out, "
                          "the command that made them (its summary.md shows it; more seeds, values or placements "
                          "may be added to it), or delete those run folders; nothing was written")


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def check_trained_with(recorded: Sequence[tuple[str, dict[str, Any]]], wanted: Sequence[TrainConfig]) -> None:
    """``--report-only`` with the options the runs were trained with: each started point's recorded config
    (``(folder name, config)``, in point order) against the config these options give it. Not compared:
    fields only one side has (added to the config since), where the folder lies, when a session paused, and
    the diagnostics cadence (the grid derives it from max_steps, named instead)."""
    ignore = {"out_dir", "diagnostics.every", *PAUSE_FIELDS}
    for (name, have), cfg in zip(recorded, wanted, strict=True):
        want = cfg.to_dict()
        diff = [k for k in config_differences(have, want, common_only=True) if k not in ignore]
        if diff:
            h, w = flatten_config(have), flatten_config(want)
            shown = ", ".join(f"{k}={_shown(h[k])} (given: {_shown(w[k])})" for k in diff[:6])
            more = f", and {len(diff) - 6} more" if len(diff) > 6 else ""
            raise ConfigError(f"--report-only: run {name} was trained with {shown}{more}; give --report-only the "
                              "command that trained the grid (its summary.md shows it), so that the report's "
                              "command block is the one that made its runs; nothing was written")


def with_pause_of(recorded: dict[str, Any], cfg: TrainConfig) -> dict[str, Any]:
    """A point's recorded config with this command's :data:`PAUSE_FIELDS` (the next session's)."""
    return {**recorded, **{k: getattr(cfg, k) for k in PAUSE_FIELDS}}
