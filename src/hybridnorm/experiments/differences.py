"""What the runs of a report share and what differs between them: their configs, and what each actually
did (:mod:`.as_run`: tokens per step, validation tokens, data, the code and hardware of every session).

The report's setup line states one figure where every run has it, and each value with its number of runs
where they differ; "What differs" names every config field with more than one value (fields that only
name the run, pause it or set the grid's measuring cadence left out), then what ran differently though
the configs may agree (``torchrun`` with another process count, a data file changed under its path, a
resume after ``git pull``).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from hybridnorm.config_base import flatten_config
from hybridnorm.errors import ConfigError
from hybridnorm.experiments import as_run
from hybridnorm.experiments.runs import RunRecord
from hybridnorm.train.optim import OptimConfig, unreached_peak
from hybridnorm.train.provenance import describe as describe_code
from hybridnorm.train.provenance import describe_hardware

# Config fields that name the run rather than change it.
BOOKKEEPING = {"out_dir", "seed", "model.placement", "data.cache_dir"}
# Fields that change no step of training: when a session pauses (a later session may drop them), and how
# often per-layer statistics are measured (the grid picks it from max_steps). Named when they are an axis.
NOT_TRAINING = {"stop_after_steps", "max_minutes", "diagnostics.every"}


def _flat_configs(runs: Sequence[RunRecord]) -> list[dict[str, str]]:
    """Each run's config as {dotted field: its value as JSON} (runs without a config left out)."""
    return [{k: json.dumps(v, sort_keys=True) for k, v in flatten_config(r.config).items()} for r in runs if r.config]


def _not_compared(runs: Sequence[RunRecord]) -> set[str]:
    axes = {k for r in runs for k in r.knobs}
    return BOOKKEEPING | (NOT_TRAINING - axes)


def varying_fields(runs: Sequence[RunRecord]) -> list[str]:
    """Config fields that every run's config records and that have more than one value across the runs
    (bookkeeping, pause and measuring fields left out), plus ``init`` when the resolved init schemes differ."""
    flats = _flat_configs(runs)
    common = set.intersection(*(set(f) for f in flats)) if flats else set()
    fields = {k for k in common if len({f[k] for f in flats}) > 1} - _not_compared(runs) - {"model.init"}
    if len({r.resolved_init for r in runs}) > 1:
        fields.add("init")
    return sorted(fields)


def ran_differences(runs: Sequence[RunRecord]) -> list[str]:
    """What the runs did differently, from their logs (an unknown value is not a known difference)."""
    checks = {"tokens per step": [as_run.tokens_per_step(r) for r in runs],
              "validation tokens": [as_run.val_tokens(r) for r in runs],
              "data content": [k for r in runs for k in as_run.data_keys(r)],
              "data files": [v for r in runs for v in as_run.session_values(r, "data_sha256")],  # known ones
              "code": [v for r in runs for v in as_run.session_values(r, "code")],
              "hardware": [v for r in runs for v in as_run.session_values(r, "hardware")]}
    return [name for name, values in checks.items() if len(as_run.distinct(values)) > 1] + (
        ["config changed on resume"] if any(resumed_changes(r) for r in runs) else [])


def resumed_changes(r: RunRecord) -> str:
    """What the run trained with after a resume that its config (``point.json``) does not say, in words;
    empty when nothing (the pause and measuring fields are not changes to training)."""
    return as_run.describe_changes(as_run.config_changes(r), NOT_TRAINING)


def differences(runs: Sequence[RunRecord]) -> list[str]:
    """Everything that differs across the runs, in the order a reader checks it: the placement, the init
    scheme really used, the config fields (knobs included), the seed, then what ran differently
    (:func:`ran_differences`). A field with one value across the runs is not named."""
    varying = varying_fields(runs)
    out = ["placement"] if len({r.placement for r in runs}) > 1 else []
    out += [f for f in varying if f == "init"] + [f for f in varying if f != "init"]
    out += ["seed"] if len({r.seed for r in runs}) > 1 else []
    return out + ran_differences(runs)


def partly_recorded_fields(runs: Sequence[RunRecord]) -> list[str]:
    """Config fields that some runs' configs record and others do not: fields added to the config after
    those others' configs were written (they ran with the default of the code that trained them)."""
    keys = [set(f) for f in _flat_configs(runs)]
    return sorted(set.union(*keys) - set.intersection(*keys) - _not_compared(runs)) if keys else []


