"""One call from a source name to memory-mapped train/val tokens, a tokenizer and corpus statistics.

A prepared dataset is a folder ``<cache_dir>/<source key>-<tokenizer key>/`` holding ``tokenizer.json``,
``train.bin``, ``val.bin`` (with sidecars) and ``meta.json``, written last, as the commit marker. For local
sources (the KJV included) the key comes from the files' content (a streamed sha256 of each, read once per
call: ~0.17 s for 100 MB), so a warm call reads the data files once and, of the cache, nothing but
``meta.json`` and the sidecars; ``hf:`` sources are loaded and hashed each time. A ``tokenizer.json`` path
whose tokens an entry of another tokenizer spec already holds (eval's run tokenizer, its trainer's ``-bpeN``)
reads that entry, matched by content and tokenizer fingerprint.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hybridnorm import plain_data
from hybridnorm.data.corpus import KJV_SOURCES, Corpus, SourceDigest, load_corpus, source_digest, source_key
from hybridnorm.data.tokenizer import (
    KINDS,
    ByteTokenizer,
    Tokenizer,
    atomic_write,
    check_vocab_size,
    file_lock,
    load_or_train_bpe,
    load_tokenizer,
    resolve_cache_dir,
)
from hybridnorm.data.tokens import bigram_entropy, open_tokens, tokenize_to_memmap, unigram_entropy
from hybridnorm.errors import ConfigError

FORMAT = "hybridnorm-prepared"
VERSION = 1


@dataclass
class DataStats:
    train_docs: int
    val_docs: int
    train_chars: int
    val_chars: int
    train_tokens: int  # eots included
    val_tokens: int
    unigram_entropy: float  # nats/token of val under the Laplace-smoothed train unigram distribution
    build_seconds: dict[str, float] = field(default_factory=dict)  # of the cold build; {} if unknown
    bigram_entropy: float | None = None  # ... under the Kneser-Ney train bigram (tokens.bigram_entropy)

    @property
    def chars_per_token(self) -> float:
        return self.train_chars / max(1, self.train_tokens - self.train_docs)


@dataclass
class PreparedData:
    source: str
    dir: Path
    tokenizer: Tokenizer
    stats: DataStats
    cached: bool  # True: this call found the folder ready and built nothing
    # what was read: the data files' sha256 (corpus.SourceDigest.sha256; for hf: the documents' hash), which
    # the trainer records; two same-sized files differ here
    data_sha256: str = ""
    # the validation share the hash split aims at (load_corpus's val_fraction); None: a KJV source's fixed books
    val_fraction: float | None = None
    # said beside a loss on this data where it was not read from ``source`` (loading.validation_data)
    found_note: str | None = None
    # said beside a loss on this data where its files are not those the run recorded it trained on
    # (loading.validation_data: the sha256 differs)
    changed_note: str | None = None

    @property
    def train_path(self) -> Path:
        return self.dir / "train.bin"

    @property
    def val_path(self) -> Path:
        return self.dir / "val.bin"

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eot_id(self) -> int:
        return self.tokenizer.eot_id

    def train_tokens(self) -> np.ndarray:
        return open_tokens(self.train_path, self.vocab_size, self.tokenizer.fingerprint)

    def val_tokens(self) -> np.ndarray:
        return open_tokens(self.val_path, self.vocab_size, self.tokenizer.fingerprint)

    def label(self, split: str) -> str:
        """How errors name one split of this data: ``the train split of data.source='x'``."""
        return f"the {split} split of data.source={self.source!r}"

    def short_vocab_note(self, asked: Any) -> str | None:
        """The run log's note when ``asked`` (the train config's data section) is ``tokenizer: bpe`` with more
        tokens than training the BPE on this corpus found merges for: config.yaml keeps the asked
        ``data.vocab_size``, the model follows the tokenizer, and only the header's vocab said so."""
        vocab_size = asked.vocab_size
        if asked.tokenizer != "bpe" or self.vocab_size >= vocab_size:
            return None
        return (f"data.vocab_size={vocab_size}: the BPE tokenizer trained on this corpus has {self.vocab_size} "
                f"tokens (it ran out of pairs to merge); the model's vocabulary is {self.vocab_size}")

    def notes(self, asked: Any) -> list[str]:
        """The run log's ``note:`` lines about this data (``asked``: the train config's data section)."""
        return [note for note in (self.short_vocab_note(asked), self.split_note()) if note]

    def split_note(self) -> str | None:
        """The run log's note when the validation split's share of the text is off ``val_fraction`` by more than
        a factor of 2. Documents go whole to one side (corpus.split_documents), so a source of a few large ones
        can put a third of its text into validation against 5% aimed at, or far less; which side each takes is
        kept (a change would move published validation sets, cache contents and results), and said. A factor 2: half the
        validation asked doubles the val loss's sampling variance, twice takes twice the text asked from
        training; with hundreds of documents the hash split stays well inside it. The tail cut of a source
        none of whose documents hashed into validation (one .txt) takes [1x, 2x) of the asked share: no note.
        From the character counts every cache's meta.json holds: a warm call notes as the cold one did."""
        f, stats = self.val_fraction, self.stats
        total = stats.train_chars + stats.val_chars
        if not f or not total or f / 2 <= stats.val_chars / total <= 2 * f * (1 + 1e-9):  # 1e-9: float rounding
            return None
        tokens = stats.train_tokens + stats.val_tokens
        return (f"validation holds {stats.val_chars / total:.1%} of the text ({stats.val_docs} of "
                f"{stats.train_docs + stats.val_docs} documents, {stats.val_tokens:,} of {tokens:,} tokens), not "
                f"~{f * 100:g}%: a document goes whole to train or validation, and this source has few large ones; "
                f"for a share near {f * 100:g}%, give it more, smaller documents (split its files, or one .jsonl "
                f"record per section)")

    def check_val_windows(self, seq_len: int) -> None:
        """Evaluation scores windows of ``seq_len + 1`` validation tokens: a split without one is refused
        before training (before 2026-12 a run trained to its first evaluation, then stopped there)."""
        if self.stats.val_tokens < seq_len + 1:
            raise ConfigError(f"{self.label('validation')} has {self.stats.val_tokens} "
                              f"tokens ({self.stats.val_docs} document(s); train has {self.stats.train_tokens}), "
                              f"fewer than one window of seq_len+1={seq_len + 1} to evaluate: give a longer "
                              f"data.source (validation is ~5% of a local one) or a smaller seq_len")

    def check_vocab(self, model_vocab_size: int, where: str = "ModelConfig.vocab_size") -> None:
        """A model must have an embedding row for every token id of this data."""
        if model_vocab_size < self.vocab_size:
            raise ConfigError(f"{where}={model_vocab_size} is smaller than the vocab size {self.vocab_size} "
                              f"of the tokenizer {self.dir / 'tokenizer.json'} (vocab mismatch)")


