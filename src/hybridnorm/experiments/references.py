"""Count-based reference losses on exactly the tokens a study's runs were scored on.

``python -m hybridnorm.experiments.references STUDY_DIR`` reads each finished run's ``point.json`` (data
source, tokenizer, ``seq_len``, and how many validation windows an evaluation scores) and its final val loss,
prepares the same data (the shared token cache), and prints, per group of runs (placement, init, knobs), the
unigram and Kneser-Ney bigram cross-entropies of the validation tokens those runs were scored on beside the
runs' losses. Those tokens are the targets of the first ``eval_windows`` non-overlapping windows of the
validation split (``data.loader.val_batches``: window k predicts tokens k·T+1 .. k·T+T), so the bigram,
which predicts each from the one before it, is taken over ``val[: n·T + 1]``. The trainer's own
``unigram_entropy`` / ``bigram_entropy`` (its meta record, the verdict's baseline) are over the whole split
instead, which can hold other books.

Measurement only: no verdict uses these numbers (``experiments.verdict`` judges against the unigram).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from hybridnorm.data import scored_references
from hybridnorm.errors import ConfigError
from hybridnorm.experiments.runs import read_point, read_report
from hybridnorm.train.config import TrainConfig


@dataclass(frozen=True)
class ScoredReference:
    tokens: int      # validation tokens scored per evaluation
    unigram: float   # nats/token on those tokens, add-one unigram of the training split
    bigram: float    # ... Kneser-Ney bigram of the training split


def scored_reference(config: TrainConfig) -> ScoredReference:
    """The references on the validation tokens that ``config``'s evaluations score (one process's view: the
    same windows for any split of the global batch, ``TrainConfig.eval_windows``)."""
    data = config.data.prepare()  # as the trainer prepares it
    train, val = data.train_tokens(), data.val_tokens()
    windows = min(config.eval_windows, (len(val) - 1) // config.seq_len)
    tokens = windows * config.seq_len
    return ScoredReference(tokens, *scored_references(train, val, tokens, data.tokenizer.vocab_size))


def study_references(study: Path) -> list[dict]:
    """One row per group of finished runs of ``study`` (its runs.json order): the group, its runs' final val
    losses, and the references on the tokens they were scored on."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for rec in read_report(study / "runs.json"):
        if rec.get("done") and rec.get("final_val_loss") is not None:
            groups[(rec["placement"], rec["init"], tuple(sorted((rec.get("knobs") or {}).items())))].append(rec)
    cache: dict[str, ScoredReference] = {}
    rows = []
    for (placement, init, knobs), recs in groups.items():
        config = TrainConfig.from_dict(read_point(study / recs[0]["run"] / "point.json")["config"])
        key = repr((config.data.to_dict(), config.seq_len, config.eval_windows))
        if key not in cache:  # prepared and counted once per data and window setting
            cache[key] = scored_reference(config)
        ref = cache[key]
        rows.append({"placement": placement, "init": init, "knobs": dict(knobs), "reference": ref,
                     "runs": [(r["seed"], r["verdict"], r["final_val_loss"]) for r in recs]})
    return rows


def markdown(rows: list[dict]) -> str:
    """A table a README can hold: each group's per-seed val losses, and how they sit against the bigram."""
    lines = ["| placement | init | knobs | scored tokens | unigram | bigram (KN) | val loss per seed (verdict) "
             "| runs below the bigram |", "|---|---|---|---:|---:|---:|---|---:|"]
    for r in rows:
        ref, runs = r["reference"], sorted(r["runs"])
        knobs = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["knobs"].items())
        per_seed = "; ".join(f"s{s} {v:.3f} ({verdict})" for s, verdict, v in runs)
        below = sum(1 for _, _, v in runs if v < ref.bigram)
        lines.append(f"| `{r['placement']}` | {r['init']} | {knobs} | {ref.tokens:,} | {ref.unigram:.3f} "
                     f"| {ref.bigram:.3f} | {per_seed} | {below} of {len(runs)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path, help="a study folder holding runs.json and runs/")
    args = ap.parse_args(argv)
    try:
        rows = study_references(args.study)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"error: {args.study / 'runs.json'} lists no finished run", file=sys.stderr)
        return 2
    print(markdown(rows))
    bigram = {r["reference"].bigram for r in rows}
    if len(bigram) == 1 and math.isfinite(b := bigram.pop()):
        print(f"\nbigram reference on the scored tokens: {b:.4f} nats")
    return 0


if __name__ == "__main__":
    sys.exit(main())