def ran_apart(runs: Sequence[RunRecord]) -> dict[str, str]:
    """Run folder name -> a label suffix for runs whose tokens per step or data differ from runs of the same
    init and knob values (configs alike, e.g. a grid continued under torchrun with another process count),
    and for runs resumed with other settings than their config's (``train --resume --optim.lr=...`` in a
    grid's run folder): their groups are kept apart, so no mean pools them and no Δ pairs them. Empty when
    every cell is alike."""
    cells: dict[tuple, list[RunRecord]] = {}
    for r in runs:
        cells.setdefault((r.init, tuple(sorted(r.knobs.items(), key=str))), []).append(r)
    notes: dict[str, str] = {}
    for cell in cells.values():
        tps = {as_run.tokens_per_step(r) for r in cell}
        data = {tuple(as_run.data_keys(r)) for r in cell}
        files = as_run.distinct([v for r in cell for v in as_run.session_values(r, "data_sha256")])
        for r in cell:
            parts = [f"{as_run.tokens_per_step(r) or 0:,} tokens/step"] if len(tps) > 1 else []
            parts += [f"data {' then '.join(as_run.data_keys(r)) or 'not recorded'}"] if len(data) > 1 else []
            shas = as_run.session_values(r, "data_sha256")
            parts += [f"data files {' then '.join(shas) or 'not recorded'}"] if len(files) > 1 else []
            parts += [f"resumed with {changed}"] if (changed := resumed_changes(r)) else []
            if parts:
                notes[r.path.name] = "[" + "; ".join(parts) + "]"
    return notes


def _figure(values: Sequence[Any], fmt: Callable[[Any], str] = str) -> str:
    """One figure for every run, or each value with its number of runs (unknown values left out)."""
    known = [v for v in values if v is not None]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in known):
        known.sort()  # 256 before 1,024
    counts = Counter(fmt(v) for v in known)
    if not counts:
        return "not recorded"
    if len(counts) == 1:
        return next(iter(counts))
    return " / ".join(f"{text} ({n} run{'s' * (n != 1)})" for text, n in counts.items())


def _warmup(config: dict[str, Any]) -> str:
    """``N steps``, with `` (the whole run: lr peaks at X, never at Y)`` when the warmup outlasts the run: the
    lr in the setup line is then never reached, and a reader comparing with another report should know."""
    steps, o = config.get("max_steps") or 0, config.get("optim") or {}
    try:
        cfg = OptimConfig.from_dict(o)
    except ConfigError:  # a config written by other code: say nothing rather than guess
        return f"{o.get('warmup_steps')} steps"
    peak = unreached_peak(cfg, steps)
    note = "" if peak is None else f" (the whole run: lr peaks at {peak:.3g}, never at {cfg.lr:g})"
    return f"{cfg.warmup_steps} steps{note}"


def _bigram_note(done: Sequence[RunRecord]) -> str:
    """The Kneser-Ney bigram reference of the runs' data, where their meta records have it (runs trained
    before 2026-11-28 do not) and all agree: a one-token-context model, for scale (no verdict uses it)."""
    values = {r.meta.get("bigram_entropy") for r in done}
    if len(values) != 1 or not isinstance(b := values.pop(), (int, float)) or not math.isfinite(b):
        return ""
    return f"; bigram reference (Kneser-Ney, counted on the training split) {b:.3f} nats"


def setup_line(done: Sequence[RunRecord]) -> str:
    """The setup of the runs, each figure from every run (the as-run ones from their logs)."""
    def cfg(*keys: str) -> list[Any]:
        out = []
        for r in done:
            v: Any = r.config
            for k in keys:
                v = v.get(k) if isinstance(v, dict) else None
            out.append(v)
        return out

    def tokens(n: Any) -> str:
        return f"{n:,} tokens"

    line = (f"Setup shared by every run unless listed below: d={_figure(cfg('model', 'd_model'))}, "
            f"{_figure(cfg('model', 'n_layers'))} layers, {_figure(cfg('model', 'n_heads'))} heads "
            f"({_figure(cfg('model', 'n_kv_heads'))} KV), FFN {_figure(cfg('model', 'ffn_hidden_size'))}; "
            f"{_figure(cfg('max_steps'))} steps × {_figure([as_run.tokens_per_step(r) for r in done], tokens)} "
            f"per step; lr {_figure(cfg('optim', 'lr'))}, warmup {_figure([_warmup(r.config) for r in done])}, "
            f"clip {_figure(cfg('optim', 'grad_clip'))}, wd {_figure(cfg('optim', 'weight_decay'))}; "
            f"{_figure(cfg('precision'))}; data {_figure(cfg('data', 'source'))}")
    keys = [(as_run.data_keys(r) or [None])[-1] for r in done]  # a run resumed on other data: resumed_line
    if len(as_run.distinct(keys)) > 1:
        line += f" (content differs: {_figure(keys)})"
    shas = [(as_run.session_values(r, "data_sha256") or [None])[-1] for r in done]
    if len(as_run.distinct(shas)) > 1:  # counts alike or not: the files' content, where both runs record it
        line += f" (files differ: sha256 {_figure(shas)})"
    every = cfg("diagnostics", "every")
    if len(as_run.distinct(every)) > 1:
        line += f"; per-layer diagnostics every {_figure(every)} steps (measuring only)"
    unigram = [r.meta.get("unigram_entropy") for r in done]
    return (line + f"; validation on {_figure([as_run.val_tokens(r) for r in done], tokens)}; unigram baseline "
            f"{_figure(unigram, lambda u: f'{u:.3f} nats')}{_bigram_note(done)}.")


