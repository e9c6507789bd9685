"""The paper's claims (SCHEMES.md §1) judged from the studies' ``runs.json``, as a markdown table.

``python -m hybridnorm.experiments.claims docs/results`` rewrites the table between the ``claims`` markers
of ``docs/results/README.md`` from the run records of study A (placement × init × lr × seed) and study B
(placement × depth × seed), and each study's measurement table between its own markers
(``experiments.study_tables``); ``--check`` fails when one of them is not what the data give (CI runs it).
The rules, decided before the data and applied mechanically:

- Only runs with the same seed are paired, and a cell (placement, init, knob values) holds the seeds that
  finished; each row says how many seeds that is. While a grid is partial, a cell with fewer seeds can be
  a placement's best lr, and its comparisons then rest on those seeds only (the row's n says so).
- "Lower loss" is judged at each placement's own best learning rate (the lr whose runs all trained with the
  lowest mean final val loss), same init: a paired difference whose 95% t interval excludes 0 is
  *supported* / *contradicted*; one that includes 0 is *inconclusive*; one seed is *suggestive* only.
- "Trains where Post-Norm does not": the largest lr at which every seed of a placement is `trained`,
  per init; the claim is *supported* when HybridNorm's is at least Pre-Norm's and above Post-Norm's.
- Depth: per depth, whether every seed is `trained`; *supported* when some depth trains HybridNorm but not
  Post-Norm and no depth trains Post-Norm but not HybridNorm.
- Init: Megatron − Normal for the same placement, each at its best lr, paired by seed.
- Gradient balance: |log10(first/last block gradient norm)| at the final diagnostics step, trained runs, at
  the lr where both placements trained best; smaller is more balanced. At the paper's sizes (Figure 2):
  the same measure at step 1 from ``figure2/step1.json`` (``experiments.gradprofile``), paired by seed
  with Pre-Norm at the same size and init axis value. A second step-1 row per cell, |log10(last/third
  block)|, leaves the first two blocks out for every placement alike. It was added after the profiles were
  seen (HybridNorm's first block, and HybridNorm*'s first two, carry 10-18x the gradient of the flat rest,
  which decides the first measure), so it is post hoc and the README says so.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridnorm.errors import ConfigError
from hybridnorm.experiments import figure2
from hybridnorm.experiments.runs import read_report
from hybridnorm.experiments.stats import PairedDiff, mean_std, paired_difference
from hybridnorm.experiments.study_tables import tables as study_tables

STUDY_A, STUDY_B = "A_lr_init_24_layers", "B_depth"
BEGIN, END = "<!-- claims:begin -->", "<!-- claims:end -->"
HYBRIDS = ("hybridnorm", "hybridnorm_star")
POST = "post_shifted"


@dataclass(frozen=True)
class Cell:
    """All seeds of one placement × init × knob setting."""

    placement: str
    init: str
    knob: float
    val: dict[int, float]          # seed -> final val loss
    verdicts: dict[int, str]
    grad_ratio: dict[int, float]   # seed -> first/last block gradient norm

    @property
    def all_trained(self) -> bool:
        return bool(self.verdicts) and all(v == "trained" for v in self.verdicts.values())


def planned_values(study: Path, knob: str) -> set[float]:
    """Every value of ``knob`` in the study's grid, finished or not."""
    path = study / "runs.json"
    if not path.is_file():
        return set()
    return {float(r["knobs"][knob]) for r in read_report(path) if knob in r["knobs"]}


def load_cells(study: Path, knob: str) -> list[Cell]:
    """The study's finished runs grouped into cells, keeping only seeds that finished."""
    path = study / "runs.json"
    if not path.is_file():
        return []
    runs = read_report(path)
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        if r.get("done") and knob in r["knobs"]:
            groups[(r["placement"], r["init"], float(r["knobs"][knob]))].append(r)
    cells = []
    for (placement, init, value), rs in sorted(groups.items()):
        val = {r["seed"]: r["final_val_loss"] for r in rs if r["final_val_loss"] is not None}
        ratio = {r["seed"]: r["grad_ratio_first_last"] for r in rs if r.get("grad_ratio_first_last")}
        cells.append(Cell(placement, init, value, val, {r["seed"]: r["verdict"] for r in rs}, ratio))
    return cells


