"""The measurement tables of ``docs/results/README.md``, generated from the studies' ``runs.json``.

One table per study: a row per placement × init, a column per value of the study's knob (lr for study A,
depth for study B), each cell the mean ± sample std of the final validation loss over the seeds that
finished, the number of seeds, and the verdict counts. The per-seed values and verdict reasons are in each
study's ``summary.md``; these tables only gather them, so that no number in the README is typed by hand.
``python -m hybridnorm.experiments.claims docs/results`` rewrites them between their markers with the
claim table, and ``--check`` (run by CI) fails when one is not what the run records give.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from hybridnorm.experiments.runs import read_report
from hybridnorm.experiments.stats import finite, mean_std

# study folder -> (knob recorded in each run's knobs, column title of one value)
STUDIES = {"A_lr_init_24_layers": ("optim.lr", "lr {:g}"), "B_depth": ("model.n_layers", "{:g} layers")}
VERDICT_ORDER = ("trained", "stalled", "collapsed", "diverged")


def markers(study: str) -> tuple[str, str]:
    return f"<!-- table:{study}:begin -->", f"<!-- table:{study}:end -->"


def _verdicts(verdicts: list[str]) -> str:
    """``3 trained`` / ``2 trained, 1 collapsed``, in a fixed order (unknown verdicts last, by name)."""
    counts = Counter(verdicts)
    order = [v for v in VERDICT_ORDER if v in counts] + sorted(v for v in counts if v not in VERDICT_ORDER)
    return ", ".join(f"{counts[v]} {v}" for v in order)


def _cell(runs: list[dict]) -> str:
    if not runs:
        return "—"
    vals = finite([r.get("final_val_loss") for r in runs])
    m, s = mean_std(vals)
    loss = "no val loss" if not vals else f"{m:.3f}" + (f" ± {s:.3f}" if len(vals) > 1 else "")
    seeds = len(runs)
    return f"{loss} (n={seeds}: {_verdicts([r.get('verdict') or 'no verdict' for r in runs])})"


def study_table(runs: list[dict], knob: str, column: str) -> str:
    """The markdown table of one study's finished runs (see the module docstring)."""
    done = [r for r in runs if r.get("done") and knob in r.get("knobs", {})]
    if not done:
        return "No run of this study has finished yet.\n"
    values = sorted({float(r["knobs"][knob]) for r in done})
    rows = sorted({(r["placement"], r["init"]) for r in done}, key=lambda pi: (_first_seen(runs, pi), pi))
    cells: dict[tuple[str, str, float], list[dict]] = {}
    for r in done:
        cells.setdefault((r["placement"], r["init"], float(r["knobs"][knob])), []).append(r)
    head = "| placement | init | " + " | ".join(column.format(v) for v in values) + " |\n"
    rule = "|---|---|" + "---|" * len(values) + "\n"
    body = "".join(f"| {p} | {i} | " + " | ".join(_cell(cells.get((p, i, v), [])) for v in values) + " |\n"
                   for p, i in rows)
    n = len(done)
    foot = (f"\nFinal validation loss, mean ± std over the seeds that finished (n), and their verdicts; "
            f"{n} finished run{'s' * (n != 1)} of {len(runs)}. Per-seed values: the study's `summary.md`.\n")
    return head + rule + body + foot


def _first_seen(runs: list[dict], placement_init: tuple[str, str]) -> int:
    """Rows keep the grid's order of placements and inits (the order of runs.json), not the alphabet's."""
    return next(i for i, r in enumerate(runs) if (r["placement"], r["init"]) == placement_init)


def tables(results: Path) -> dict[tuple[str, str], str]:
    """{(begin marker, end marker): table} for every study folder of ``results`` with a runs.json."""
    out = {}
    for study, (knob, column) in STUDIES.items():
        path = results / study / "runs.json"
        if path.is_file():
            out[markers(study)] = study_table(read_report(path), knob, column)
    return out
