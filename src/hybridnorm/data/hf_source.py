"""``hf:`` sources of :func:`hybridnorm.data.corpus.load_corpus`: a Hugging Face ``datasets`` dataset (needs the
network), or a local file or folder that ``datasets`` reads offline. Kept apart from corpus.py: an optional
dependency, and the one source read through someone else's loader."""

from __future__ import annotations

import os
from pathlib import Path

from hybridnorm.errors import ConfigError

# where a user names the field that holds the text (the error for a missing one says so)
TEXT_FIELD_OPTIONS = "name the text's field with train's --data.text_field or eval's --text-field"


def hf_documents(spec: str, text_field: str, max_docs: int | None,
                 cache_dir: str | Path | None) -> list[str]:
    """The ``text_field`` strings of the ``hf:<spec>`` dataset (``corpus.load_corpus``), at most ``max_docs``."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"data.source='hf:{spec}' needs the datasets package: "
                          f"pip install datasets") from None
    name, _, split = spec.rpartition("@") if "@" in spec else (spec, "", "train")
    # never a dataset's loading script: datasets < 3 ran them unasked; >= 4 ignores a False here
    kwargs: dict[str, object] = {"split": split or "train", "streaming": max_docs is not None,
                                 "trust_remote_code": False}
    if cache_dir is not None:
        kwargs["cache_dir"] = os.fspath(Path(cache_dir) / "hf-datasets")
    local = Path(name)
    if local.is_file():  # hf:<file>: the matching packaged builder reads it offline
        builder = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet", ".csv": "csv"}
        args: tuple[str, ...] = (builder.get(local.suffix, "text"),)
        kwargs["data_files"] = os.fspath(local)
    else:
        args = (name,) if local.is_dir() or ":" not in name else tuple(name.split(":", 1))
    try:
        ds = datasets.load_dataset(*args, **kwargs)
        if text_field not in (ds.column_names or [text_field]):
            raise ConfigError(f"data.source='hf:{spec}' has no column {text_field!r} (columns: "
                              f"{', '.join(map(repr, ds.column_names))}): {TEXT_FIELD_OPTIONS}")
        docs = []
        for i, rec in enumerate(ds):
            if max_docs is not None and len(docs) >= max_docs:
                break
            text = rec.get(text_field)
            if not isinstance(text, str):  # skipped without a word before 2026-12, as a .parquet file's nulls were
                got = "null" if text is None else f"a {type(text).__name__}"
                raise ConfigError(f"data.source='hf:{spec}': row {i} (counted from 0): no string in column "
                                  f"{text_field!r} ({got}): drop those rows (datasets: ds.filter(lambda r: "
                                  f"isinstance(r[{text_field!r}], str))), or {TEXT_FIELD_OPTIONS}")
            docs.append(text)
    except ConfigError:
        raise
    except Exception as e:  # network, missing dataset/config/split: one line, not a traceback
        raise ConfigError(f"data.source='hf:{spec}' could not be loaded: {type(e).__name__}: {e}") from None
    return docs
