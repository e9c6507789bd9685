"""``hybridnorm compare``: train several placements on the same data, seed, size and budget; report.

Report folder::

    runs/<placement>-seed<k>/     each run (a normal run folder: resumable, metrics.jsonl, checkpoints)
    loss_curves.png               train loss vs step, mean over seeds, min–max band, dotted = diverged
    grad_norm_by_depth.png        per-block gradient norm at step 1 and step 100 (the paper's Figure 2)
    activation_rms_by_depth.png   residual-stream RMS per block at step 1 and the last collected step
    summary.md                    the command, the final numbers (mean ± std over seeds), divergence table

Re-running the same command continues unfinished runs and reuses finished ones.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from hybridnorm import placements as registry
from hybridnorm.experiments import plots
from hybridnorm.experiments.runs import RunRecord, fmt_mean_std, read_run, slug
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.trainer import train


def _with_diagnostics(cfg: TrainConfig) -> TrainConfig:
    """Collect diagnostics at least every 10 steps so that steps 1 and 100 are both in the record."""
    diag = getattr(cfg, "diagnostics", None)
    if diag is None:
        return cfg
    every = diag.every if diag.every and 100 % diag.every == 0 else 10
    return dataclasses.replace(cfg, diagnostics=dataclasses.replace(diag, every=every))


def run_one(base: TrainConfig, placement: str, seed: int, run_dir: Path, log: bool = True) -> RunRecord:
    cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, placement=placement), seed=seed,
                              out_dir=str(run_dir))
    cfg.validate()
    if log:
        print(f"[compare] {placement} seed {seed} -> {run_dir}", file=sys.stderr, flush=True)
    if train(cfg, resume=True, quiet=True).interrupted:
        raise KeyboardInterrupt  # Ctrl-C / SIGTERM stops the whole comparison, not just this run
    return read_run(run_dir, placement, seed)


def run_compare(base: TrainConfig, placement_names: Sequence[str], seeds: Sequence[int], out_dir: str | Path,
                command: str | None = None) -> Path:
    out = Path(out_dir)
    for name in placement_names:
        registry.get(name)  # fail fast on a typo, before hours of training
    base = _with_diagnostics(base)
    runs = [run_one(base, name, seed, out / "runs" / f"{slug(name)}-seed{seed}")
            for name in placement_names for seed in seeds]
    return write_report(runs, out, base, command)


def write_report(runs: Sequence[RunRecord], out: Path, base: TrainConfig, command: str | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    last = max((r.last_step for r in runs), default=1)
    late = 100 if last >= 100 else last
    plots.loss_curves(runs, out / "loss_curves.png")
    plots.by_depth(runs, out / "grad_norm_by_depth.png", "grad_norm", [1, late], "‖∇‖ of the block",
                   "gradient norm by depth")
    plots.by_depth(runs, out / "activation_rms_by_depth.png", "act_rms", [1, last], "RMS of block output",
                   "activation RMS by depth")
    (out / "summary.md").write_text(summary_markdown(runs, base, command), encoding="utf-8")
    return out / "summary.md"


def summary_markdown(runs: Sequence[RunRecord], base: TrainConfig, command: str | None) -> str:
    m = base.model
    names = list(dict.fromkeys(r.placement for r in runs))
    seeds = sorted({r.seed for r in runs})
    lines = ["# Placement comparison", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += [f"Model: d={m.d_model}, {m.n_layers} layers, {m.n_heads} heads ({m.kv_heads} KV), FFN "
              f"{m.ffn_hidden_size}{', MoE' if m.moe else ''}; {base.max_steps} steps × {base.tokens_per_step:,} "
              f"tokens, lr {base.optim.lr:g}, {base.precision}, data {base.data.source}; seeds {seeds}. "
              "Each placement uses its paper-default init unless the command overrides `model.init`.", "",
              "| placement | init | final train loss | final val loss | diverged | equations |",
              "|---|---|---|---|---|---|"]
    for name in names:
        group = [r for r in runs if r.placement == name]
        p = registry.get(name)
        init = m.init if m.init != "default" else p.init
        div = [r for r in group if r.diverged]
        div_txt = f"{len(div)}/{len(group)}" + (
            f" (at step {', '.join(str(r.diverged_at) for r in div)})" if div else "")
        eq = registry.block_equations(p.block)
        lines.append(f"| `{name}` | {init} | {fmt_mean_std([r.final_loss for r in group])} | "
                     f"{fmt_mean_std([r.final_val_loss for r in group])} | {div_txt} | {eq} |")
    lines += ["", "Mean ± sample standard deviation over seeds; diverged runs are excluded from the means.", ""]
    lines += _gradient_table(runs, names)
    lines += ["![loss curves](loss_curves.png)", "", "![gradient norm by depth](grad_norm_by_depth.png)", "",
              "![activation RMS by depth](activation_rms_by_depth.png)", ""]
    return "\n".join(lines)


def _gradient_table(runs: Sequence[RunRecord], names: list[str]) -> list[str]:
    """Ratio of the last block's gradient norm to the first block's, at step 1 and step 100: > 1 means
    gradients grow with depth (Pre-Norm's signature in the paper), < 1 that they vanish (Post-Norm)."""
    rows = ["| placement | ‖∇ last block‖ / ‖∇ first block‖ at step 1 | at step 100 |", "|---|---|---|"]
    any_value = False
    for name in names:
        cells = []
        for step in (1, 100):
            ratios = []
            for r in (r for r in runs if r.placement == name):
                prof = r.by_layer(r.diag_at(step), "grad_norm")
                if len(prof) >= 2 and prof[0] > 0 and (r.diag_at(step) or {}).get("step") == step:
                    ratios.append(prof[-1] / prof[0])
            any_value |= bool(ratios)
            cells.append(fmt_mean_std(ratios, 3) if ratios else "—")
        rows.append(f"| `{name}` | {cells[0]} | {cells[1]} |")
    return ([*rows, ""]) if any_value else []


def command_line(argv: Sequence[str]) -> str:
    return "hybridnorm " + " ".join(shlex.quote(a) for a in argv)
