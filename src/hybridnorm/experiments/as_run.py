"""What a run actually did, read from its own log rather than from its config: the tokens of each optimizer
step, the validation tokens scored, the data it read, the code and hardware of each of its sessions, the
tokens it saw, and from these its budget (which runs' losses compare).

A config records what was asked; what ran can differ. ``global_batch=0`` resolves to processes × batch_size
× grad_accum, so one config trains twice the tokens per step under ``torchrun --nproc_per_node 2``; a data
file changed under the same path keeps its ``data.source``; a run continued after ``git pull`` was made by
two versions of the code, each in its own ``meta`` record; a run resumed by ``train --resume`` with another
learning rate or step count trained its later steps with them, though ``point.json`` keeps the grid's
(the trainer logs a ``config_changed_on_resume`` event). Reports compare runs by these figures.

The data fingerprint is what the trainer computed from the tokens themselves and logged in every ``meta``
record (train and validation token counts, the unigram cross-entropy of validation under the train
counts); since 2026-12-02 also the sha256 of the data files' content (``data_sha256``: no path, no
mtime), which names an edit that keeps every count (lines swapped, a same-size typo fix under the byte
tokenizer); a ``touch`` or a copy changes neither. The hash is compared only among sessions that record
it (:func:`data_sha`): a run or session from before it is not "other data" for lacking it. The budget
(which losses compare, for the relative stall rule) keeps to the counts."""

from __future__ import annotations

import json
import math
from typing import Any, Protocol


class Logged(Protocol):
    """What these functions read of a run (:class:`~hybridnorm.experiments.runs.RunRecord` has it)."""

    config: dict[str, Any]
    meta: dict[str, Any]
    metas: list[dict[str, Any]]
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    events: list[dict[str, Any]]
    divergence: dict[str, Any] | None