def provenance_line(runs: Sequence[RunRecord], field: str, describe: Callable[[Any], str]) -> str:
    """Which code made the runs, or which hardware ran them (``field`` of the trainer's ``meta`` records, each
    value as ``describe`` words it), with its number of runs, most frequent first; a run whose sessions
    differ counts under all their values joined by an arrow."""
    counts: Counter[str] = Counter()
    for r in runs:
        values = as_run.session_values(r, field) or [None]
        counts[" → ".join(describe(v) for v in values)] += 1
    return "; ".join(f"{v} ({n} run{'s' * (n != 1)})" for v, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def resumed_line(runs: Sequence[RunRecord], field: str, describe: Callable[[Any], str], what: str) -> list[str]:
    """The runs whose sessions had different ``field`` values (resumed after a ``git pull``, on another
    machine or process count, on changed data), each session with the step it started from."""
    items = []
    for r in runs:
        if len(as_run.session_values(r, field)) < 2:
            continue
        shown, last = [], object()
        for s in as_run.sessions(r):
            if s[field] != last:  # consecutive sessions alike are one
                shown.append(f"{describe(s[field])} from step {s['from_step']}")
                last = s[field]
        items.append(f"`{r.path.name}` ({', '.join(shown)})")
    return [f"**Resumed across {what}:** " + "; ".join(items) + ".", ""] if items else []


def describe_setup(done: Sequence[RunRecord], fields: dict[str, list[str]], baseline: str | None) -> list[str]:
    """The summary's lines on what the runs share and what differs, and which code and hardware made them."""
    lines = [setup_line(done), ""]
    lines += ["**What differs between runs:** " + (", ".join(f"`{f}`" for f in fields["differs"])
                                                   or "nothing (one configuration, one seed)")
              + ". Each Δ below pairs a placement with the baseline "
              + f"`{baseline}` at the same init axis value, knob values and seed"
              + ("; runs that trained other tokens per step or data than the runs of their init and knob values, "
                 "or were resumed with other settings, are grouped apart, [bracketed], and paired only with their "
                 "like" if any(r.ran_note for r in done) else "") + ".", ""]
    if fields["partly_recorded"]:
        lines += ["Recorded in only some runs' configs (fields added to the config after the other runs' "
                  "configs were written; those runs ran with the default of the code that trained them, see "
                  "the code line): " + ", ".join(f"`{f}`" for f in fields["partly_recorded"]) + ".", ""]
    lines += [f"Code that made the runs: {provenance_line(done, 'code', describe_code)}.", "",
              f"Hardware that ran them: {provenance_line(done, 'hardware', describe_hardware)}.", ""]
    changed = [f"`{r.path.name}` ({text})" for r in done if (text := resumed_changes(r))]
    if changed:
        lines += ["**Resumed with other settings than its config's** (the setup line and `point.json` give the "
                  "config; these runs trained the steps after the one named with the new values, and are grouped "
                  "apart): " + "; ".join(changed) + ".", ""]
    lines += resumed_line(done, "code", describe_code, "code versions")
    lines += resumed_line(done, "hardware", describe_hardware, "hardware")
    lines += resumed_line(done, "data", str, "data (the data file changed under its path)")
    lines += resumed_line(done, "data_sha256", lambda v: v or "not recorded",
                          "data files (sha256: an edit that may keep every count)")
    if "init" in fields["varying"] and any(r.init == "paper" for r in done):
        lines += ["**Init is confounded with placement** where the init axis is `paper`: each placement "
                  "uses its paper default (listed per row). Compare rows with one init for all to separate "
                  "the two.", ""]
    return lines