def prepare_data(source: str | os.PathLike = "kjv", tokenizer: str = "bpe", vocab_size: int = 8192,
                 cache_dir: str | Path | None = None, val_fraction: float = 0.05, text_field: str = "text",
                 max_docs: int | None = None) -> PreparedData:
    """Load ``source`` (see :func:`~hybridnorm.data.corpus.load_corpus`), build or reuse its tokenizer
    (``"bpe"`` with ``vocab_size``, ``"bytes"``, or a ``tokenizer.json`` path) and its token files."""
    t0 = time.perf_counter()
    source = os.fspath(source) if isinstance(source, os.PathLike) else source
    user_tok: Tokenizer | None = None
    if tokenizer == "bpe":
        check_vocab_size(vocab_size)
        tok_key = f"bpe{vocab_size}"
    elif tokenizer == "bytes":
        tok_key = "bytes"
    elif isinstance(tokenizer, (str, Path)) and Path(tokenizer).exists():
        user_tok = load_tokenizer(tokenizer)
        # "-bos": documents begin with the tokenizer's own start token (data/tokens.py); a cache built before
        # they did is not reused
        tok_key = f"tok{user_tok.fingerprint[:12]}" + ("-bos" if user_tok.start_id != user_tok.eot_id else "")
    else:
        raise ConfigError(f"data.tokenizer={tokenizer!r} is not one of {', '.join(map(repr, KINDS))} "
                          f"or an existing tokenizer.json path")
    corpus: Corpus | None = None
    digest: SourceDigest | None = None
    if isinstance(source, str):
        digest = source_digest(source, val_fraction, text_field, max_docs)
    if digest is None:  # hf: (or a bad source, which load_corpus reports): hash the documents
        corpus = load_corpus(source, val_fraction, text_field, max_docs, resolve_cache_dir(cache_dir))
        key = data_sha256 = corpus.fingerprint
    else:
        key, data_sha256 = digest.key, digest.sha256
    folder = resolve_cache_dir(cache_dir) / f"{key[:16]}-{tok_key}"
    split_fraction = None if source in KJV_SOURCES else val_fraction  # the KJV's split ignores it
    # a tokenizer.json path (eval passes the run's) whose tokens an entry under another tokenizer spec already
    # holds (the trainer's -bpeN / -bytes one): that entry, not a second tokenization and copy of the corpus.
    # Only where this spec's own folder has none ready: existing entries keep being found under their keys
    if user_tok is not None and not (folder / "meta.json").is_file():
        for file in sorted(folder.parent.glob(f"{key[:16]}-*/meta.json")):
            if (ready := _same_tokens(_read_meta(file), file.parent, source, key, data_sha256, user_tok)) is not None:
                with file_lock(ready.dir):  # meta.json, renamed in last, vouched for it; the lock: _add_bigram
                    return _ready(ready, data_sha256, split_fraction)
    with file_lock(folder):
        ready = _load_ready(folder, source)
        if ready is not None:
            return _ready(ready, data_sha256, split_fraction)
        if not os.access(folder, os.W_OK):  # a read-only cache without this data: said here, not as EROFS mid-build
            raise ConfigError(f"cache folder {folder} does not hold this data prepared and cannot be written "
                              "(read-only): set data.cache_dir or $HYBRIDNORM_CACHE to a writable folder")
        times: dict[str, float] = {}
        t = time.perf_counter()
        if corpus is None:
            corpus = load_corpus(source, val_fraction, text_field, max_docs, digest=digest)
        times["load"] = time.perf_counter() - t
        t = time.perf_counter()
        if tokenizer == "bpe":
            tok = load_or_train_bpe(folder, corpus.train, vocab_size)
        else:
            tok = user_tok or ByteTokenizer()
            tok.save(folder)
        times["tokenizer"] = time.perf_counter() - t
        t = time.perf_counter()
        n_train = tokenize_to_memmap(corpus.train, tok, folder / "train.bin")["count"]
        n_val = tokenize_to_memmap(corpus.val, tok, folder / "val.bin")["count"]
        times["tokenize"] = time.perf_counter() - t
        prepared = PreparedData(source, folder, tok, DataStats(
            len(corpus.train), len(corpus.val), *corpus.chars, int(n_train), int(n_val), float("nan")), False,
            data_sha256, split_fraction)
        t = time.perf_counter()
        prepared.stats.unigram_entropy = unigram_entropy(prepared.train_tokens(), prepared.val_tokens(),
                                                         tok.vocab_size)
        prepared.stats.bigram_entropy = bigram_entropy(prepared.train_tokens(), prepared.val_tokens(),
                                                       tok.vocab_size)
        times["entropy"] = time.perf_counter() - t
        times["total"] = time.perf_counter() - t0
        prepared.stats.build_seconds = {k: round(v, 3) for k, v in times.items()}
        meta = {"format": FORMAT, "version": VERSION, "source": source, "corpus": corpus.name,
                "fingerprint": key, "data_sha256": data_sha256,
                "data_files": list(digest.files) if digest is not None else None,
                "tokenizer": tok.fingerprint, "tokenizer_kind": tok.kind,
                "vocab_size": tok.vocab_size, "corpus_meta": corpus.meta, "stats": asdict(prepared.stats)}
        atomic_write(folder / "meta.json", json.dumps(meta, indent=1))
        return prepared


