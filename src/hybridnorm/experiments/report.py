"""The report of a grid: ``runs.json`` (one record per run), ``summary.md`` and the figures.

Measurement first: every run with its verdict and numbers, then per-group statistics over seeds (mean ±
std, the per-seed values, and the paired-by-seed difference to the baseline placement with a 95% t
interval). What differs between the runs compared is derived from their configs and from what each run
logged it did (:mod:`.differences`), not assumed, and said; runs alike in config and knobs that trained
other tokens per step or data are kept in groups of their own.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridnorm import placements as registry
from hybridnorm.experiments import plots, verdict
from hybridnorm.experiments.differences import (
    describe_setup,
    differences,
    partly_recorded_fields,
    ran_apart,
    varying_fields,
)
from hybridnorm.experiments.runs import RunRecord, set_peer_gains
from hybridnorm.experiments.stats import PairedDiff, fmt_mean_std, paired_difference


def group_key(r: RunRecord) -> tuple:
    return (r.placement, r.init, tuple(sorted(r.knobs.items())), r.ran_note)


def group_label(r: RunRecord, show_init: bool) -> str:
    parts = [r.placement] + ([f"init={r.init}"] if show_init else []) + [f"{k}={v}" for k, v in r.knobs.items()]
    return " ".join(parts + ([r.ran_note] if r.ran_note else []))


def write_report(runs: Sequence[RunRecord], out: Path, baseline: str | None = None, command: str | None = None,
                 title: str = "Placement comparison") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    set_peer_gains(list(runs))  # verdicts judged beside the runs of the same budget
    show_init = len({r.init for r in runs}) > 1
    apart = ran_apart([r for r in runs if r.done])
    for r in runs:
        r.ran_note = apart.get(r.path.name, "")
        r.label = group_label(r, show_init)
    done = [r for r in runs if r.done]
    baseline = baseline or (runs[0].placement if runs else None)
    records = [r.to_record(out) for r in runs]
    groups = _group_stats(done, baseline)
    fields = {"varying": varying_fields(done), "differs": differences(done),
              "partly_recorded": partly_recorded_fields(done)}
    (out / "runs.json").write_text(json.dumps({"command": command, "baseline": baseline, **fields, "runs": records,
                                               "groups": groups}, indent=1), encoding="utf-8")
    if done:
        plots.loss_curves(done, out / "loss_curves.png")
        last = max(r.last_step for r in done)
        plots.by_depth(done, out / "grad_norm_by_depth.png", "grad_norm", [1, min(100, last)], "‖∇‖ of the block",
                       "gradient norm by depth")
        plots.by_depth(done, out / "activation_rms_by_depth.png", "act_rms", [1, last], "RMS of block output",
                       "activation RMS by depth")
    axes = _numeric_axes(done)
    for key in (k for k in axes if len({r.knobs[k] for r in done}) > 1):  # a curve needs two values
        plots.knob_curve(_knob_points(done, key), out / f"sweep_{key}.png", key, log_x=key == "optim.lr")
    text = _summary(runs, done, groups, axes, fields, baseline, command, title, out)
    (out / "summary.md").write_text(text, encoding="utf-8")
    return out / "summary.md"


def _group_stats(done: Sequence[RunRecord], baseline: str | None) -> list[dict[str, Any]]:
    by_group: dict[tuple, list[RunRecord]] = defaultdict(list)
    for r in done:
        by_group[group_key(r)].append(r)
    out = []
    for (placement, init, knobs, ran_note), group in by_group.items():
        val = {r.seed: r.final_val_loss for r in group}
        base = by_group.get((baseline, init, knobs, ran_note), [])
        diff = paired_difference(val, {r.seed: r.final_val_loss for r in base}) \
            if base and placement != baseline else None
        out.append({"placement": placement, "init": init, "knobs": dict(knobs), "label": group[0].label,
                    "no_diff_because": _no_diff_because(placement, baseline, base, diff, [
                        g[0].label for (p, i, k, _), g in by_group.items() if (p, i, k) == (baseline, init, knobs)]),
                    "inits_used": sorted({r.resolved_init for r in group}),
                    "verdicts": {v: sum(r.verdict.verdict == v for r in group) for v in verdict.VERDICTS},
                    "val_loss_by_seed": {str(s): (v if math.isfinite(v) else None) for s, v in sorted(val.items())},
                    "val_loss_mean_std": fmt_mean_std(list(val.values())),
                    "diff_vs_baseline": diff.to_dict() if diff else None, "diff_text": _diff_text(diff, len(val)),
                    "baseline_inits": sorted({r.resolved_init for r in base})})
    return out


def _diff_text(diff: PairedDiff | None, seeds: int) -> str:
    """The Δ as the table shows it, with how many seeds it pairs when that is fewer than the group has (a seed
    of either side that diverged or is missing is left out of the pairs)."""
    if diff is None or diff.n == 0:
        return ""
    if diff.n == 1 < seeds:  # one pair: no interval, and still which share of the group it is
        return f"{diff.mean:+.4f} (n=1 of {seeds} seeds, no interval)"
    return f"{diff} (n={diff.n} of {seeds} seeds)" if 1 < diff.n < seeds else str(diff)


def _no_diff_because(placement: str, baseline: str | None, base: Sequence[RunRecord],
                     diff: PairedDiff | None, apart: Sequence[str] = ()) -> str:
    """Why a group other than the baseline has no Δ (empty when it has one, or is the baseline); ``apart``:
    the labels of the baseline's groups at its init and knob values, which ran otherwise than it."""
    if placement == baseline or (diff is not None and diff.n > 0):
        return ""
    if not base and apart:  # there are finished baseline runs here: [bracketed] ones, not paired with it
        return (f"the finished `{baseline}` runs at its init axis value and knob values ran otherwise than it and "
                f"are grouped apart ({', '.join(f'`{label}`' for label in apart)})")
    if not base:
        return f"no finished `{baseline}` run at its init axis value and knob values"
    return f"no seed with a finite final val loss in both it and `{baseline}`"


