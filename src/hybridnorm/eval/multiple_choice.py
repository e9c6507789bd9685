"""Built-in zero-shot multiple choice: HellaSwag-style JSONL scored exactly as lm-eval's ``multiple_choice``.

One JSON object per line::

    {"context": "And the LORD said unto Moses,", "endings": ["Go in unto Pharaoh.", ...], "label": 0}

(``ctx`` is accepted for ``context``; other fields are ignored). Each ending is scored as the continuation
``" " + ending`` (lm-eval's default ``target_delimiter``) of the context, with :mod:`hybridnorm.eval.scoring`.
``acc`` takes the argmax of the summed log-likelihoods; ``acc_norm`` the argmax of the log-likelihood
divided by the ending's length in characters (without the delimiter) — lm-eval's definition, which
removes the bias toward short endings. Ties go to the first ending, as ``numpy.argmax`` does. Standard
errors are lm-eval's ``mean_stderr`` (sample standard deviation / sqrt(n)).

The same file is the data of the lm-eval task shipped in ``tasks/kjv_mc``, so both paths score the same
items; the tests check that they agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridnorm.data.corpus import jsonl_records
from hybridnorm.data.tokenizer import Tokenizer
from hybridnorm.errors import ConfigError
from hybridnorm.eval.limit import limit_count
from hybridnorm.eval.scoring import RowRule, loglikelihood_text
from hybridnorm.nn.model import TransformerLM
from hybridnorm.train.distributed import Dist
from hybridnorm.train.rank_share import scored_on_ranks

TARGET_DELIMITER = " "  # lm-eval's default target_delimiter between context and choice


@dataclass(frozen=True)
class MCItem:
    context: str
    endings: tuple[str, ...]
    label: int
    line: int = 0  # 1-based line of the source file; 0 when built in memory


@dataclass(frozen=True)
class MCItemResult:
    index: int
    label: int
    loglikelihoods: tuple[float, ...]  # one per ending: sum log p(" " + ending | context)
    pred: int                          # argmax of loglikelihoods
    pred_norm: int                     # argmax of loglikelihoods / len(ending)

    @property
    def correct(self) -> bool:
        return self.pred == self.label

    @property
    def correct_norm(self) -> bool:
        return self.pred_norm == self.label


@dataclass
class MCResult:
    items: list[MCItemResult]
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.items)

    @property
    def acc(self) -> float:
        return _mean([float(r.correct) for r in self.items])

    @property
    def acc_norm(self) -> float:
        return _mean([float(r.correct_norm) for r in self.items])

    @property
    def acc_stderr(self) -> float:
        return mean_stderr([float(r.correct) for r in self.items])

    @property
    def acc_norm_stderr(self) -> float:
        return mean_stderr([float(r.correct_norm) for r in self.items])

    def to_dict(self, per_item: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"source": self.source, "n": self.n, "acc": self.acc, "acc_stderr": self.acc_stderr,
                             "acc_norm": self.acc_norm, "acc_norm_stderr": self.acc_norm_stderr}
        if per_item:
            d["items"] = [{"index": r.index, "label": r.label, "loglikelihoods": list(r.loglikelihoods),
                           "pred": r.pred, "pred_norm": r.pred_norm} for r in self.items]
        return d


def argmax(values: Sequence[float]) -> int:
    """Index of the first maximum (``numpy.argmax``'s tie rule, which lm-eval relies on)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def mean_stderr(xs: Sequence[float]) -> float:
    """lm-eval's ``mean_stderr``: sample standard deviation / sqrt(n); NaN for fewer than 2 values."""
    n = len(xs)
    if n < 2:
        return math.nan
    mu = sum(xs) / n
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1)) / math.sqrt(n)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def parse_item(rec: object, where: str, line: int = 0) -> MCItem:
    """One JSONL record as an :class:`MCItem`; ``where`` ("file:line") names it in every error."""
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    key = "context" if "context" in rec else "ctx" if "ctx" in rec else None
    if key is None:
        raise ConfigError(f"{where}: missing field 'context' (or 'ctx'); fields: {', '.join(map(repr, rec)) or 'none'}")
    if not isinstance(rec[key], str):
        raise ConfigError(f"{where}: field {key!r} must be a string, got {type(rec[key]).__name__}")
    endings = rec.get("endings")
    if endings is None:
        raise ConfigError(f"{where}: missing field 'endings' (a list of strings)")
    if not isinstance(endings, list) or not endings:
        raise ConfigError(f"{where}: field 'endings' must be a non-empty list of strings, got {endings!r:.60}")
    for j, e in enumerate(endings):
        if not isinstance(e, str) or not e:
            raise ConfigError(f"{where}: endings[{j}] must be a non-empty string (acc_norm divides by its "
                              f"length), got {e!r:.60}")
    label = rec.get("label")
    if isinstance(label, str) and label.strip().isdigit():  # HF's hellaswag stores "0".."3"
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool):
        raise ConfigError(f"{where}: field 'label' must be an integer index into endings, got {label!r}")
    if not 0 <= label < len(endings):
        raise ConfigError(f"{where}: label {label} is out of range for {len(endings)} endings")
    return MCItem(rec[key], tuple(endings), label, line)


def read_mc_jsonl(path: str | Path) -> list[MCItem]:
    """Every item of a HellaSwag-style JSONL file; a bad line raises :class:`ConfigError` naming file:line."""
    path = Path(path)
    items = [parse_item(rec, f"{path}:{i}", i) for i, rec in jsonl_records(path, "multiple-choice file")]
    if not items:
        raise ConfigError(f"multiple-choice file {path} holds no items")
    return items


def evaluate_mc(model: TransformerLM, tokenizer: Tokenizer, items: Sequence[MCItem] | str | Path,
                batch_size: int | RowRule = 8, limit: int | float | None = None,
                ranks: Dist | None = None) -> MCResult:
    """Zero-shot ``acc`` / ``acc_norm`` of ``model`` on ``items`` (or a JSONL path); ``limit`` keeps the first
    N items, or a fraction of them rounded up, as lm-eval's ``--limit`` (:mod:`~hybridnorm.eval.limit`). All
    endings of all items go through one batched scoring call. ``ranks``: a joined process group whose ranks
    share the items (each calls this; each gets every item's result)."""
    source = ""
    if isinstance(items, (str, Path)):
        source, items = str(items), read_mc_jsonl(items)
    items = items[:limit_count(len(items), limit)]
    lls_of = scored_on_ranks(lambda share: ending_loglikelihoods(model, tokenizer, share, batch_size), items,
                             ranks or Dist())
    results = []
    for idx, (it, lls) in enumerate(zip(items, lls_of, strict=True)):
        norm = [ll / len(e) for ll, e in zip(lls, it.endings, strict=True)]
        results.append(MCItemResult(idx, it.label, lls, argmax(lls), argmax(norm)))
    return MCResult(results, source)


def ending_loglikelihoods(model: TransformerLM, tokenizer: Tokenizer, items: Sequence[MCItem],
                          batch_size: int | RowRule = 8) -> list[tuple[float, ...]]:
    """Per item, log p(" " + ending | context) of each of its endings (one batched scoring call for all)."""
    pairs = [(it.context, TARGET_DELIMITER + e) for it in items for e in it.endings]
    scores = iter(loglikelihood_text(model, tokenizer, pairs, batch_size))
    return [tuple(next(scores)[0] for _ in it.endings) for it in items]