def _find(cells: list[Cell], placement: str, init: str) -> list[Cell]:
    return [c for c in cells if c.placement == placement and c.init == init]


def best_cell(cells: list[Cell], placement: str, init: str) -> Cell | None:
    """The placement's best-tuned cell: all seeds trained, lowest mean val loss."""
    ok = [c for c in _find(cells, placement, init) if c.all_trained]
    return min(ok, key=lambda c: mean_std(list(c.val.values()))[0], default=None)


def largest_trained(cells: list[Cell], placement: str, init: str) -> float | None:
    ok = [c.knob for c in _find(cells, placement, init) if c.all_trained]
    return max(ok, default=None)


def judge(d: PairedDiff, lower_is_claim: bool = True) -> str:
    if d.n == 0:
        return "untested"
    good = d.mean < 0 if lower_is_claim else d.mean > 0
    if d.n == 1:
        return f"suggestive {'for' if good else 'against'} (1 seed)"
    if d.low <= 0 <= d.high:
        return "inconclusive"
    return "**supported**" if good else "**contradicted**"


def _fmt_lr(x: float | None) -> str:
    return "none" if x is None else f"{x:g}"


def claim_lower_loss(cells: list[Cell], inits: list[str], planned: set[float]) -> list[str]:
    rows = []
    for init in inits:
        pre = best_cell(cells, "pre", init)
        for h in HYBRIDS:
            cell = best_cell(cells, h, init)
            if pre is None or cell is None:
                tried = {c.knob for c in _find(cells, h, init)}
                status = "untested" if not tried or pre is None else \
                    "**contradicted** (never trained)" if tried >= planned else \
                    f"untested so far (ran at lr {', '.join(map(_fmt_lr, sorted(tried)))} only, where it did not train)"
                rows.append(f"| {h} reaches lower loss than Pre-Norm (init {init}) | {status} | "
                            f"best trained lr: pre {_fmt_lr(pre and pre.knob)}, {h} {_fmt_lr(cell and cell.knob)} |")
                continue
            d = paired_difference(cell.val, pre.val)
            rows.append(f"| {h} reaches lower loss than Pre-Norm (init {init}) | {judge(d)} | each at its best lr "
                        f"(pre {pre.knob:g}, {h} {cell.knob:g}): Δ val = {d} nats, n={d.n} seeds |")
    return rows


def claim_stability(cells: list[Cell], inits: list[str]) -> list[str]:
    rows = []
    for init in inits:
        if not _find(cells, "pre", init):
            continue
        # judged on the lrs every placement has finished, so a partial grid compares like with like
        lrs = sorted(set.intersection(*({c.knob for c in _find(cells, p, init)} for p in ("pre", *HYBRIDS, POST))))
        if not lrs:
            continue
        common = [c for c in cells if c.knob in lrs]
        big = {p: largest_trained(common, p, init) for p in ("pre", *HYBRIDS, POST)}
        evidence = ", ".join(f"{p} {_fmt_lr(v)}" for p, v in big.items())
        for h in HYBRIDS:
            if not _find(cells, h, init):
                continue
            hv, pv, qv = (big[h] or 0.0), (big["pre"] or 0.0), (big[POST] or 0.0)
            status = "**supported**" if hv >= pv and hv > qv else "**contradicted**"
            seeds = max(len(c.verdicts) for c in common)
            status += " (1 seed)" if seeds == 1 else ""
            rows.append(f"| {h} trains at every lr Pre-Norm trains at, and where Post-Norm does not (init {init}) | "
                        f"{status} | largest lr with every seed trained (of {', '.join(map(_fmt_lr, lrs))}): "
                        f"{evidence} |")
    return rows