def _numeric_axes(done: Sequence[RunRecord]) -> list[str]:
    keys = list(dict.fromkeys(k for r in done for k in r.knobs))
    return [k for k in keys
            if all(isinstance(r.knobs.get(k), (int, float)) and not isinstance(r.knobs.get(k), bool) for r in done)]


def _knob_points(done: Sequence[RunRecord], key: str) -> dict[str, list[plots.KnobPoint]]:
    """Per group of everything but ``key`` and the seed, per value of ``key``: the mean val loss of the seeds
    that trained (NaN when none did) and every seed that did not train, with its verdict and its real val
    loss (None when it has no finite one)."""
    cells: dict[str, dict[float, list[RunRecord]]] = defaultdict(lambda: defaultdict(list))
    for r in done:
        rest = " ".join([r.placement] + [f"init={r.init}"] * (len({x.init for x in done}) > 1)
                        + [f"{k}={v}" for k, v in r.knobs.items() if k != key] + [r.ran_note] * bool(r.ran_note))
        cells[rest][float(r.knobs[key])].append(r)
    points = {}
    for name, by_value in cells.items():
        pts = []
        for x, group in by_value.items():
            ok = [r.final_val_loss for r in group if r.verdict.verdict == "trained"]
            others = [plots.NotTrained(r.seed, r.verdict.verdict,
                                       r.final_val_loss if math.isfinite(r.final_val_loss) else None)
                      for r in group if r.verdict.verdict != "trained"]
            pts.append(plots.KnobPoint(x, sum(ok) / len(ok) if ok else math.nan, others))
        points[name] = pts
    return points