def _whole(x: Any) -> int | None:
    """``x`` as an int when it is a whole number (JSON may carry 512.0), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x != int(x):
        return None
    return int(x)


def tokens_per_step(r: Logged) -> int | None:
    """Tokens of one optimizer step over all processes, as the run trained them: the ``meta`` record's
    (logged since 2026-12), else the cumulative token count of a train record over its step (the global
    batch is a run's invariant: a resume keeps it), else the config resolved as the trainer resolves it
    with the logged process count (a run that stopped before its first train record). None: unknown."""
    for m in reversed(r.metas or [r.meta]):
        if (logged := _whole(m.get("tokens_per_step"))) is not None and logged > 0:
            return logged
    for rec in reversed(r.train):
        tokens, step = _whole(rec.get("tokens")), _whole(rec.get("step"))
        if tokens and step and tokens % step == 0:
            return tokens // step
    c = r.config
    seq, gb = _whole(c.get("seq_len")), _whole(c.get("global_batch")) or 0
    batch, accum = _whole(c.get("batch_size")), _whole(c.get("grad_accum", 1))
    processes = _whole((r.meta.get("hardware") or {}).get("processes")) or 1
    if seq is None:
        return None
    if gb:
        return gb * seq
    return batch * accum * processes * seq if batch and accum else None


def val_tokens(r: Logged) -> int | None:
    """Validation tokens the last evaluation scored (``eval_batches`` global batches of windows)."""
    return _whole(r.eval[-1].get("val_tokens")) if r.eval else None


def tokens_seen(r: Logged) -> int:
    """Tokens the model was trained on: the last train record's count; for a diverged run, the steps it
    completed before the non-finite one (its divergence report) × tokens per step, which a run that
    diverged before its first train record has logged nowhere else."""
    logged = _whole(r.train[-1].get("tokens")) if r.train else None
    if r.divergence is not None:
        completed = _whole(r.divergence.get("completed_steps"))
        if completed is None and (step := _whole(r.divergence.get("step"))) is not None:
            completed = step - 1
        tps = tokens_per_step(r)
        if completed is not None and tps is not None:
            return max(completed * tps, logged or 0)
    return logged or 0


def data_key(meta: dict[str, Any]) -> str | None:
    """The data a session read, from the statistics the trainer computed on its tokens (module docstring):
    ``"<train>/<val> tokens, unigram <u>"``; None for a record without them (an older trainer's). The
    entropy is kept to 9 significant digits: recomputed elsewhere it may differ in the last bits."""
    n_train, n_val = _whole(meta.get("train_tokens_available")), _whole(meta.get("val_tokens_available"))
    u = meta.get("unigram_entropy")
    if n_train is None or n_val is None or not isinstance(u, (int, float)) or not math.isfinite(u):
        return None
    return f"{n_train:,} train / {n_val:,} val tokens, unigram {u:.9g}"


def data_sha(meta: dict[str, Any]) -> str | None:
    """The first 16 hex digits of the session's ``data_sha256`` (module docstring); None before it was logged.
    Kept apart from :func:`data_key`: a hash one session lacks is unknown, not different, so a run resumed by
    the code that first logged it, or runs of both codes, stay comparable (a key holding it split them)."""
    sha = meta.get("data_sha256")
    return sha[:16] if isinstance(sha, str) and sha else None


def data_keys(r: Logged) -> list[str]:
    """The distinct data fingerprints of the run's sessions, in order (two: resumed on other data)."""
    return list(dict.fromkeys(k for m in (r.metas or [r.meta]) if (k := data_key(m)) is not None))


def tokenizer_key(config: dict[str, Any]) -> str:
    """The tokenizer the config asked for: ``bpe 8192``, ``bytes`` or the tokenizer.json path (a file
    changed under that path shows in the data fingerprint: its token counts change)."""
    data = config.get("data") or {}
    kind = str(data.get("tokenizer", "bpe"))
    return f"bpe {data.get('vocab_size', 8192)}" if kind == "bpe" else kind


def budget(r: Logged) -> tuple[Any, ...]:
    """What makes two runs' losses comparable: steps, tokens per step as trained, the data read and the
    tokenizer (a loss in nats per BPE token is not one in nats per byte)."""
    keys = data_keys(r)
    data = keys[-1] if keys else (r.config.get("data") or {}).get("source")
    return (r.config.get("max_steps"), tokens_per_step(r), data, tokenizer_key(r.config))


def sessions(r: Logged) -> list[dict[str, Any]]:
    """Each session of the run (one per ``meta`` record: the first start and every resume): the step it
    started from, the code and the hardware that ran it, the data it read."""
    return [{"from_step": m.get("step", 0), "code": m.get("code"), "hardware": m.get("hardware"),
             "data": data_key(m), "data_sha256": data_sha(m)} for m in (r.metas or [r.meta])]


def distinct(values: list[Any]) -> list[Any]:
    """The distinct non-None values, in first-seen order (dicts compared by content)."""
    seen: dict[str, Any] = {}
    for v in values:
        if v is not None:
            seen.setdefault(json.dumps(v, sort_keys=True), v)
    return list(seen.values())


def session_values(r: Logged, field: str) -> list[Any]:
    """The distinct recorded values of a session field (``code``, ``hardware``) across the run's sessions."""
    return distinct([s[field] for s in sessions(r)])


def config_changes(r: Logged) -> list[dict[str, Any]]:
    """The config changes the run trained with after a resume (its ``config_changed_on_resume`` events before
    its last train step: one at the last step changed nothing trained), each ``{"step", "fields", "values"}``,
    ``values`` ``{field: [before, after]}`` or None where the trainer logged the names only (before
    2026-12-02). A ``data.source`` changed to another path of the same files (the sessions before and after
    the step record one sha256) is left out: the run read the same data (:func:`_same_data_at`)."""
    last = r.train[-1]["step"] if r.train else 0
    out = []
    for e in r.events:
        if e.get("event") == "config_changed_on_resume" and isinstance(e.get("step"), int) and e["step"] < last:
            fields = [str(f) for f in e.get("fields") or [] if isinstance(f, str)]
            values = e.get("values") if isinstance(e.get("values"), dict) else None
            if "data.source" in fields and _same_data_at(r, e["step"]):
                fields.remove("data.source")
                values = {k: v for k, v in values.items() if k != "data.source"} if values is not None else None
            if fields:
                out.append({"step": e["step"], "fields": fields, "values": values})
    return out


def _same_data_at(r: Logged, step: int) -> bool:
    """Whether the session(s) that resumed at ``step`` read the files the session before them did: one
    recorded sha256, known in each (a session from before the hash was logged: not known to be the same)."""
    ran = sessions(r)
    resumed = [i for i, s in enumerate(ran) if s["from_step"] == step]
    if not resumed or resumed[0] == 0:
        return False
    shas = {ran[i]["data_sha256"] for i in (resumed[0] - 1, *resumed)}
    return len(shas) == 1 and None not in shas


def describe_changes(changes: list[dict[str, Any]], skip: frozenset[str] | set[str] = frozenset()) -> str:
    """``optim.lr 0.01 → 0.05 from step 6; max_steps ... from step 9`` (fields in ``skip`` left out)."""
    parts = []
    for c in changes:
        shown = []
        for f in (f for f in c["fields"] if f not in skip):
            v = (c["values"] or {}).get(f)
            pair = v if isinstance(v, list) and len(v) == 2 else None
            shown.append(f"{f} {json.dumps(pair[0])} → {json.dumps(pair[1])}" if pair else f"{f} (values not logged)")
        if shown:
            parts.append(f"{', '.join(shown)} from step {c['step']}")
    return "; ".join(parts)