def claim_depth(cells: list[Cell]) -> list[str]:
    if not cells:
        return ["| Post-Norm breaks with depth where HybridNorm trains | untested (study B not run yet) | — |"]
    depths = sorted({c.knob for c in cells})
    trained = {(c.placement, c.knob): c.all_trained for c in cells}
    rows = []
    for h in HYBRIDS:
        both = [d for d in depths if (h, d) in trained and (POST, d) in trained]
        wins = [d for d in both if trained[(h, d)] and not trained[(POST, d)]]
        losses = [d for d in both if trained[(POST, d)] and not trained[(h, d)]]
        status = "untested" if not both else "**supported**" if wins and not losses else \
            "**contradicted**" if losses or not wins else "inconclusive"
        per = "; ".join(f"{d:g} layers: {h} {'trained' if trained[(h, d)] else 'failed'}, post "
                        f"{'trained' if trained[(POST, d)] else 'failed'}" for d in both)
        rows.append(f"| Post-Norm breaks with depth where {h} trains | {status} | {per or '—'} |")
    return rows


def claim_balance(cells: list[Cell], inits: list[str]) -> list[str]:
    rows = []
    for init in inits:
        for h in HYBRIDS:
            common = [(a, b) for a in _find(cells, h, init) for b in _find(cells, "pre", init)
                      if a.knob == b.knob and a.all_trained and b.all_trained and a.grad_ratio and b.grad_ratio]
            if not common:
                continue
            a, b = min(common, key=lambda ab: mean_std(list(ab[0].val.values()))[0])
            spread = {s: abs(math.log10(a.grad_ratio[s])) - abs(math.log10(b.grad_ratio[s]))
                      for s in a.grad_ratio.keys() & b.grad_ratio.keys()}
            d = paired_difference(spread, {s: 0.0 for s in spread})
            rows.append(f"| {h}'s gradient norms are more balanced across depth than Pre-Norm's (init {init}) | "
                        f"{judge(d)} | lr {a.knob:g}: first/last block grad ratio {h} "
                        f"{_ratios(a)} vs pre {_ratios(b)}; Δ|log10 ratio| = {d} |")
    return rows


FIGURE2_STEPS = (1, 100)  # docs/results/figure2/step<N>.json, when present


def claim_figure2(results: Path) -> list[str]:
    """Figure 2 at the paper's sizes: HybridNorm(*)'s gradients at steps 1 and 100 more balanced than Pre-Norm's."""
    rows = []
    for step in FIGURE2_STEPS:
        rows += _figure2_rows(figure2.load(results / "figure2" / f"step{step}.json"), step)
    return rows


def _figure2_rows(profiles: list[dict[str, Any]], step: int) -> list[str]:
    by_cell = figure2.cells(profiles)
    rows = []
    for (size, init, h), seeds in sorted(by_cell.items()):
        pre = by_cell.get((size, init, "pre"), {})
        if h not in (*HYBRIDS, "post") or not pre:
            continue
        depth = min(len(p["block"]) for p in (*seeds.values(), *pre.values()))
        for skip, where, ratio in ((0, "", "last/first"), (2, " past the first two blocks", "last/third")):
            if depth < skip + 2:  # fewer than two blocks left to compare
                continue
            spread = {s: figure2.imbalance(seeds[s], skip) - figure2.imbalance(pre[s], skip)
                      for s in seeds.keys() & pre.keys()}
            d = paired_difference(spread, {s: 0.0 for s in spread})
            rows.append(f"| {h}'s step-{step} gradient norms are more balanced across depth{where} than Pre-Norm's "
                        f"({size}, init {init}) | {judge(d)} | {ratio} block grad ratio per seed {h} "
                        f"{_last_over(seeds, skip)} vs pre {_last_over(pre, skip)}; Δ|log10 ratio| = {d} |")
    return rows