def _summary(runs: Sequence[RunRecord], done: Sequence[RunRecord], groups: list[dict[str, Any]], axes: list[str],
             fields: dict[str, list[str]], baseline: str | None, command: str | None, title: str, out: Path) -> str:
    """``fields``: the config fields that vary between the finished runs and those only some of them record."""
    lines = [f"# {title}", ""]
    if command:
        lines += ["```", command, "```", ""]
    if len(done) < len(runs):
        failed = sum(r.failed is not None for r in runs)
        lines += [f"**Partial: {len(done)} of {len(runs)} runs finished**"
                  + (f"; **{failed} failed** (their error is in the last column: fix it, then" if failed else "; ")
                  + (" re-run the command to retry them)" if failed else "re-run the command to continue") + ".", ""]
    if done:
        lines += describe_setup(done, fields, baseline)
    lines += ["Verdicts (rules and thresholds: `hybridnorm.experiments.verdict`): **trained**; **stalled** = val "
              f"loss not ≥ {verdict.STALL_MARGIN:g} nats below the unigram baseline, or a gain over it under "
              f"{verdict.PROGRESS_FRACTION:.0%} of the largest gain among this report's runs of the same budget; "
              "**collapsed** = token cosine "
              f"≥ {verdict.COLLAPSE_COS:g} in most blocks or first/last block gradient < {verdict.VANISH_RATIO:g}; "
              "**diverged** = non-finite.", ""]
    lines += ["## Per group (over seeds)", "",
              f"| group | init used | verdicts | val loss mean ± std | val loss per seed | Δ val vs `{baseline}` "
              "(95% CI, paired by seed) |", "|---|---|---|---|---|---|"]
    for g in groups:
        counts = ", ".join(f"{n} {v}" for v, n in g["verdicts"].items() if n)
        per_seed = ", ".join(f"{s}: {v:.4f}" if v is not None else f"{s}: —" for s, v in g["val_loss_by_seed"].items())
        init_note = "/".join(g["inits_used"]) + (f" (baseline: {'/'.join(g['baseline_inits'])})"
                                                 if g["diff_text"] and g["baseline_inits"] != g["inits_used"] else "")
        lines.append(f"| `{g['label']}` | {init_note} | {counts} | {g['val_loss_mean_std']} | {per_seed} | "
                     f"{g['diff_text'] or '—'} |")
    lines += ["", "Δ < 0: lower validation loss than the baseline. Means, std and Δ use every finished run that "
              "did not diverge, whatever its verdict; the verdict counts say how many trained.", ""]
    lines += [f"No Δ for `{g['label']}`: {g['no_diff_because']}." for g in groups if g["no_diff_because"]]
    lines += [""] if any(g["no_diff_because"] for g in groups) else []
    for key in axes:
        lines += _largest_trained(runs, key)
    lines += _gradient_table(done)
    lines += ["## Every run", "", "| run | placement | init | knobs | seed | verdict | val loss | train loss | "
              "tokens | why |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rec = r.to_record()
        knobs = ", ".join(f"{k}={v}" for k, v in r.knobs.items()) or "—"
        status = (rec["verdict"] if r.done else "*failed*" if r.failed else "*unreadable*" if r.problem
                  else "*unfinished*")
        why = str(rec["verdict_reason"]).replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.path.name} | `{r.placement}` | {rec['init']} | {knobs} | {r.seed} | {status} | "
                     f"{_loss(rec, 'val')} | {_loss(rec, 'train')} | {rec['tokens_seen'] or 0:,} | {why} |")
    lines += ["", "A loss not at the run's last step (unfinished, or the last logged before it diverged) is shown "
              "with its step; `tokens`: what the model was trained on. Machine-readable: `runs.json` (one record "
              "per run, and the group statistics).", ""]
    if done:
        lines += ["![loss curves](loss_curves.png)", "", "![gradient norm by depth](grad_norm_by_depth.png)", "",
                  "![activation RMS by depth](activation_rms_by_depth.png)", ""]
        lines += [f"![sweep over {k}](sweep_{k}.png)" for k in axes if (out / f"sweep_{k}.png").is_file()] + [""]
        lines += ["Equations of the placements (as `hybridnorm placements` writes them):", ""]
        for n in dict.fromkeys(r.placement for r in done):
            lines += [f"- `{n}`:"] + [f"  - {eq}" for eq in registry.equations(registry.get(n))]
        lines += [""]
    return "\n".join(lines)