def find_prepared(source: str, data_sha256: str, tokenizer: Tokenizer, cache_dir: str | Path | None = None,
                  val_fraction: float = 0.05, text_field: str = "text") -> PreparedData | None:
    """The data of ``source`` as :func:`prepare_data` with ``tokenizer`` would give it, found in the cache by
    content where ``source``'s files are not there to read (a run moved to another folder or machine): a ready
    folder whose ``meta.json`` names ``data_sha256`` (what the run recorded it read), ``tokenizer``'s tokens
    and the key its files and these split settings give. None where the cache holds none."""
    try:
        metas = sorted(resolve_cache_dir(cache_dir).glob("*/meta.json"))
    except OSError:
        return None
    for file in metas:
        meta = _read_meta(file)
        try:
            key = source_key(source, meta["data_files"], val_fraction, text_field)
        except (ValueError, KeyError, TypeError):  # not a cache entry of ours, or another's format
            continue
        if (ready := _same_tokens(meta, file.parent, source, key, data_sha256, tokenizer)) is not None:
            ready.data_sha256, ready.val_fraction = data_sha256, val_fraction
            return ready
    return None


def _read_meta(file: Path) -> Any:
    """A cache entry's ``meta.json`` as read (None where it cannot be read or parsed): checked by its reader."""
    try:
        return plain_data.loads(file.read_bytes())
    except (OSError, ValueError):
        return None


