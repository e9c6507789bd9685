"""``hybridnorm compare`` / ``hybridnorm sweep``: train a grid of runs (:mod:`.grid`) and report (:mod:`.report`).

Report folder::

    runs/<point>/                 each run (a normal run folder: resumable, metrics.jsonl, checkpoints)
    runs.json                     one record per run (placement, init, knobs, seed, verdict, losses, tokens)
    summary.md                    the command, what differs, per-group statistics, every run with its verdict
    loss_curves.png               train loss vs step, mean over seeds, min–max band, dotted = diverged
    grad_norm_by_depth.png        per-block gradient norm at step 1 and step 100 (the paper's Figure 2)
    activation_rms_by_depth.png   residual-stream RMS per block at step 1 and the last step
    sweep_<knob>.png              final val loss against each numeric knob (× = not trained)

The report is rewritten after every finished run, so a long grid can be committed while it runs; re-running
the same command skips finished runs and continues interrupted ones.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from hybridnorm.errors import ConfigError
from hybridnorm.experiments.grid import Grid, check_report_only, join_ranks, run_grid
from hybridnorm.experiments.grid_checks import check_only_this_grids_runs, grid_baseline
from hybridnorm.experiments.report import print_verdicts, write_report
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.distributed import agree, current_dist
from hybridnorm.train.preflight import check_output_folder


def run_experiment(base: TrainConfig, grid: Grid, out_dir: str | Path, *, jobs: int = 1, baseline: str | None = None,
                   command: str | None = None, title: str = "Placement comparison", train: bool = True) -> Path:
    out = Path(out_dir)
    grid.validate()
    baseline = grid_baseline(baseline, grid.placements)

    def report(records: list) -> None:
        write_report(records, out, baseline, command, title)

    d = join_ranks(base, jobs) if train else current_dist()  # torchrun: every run trains on all ranks
    failed: ConfigError | None = None
    try:  # the output-folder rule of every command: a report folder (this grid's, to continue) or a new one
        if train and d.is_main:
            check_output_folder(out, "report folder (--out)", may_hold=("report",))
        if not train and d.is_main:  # a grid's report folder, and the options that trained its runs
            check_report_only(base, grid, out)
        if d.is_main:  # and no run of another grid, which this report would drop
            check_only_this_grids_runs(out, {p.name for p in grid.points()},
                                       "report folder (--out)" if train else "--report-only --out")
    except ConfigError as e:
        failed = e
    agree(failed, d, f"checking the report folder {out}")
    runs = run_grid(base, grid, out, jobs=jobs, on_progress=report, train=train)
    failed = None
    try:
        if d.is_main:  # rank 0 alone reports under torchrun
            print_verdicts(runs)
            report(runs)
    except Exception as e:  # re-raised by agree() on this rank; the others learn it failed, not wait for it
        failed = e
    agree(failed, d, f"writing the report in {out}")
    if broken := [r for r in runs if r.failed is not None]:  # reported as failed; the command fails with them
        raise ConfigError(f"{len(broken)} of {len(runs)} runs failed ({broken[0].path.name}: {broken[0].failed}"
                          + (f"; and {len(broken) - 1} more" if len(broken) > 1 else "")
                          + f"); the report {out / 'summary.md'} lists them; fix the cause and run the command "
                          "again to retry them")
    return out / "summary.md"


def run_compare(base: TrainConfig, placement_names: Sequence[str], seeds: Sequence[int], out_dir: str | Path,
                command: str | None = None, inits: Sequence[str] = ("megatron",), jobs: int = 1,
                baseline: str | None = None) -> Path:
    """Placements side by side over seeds, one init for all by default (``inits=("paper",)`` for each
    placement's paper init)."""
    return run_experiment(base, Grid(list(placement_names), list(inits), (), list(seeds)), out_dir, jobs=jobs,
                          baseline=baseline, command=command)


def command_line(argv: Sequence[str]) -> str:
    return "hybridnorm " + " ".join(shlex.quote(a) for a in argv)