def _loss(rec: dict[str, Any], kind: str) -> str:
    """The final loss, or the last one logged with its step (the row's verdict or reason says why)."""
    final, last, step = rec[f"final_{kind}_loss"], rec[f"last_{kind}_loss"], rec[f"last_{kind}_step"]
    if final is not None:
        return f"{final:.4f}"
    return f"{last:.4f} (step {step})" if last is not None else "—"


def _largest_trained(runs: Sequence[RunRecord], key: str) -> list[str]:
    """Per group of the other factors: the largest ``key`` value at which every seed of the grid trained; a
    value with a seed not finished (unfinished, failed, unreadable) is not one, and its count says so."""
    cells: dict[str, dict[Any, list[str]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        rest = " ".join([r.placement, f"init={r.init}"] + [f"{k}={v}" for k, v in r.knobs.items() if k != key]
                        + [r.ran_note] * bool(r.ran_note))
        cells[rest][r.knobs[key]].append(r.verdict.verdict if r.done else NOT_FINISHED)
    lines = [f"## Largest `{key}` that trained (every seed `trained`)", "", f"| group | largest `{key}` | "
             "verdicts per value |", "|---|---|---|"]
    for rest, by_value in cells.items():
        ok = [v for v, vs in by_value.items() if all(x == "trained" for x in vs)]
        detail = "; ".join(f"{v}: " + ", ".join(f"{vs.count(x)} {x}" for x in (*verdict.VERDICTS, NOT_FINISHED)
                                                if x in vs)
                           for v, vs in sorted(by_value.items()))
        lines.append(f"| `{rest}` | {max(ok) if ok else 'none'} | {detail} |")
    return [*lines, ""]


NOT_FINISHED = "not finished"  # a seed with no verdict yet: "every seed trained" cannot be said of its value


def _gradient_table(done: Sequence[RunRecord]) -> list[str]:
    """Ratio of the last block's gradient norm to the first block's, at step 1 and step 100: > 1 means
    gradients grow with depth (Pre-Norm's signature in the paper), < 1 that they shrink toward the top."""
    rows = ["## Gradient balance", "", "| group | ‖∇ last block‖ / ‖∇ first block‖ at step 1, mean ± std (per seed) "
            "| at step 100 |", "|---|---|---|"]
    labels = list(dict.fromkeys(r.label for r in done))
    any_value = False
    for label in labels:
        cells = []
        for step in (1, 100):
            ratios = {}
            for r in (r for r in done if r.label == label):
                rec = r.diag_at(step)
                prof = r.by_layer(rec, "grad_norm")
                if len(prof) >= 2 and prof[0] > 0 and (rec or {}).get("step") == step:
                    ratios[r.seed] = prof[-1] / prof[0]
            any_value |= bool(ratios)
            # per seed too: one collapsed seed's 1e11 would otherwise hide in a mean ± std
            per_seed = ", ".join(f"{s}: {v:.3g}" for s, v in sorted(ratios.items()))
            shown = fmt_mean_std(list(ratios.values()), 3) if ratios else "—"
            cells.append(f"{shown} ({per_seed})" if len(ratios) > 1 else shown)
        rows.append(f"| `{label}` | {cells[0]} | {cells[1]} |")
    return [*rows, ""] if any_value else []


def print_verdicts(runs: Sequence[RunRecord]) -> None:
    set_peer_gains(list(runs))
    for r in runs:
        if r.done:
            print(f"[grid] {r.path.name}: {r.verdict.verdict} ({r.verdict.reason})", file=sys.stderr)