def _same_tokens(meta: Any, folder: Path, source: str, key: str, data_sha256: str,
                 tokenizer: Tokenizer) -> PreparedData | None:
    """The ready entry in ``folder`` (``meta``: its ``meta.json``, :func:`_read_meta`) if it holds the tokens
    :func:`prepare_data` of these files (``key``: their content and the split settings; ``data_sha256``) with
    ``tokenizer`` would build, whatever its folder's name says: the same tokenizer by fingerprint, which
    :func:`_load_ready` checks against the ``tokenizer.json`` the folder holds and its token files' sidecars.
    Else None."""
    try:
        if (meta["data_sha256"] != data_sha256 or meta["tokenizer"] != tokenizer.fingerprint
                or meta["fingerprint"] != key):
            return None
    except (KeyError, TypeError):  # not a cache entry of ours, or another's format
        return None
    # a tokenizer whose documents begin with its own start token: only an entry built with it (tok_key's -bos)
    if tokenizer.start_id != tokenizer.eot_id and not folder.name.endswith("-bos"):
        return None
    return _load_ready(folder, source)


def _ready(ready: PreparedData, data_sha256: str, split_fraction: float | None) -> PreparedData:
    """A ready entry as :func:`prepare_data` returns it (the caller holds its folder's lock)."""
    ready.data_sha256, ready.val_fraction = data_sha256, split_fraction
    if ready.stats.bigram_entropy is None:  # a cache from before the bigram reference: added once
        _add_bigram(ready)
    return ready


def _add_bigram(prepared: PreparedData) -> None:
    """Compute the bigram reference of a cache built before it existed, and record it in its ``meta.json``
    (kept in memory only where the cache cannot be written: a read-only one is still used as it is)."""
    prepared.stats.bigram_entropy = bigram_entropy(prepared.train_tokens(), prepared.val_tokens(),
                                                   prepared.tokenizer.vocab_size)
    try:
        meta = plain_data.loads((prepared.dir / "meta.json").read_bytes())
        meta["stats"] = asdict(prepared.stats)
        atomic_write(prepared.dir / "meta.json", json.dumps(meta, indent=1))
    except (OSError, ValueError):
        pass


def _load_ready(folder: Path, source: str) -> PreparedData | None:
    """The prepared data in ``folder`` if ``meta.json`` and every file it vouches for check out, else None
    (nothing built yet, or a damaged cache: the caller rebuilds over it)."""
    try:
        meta = plain_data.loads((folder / "meta.json").read_bytes())
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            return None
        tok = load_tokenizer(folder, vocab_size=meta["vocab_size"])
        if tok.fingerprint != meta["tokenizer"]:
            return None
        prepared = PreparedData(source, folder, tok, DataStats(**meta["stats"]), True)
        for path in (prepared.train_path, prepared.val_path):
            open_tokens(path, tok.vocab_size, tok.fingerprint)
    except (OSError, ValueError, KeyError, TypeError):  # ConfigError and JSONDecodeError are ValueErrors
        return None
    return prepared

