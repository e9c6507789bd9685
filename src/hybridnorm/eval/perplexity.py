"""Perplexity of a model on whole documents, with lm-eval's wikitext metrics.

Each document is scored on its own with the rolling scorer (:func:`~hybridnorm.eval.scoring.
loglikelihood_rolling`: conditioned on the start token only, every token predicted once, each window with as
much preceding text of the same document as fits). Unlike the training loss (``train/load.evaluate_run``:
fixed ``seq_len`` windows cut from the concatenated token stream, documents bleeding into each other), the
numbers here do not depend on the tokenizer or the window, except ``token_perplexity``:

* ``token_perplexity`` = exp(−Σ log p / Σ tokens) — only comparable between models sharing a tokenizer;
* ``bits_per_byte``    = −Σ log p / Σ UTF-8 bytes / ln 2 (lm-eval's ``bits_per_byte``);
* ``byte_perplexity``  = exp(−Σ log p / Σ bytes);
* ``word_perplexity``  = exp(−Σ log p / Σ words), words counted as ``len(re.split(r"\\s+", doc))`` on the
  raw document (lm-eval's ``count_words``, which wikitext also uses).

Sums run over all documents before the division (lm-eval's ``weighted_perplexity``): a corpus-level
number, not a mean of per-document perplexities.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridnorm.data.corpus import SUFFIXES, data_suffix, for_option, load_corpus, read_text
from hybridnorm.data.tokenizer import Tokenizer
from hybridnorm.errors import ConfigError
from hybridnorm.eval.scoring import RowRule, loglikelihood_rolling
from hybridnorm.nn.model import TransformerLM
from hybridnorm.train.distributed import Dist
from hybridnorm.train.rank_share import scored_on_ranks

if TYPE_CHECKING:
    from hybridnorm.loading import Run


# the largest x whose exp(x) is a finite float64 (math.exp raises OverflowError past it)
_MAX_EXP = math.log(sys.float_info.max)


def perplexity_of_nll(mean_nll: float) -> float:
    """exp(mean negative log-likelihood): ``inf`` where that passes the largest float (a loss over ~709.78
    nats, as a model trained at a far too large learning rate scores), where ``math.exp`` raised
    ``OverflowError``; NaN stays NaN."""
    return math.exp(mean_nll) if not mean_nll > _MAX_EXP else math.inf


@dataclass(frozen=True)
class PerplexityResult:
    source: str
    n_docs: int
    n_tokens: int
    n_bytes: int
    n_words: int
    loglikelihood: float  # Σ log p over all documents, in nats

    @property
    def token_perplexity(self) -> float:
        return perplexity_of_nll(-self.loglikelihood / self.n_tokens) if self.n_tokens else math.nan

    @property
    def bits_per_byte(self) -> float:
        return -self.loglikelihood / self.n_bytes / math.log(2) if self.n_bytes else math.nan

    @property
    def byte_perplexity(self) -> float:
        return perplexity_of_nll(-self.loglikelihood / self.n_bytes) if self.n_bytes else math.nan

    @property
    def word_perplexity(self) -> float:
        return perplexity_of_nll(-self.loglikelihood / self.n_words) if self.n_words else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "n_docs": self.n_docs, "n_tokens": self.n_tokens, "n_bytes": self.n_bytes,
                "n_words": self.n_words, "loglikelihood": self.loglikelihood,
                "token_perplexity": self.token_perplexity, "bits_per_byte": self.bits_per_byte,
                "byte_perplexity": self.byte_perplexity, "word_perplexity": self.word_perplexity}


def count_words(text: str) -> int:
    """lm-eval's ``count_words``: pieces between runs of whitespace (so leading/trailing space adds one)."""
    return len(re.split(r"\s+", text))


def count_bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def perplexity(model: TransformerLM, tokenizer: Tokenizer, docs: Sequence[str], batch_size: int | RowRule = 8,
               source: str = "", ranks: Dist | None = None) -> PerplexityResult:
    """Token perplexity, bits per byte and word perplexity of ``model`` over ``docs`` (each scored alone).
    ``ranks``: a joined process group whose ranks share the documents (each calls this; each gets the result)."""
    if not docs:
        raise ConfigError(f"no documents to score{f' in {source}' if source else ''}")
    tokens = tokenizer.encode_batch(list(docs))
    rows = scored_on_ranks(lambda share: [(ll,) for ll in loglikelihood_rolling(model, share, tokenizer.start_id,
                                                                                  batch_size)], tokens, ranks or Dist())
    lls = [ll for (ll,) in rows]
    return PerplexityResult(source, len(docs), sum(map(len, tokens)), sum(map(count_bytes, docs)),
                            sum(map(count_words, docs)), math.fsum(lls))


def read_documents(source: str | Path, text_field: str = "text", max_docs: int | None = None) -> list[str]:
    """The documents to score: all of a ``.txt`` file (one document), a ``.jsonl`` file (one per record,
    field ``text_field``), a ``.parquet`` file or a folder of those (the corpus reader of training, so
    the same errors); any other file is one UTF-8 text document (``README.md``); for ``"kjv"`` its
    held-out validation books, one document per chapter."""
    source = str(source)
    if max_docs is not None and max_docs < 1:
        raise ConfigError(f"max_docs={max_docs} must be >= 1")
    if source == "kjv":
        return load_corpus("kjv").val[:max_docs]
    path = Path(source)
    if path.is_file() and data_suffix(path) not in SUFFIXES:
        text = read_text(path)
        return [text] if text.strip() else []
    try:
        return load_corpus(source, val_fraction=0.0, text_field=text_field, max_docs=max_docs).train
    except ConfigError as e:  # the corpus reader names training's field; these are the documents --text names
        raise for_option(e, source, "--text") from None


def perplexity_of_run(run: Run, source: str | Path, batch_size: int | RowRule = 8, text_field: str = "text",
                      max_docs: int | None = None, ranks: Dist | None = None) -> PerplexityResult:
    """:func:`perplexity` of a loaded run on the documents of ``source`` (see :func:`read_documents`)."""
    docs = read_documents(source, text_field, max_docs)
    return perplexity(run.model, run.tokenizer, docs, batch_size, source=str(source), ranks=ranks)