def _last_over(by_seed: dict[int, dict[str, Any]], skip: int) -> str:
    return "/".join(f"{by_seed[s]['block'][-1] / by_seed[s]['block'][skip]:.2f}" for s in sorted(by_seed))


def claim_init(cells: list[Cell], inits: list[str]) -> list[str]:
    """Table 10: HybridNorm(*) does better with the Megatron init than with Normal (each at its best lr)."""
    if not {"normal", "megatron"} <= set(inits):
        return []
    rows = []
    for p in ("pre", *HYBRIDS):
        meg, nor = best_cell(cells, p, "megatron"), best_cell(cells, p, "normal")
        claim = f"{p}: the Megatron init beats Normal" + (" (paper Table 10)" if p != "pre" else " (for reference)")
        if meg is None or nor is None:
            rows.append(f"| {claim} | untested (no lr trained every seed with both inits) | — |")
            continue
        d = paired_difference(meg.val, nor.val)
        rows.append(f"| {claim} | {judge(d)} | each at its best lr (megatron {meg.knob:g}, normal {nor.knob:g}): "
                    f"Δ val = {d} nats |")
    return rows


def _ratios(c: Cell) -> str:
    return "/".join(f"{c.grad_ratio[s]:.2f}" for s in sorted(c.grad_ratio))


def claim_table(results: Path) -> str:
    a = load_cells(results / STUDY_A, "optim.lr")
    b = load_cells(results / STUDY_B, "model.n_layers")
    inits = sorted({c.init for c in a})
    planned = planned_values(results / STUDY_A, "optim.lr")
    rows = [*claim_lower_loss(a, inits, planned), *claim_stability(a, inits), *claim_depth(b),
            *claim_balance(a, inits), *claim_figure2(results), *claim_init(a, inits)]
    n_a = len({(c.placement, c.init, c.knob, s) for c in a for s in c.verdicts})
    n_f = {step: len(figure2.load(results / "figure2" / f"step{step}.json")) for step in FIGURE2_STEPS}
    profiles = [f"{n} step-{step} gradient profile{'s' * (n != 1)} of `figure2/step{step}.json`"
                for step, n in n_f.items() if n]
    head = (f"Derived by `python -m hybridnorm.experiments.claims docs/results` from {n_a} finished runs of study A "
            f"and {sum(len(c.verdicts) for c in b)} of study B"
            + (f", and {' and '.join(profiles)}" if profiles else "")
            + " (rules in that module's docstring).\n\n"
            "| claim | status at this scale | evidence (factors held equal) |\n|---|---|---|\n")
    return head + "\n".join(rows) + "\n"


def _replace_block(text: str, begin: str, end: str, body: str, where: Path) -> str:
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ConfigError(f"{where}: expected one {begin} … {end} block")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}{end}{tail}"


def update_readme(results: Path, check: bool = False) -> bool:
    """Rewrite (or, with ``check``, compare) the README's claim table and, where the README has their
    markers, the studies' measurement tables; True when all were already current."""
    readme = results / "README.md"
    text = readme.read_text(encoding="utf-8")
    new = _replace_block(text, BEGIN, END, claim_table(results), readme)
    for (begin, end), table in study_tables(results).items():
        if begin in new or end in new:
            new = _replace_block(new, begin, end, table, readme)
    if new == text:
        return True
    if not check:
        readme.write_text(new, encoding="utf-8")
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="docs/results")
    ap.add_argument("--check", action="store_true", help="fail if the README's table is out of date")
    args = ap.parse_args(argv)
    try:
        current = update_readme(args.results, check=args.check)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check and not current:
        print(f"{args.results / 'README.md'}: the claim table is out of date; run "
              f"python -m hybridnorm.experiments.claims {args.results}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
