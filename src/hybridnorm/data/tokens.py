"""Tokenized text as flat memory-mapped files: ``<name>.bin`` plus a ``<name>.bin.json`` sidecar.

The ``.bin`` holds every document's ids followed by ``<|endoftext|>``, as uint16 (uint32 when the
vocabulary exceeds 65536). The sidecar records dtype, token count, vocabulary size and the tokenizer's
fingerprint, so :func:`open_tokens` refuses a truncated file or data made by another tokenizer instead of
training on garbage. Both files are written to temporaries and renamed into place: a crash never leaves a
half-written file under the final name.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hybridnorm import plain_data
from hybridnorm.data.tokenizer import Tokenizer, atomic_file, atomic_write
from hybridnorm.errors import ConfigError

FORMAT = "hybridnorm-tokens"
VERSION = 1
DTYPES: tuple[str, ...] = ("uint16", "uint32")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def sidecar_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


def tokenize_to_memmap(docs: Sequence[str], tokenizer: Tokenizer, path: str | Path,
                       chunk_docs: int = 512) -> dict[str, object]:
    """Encode ``docs`` (``encode_batch`` per chunk, so memory stays at one chunk) into ``path``; returns
    the sidecar dict (its ``count`` = sum of encoded lengths + one eot per document). Each document ends
    with the eot; where the tokenizer's start token is another (a BOS its post-processor adds), each also
    begins with that, as the model is prompted and scored (``Tokenizer.start_id``)."""
    path = Path(path)
    dtype = token_dtype(tokenizer.vocab_size)
    head = () if tokenizer.start_id == tokenizer.eot_id else (tokenizer.start_id,)
    count = 0
    with atomic_file(path, "wb") as f:
        for lo in range(0, len(docs), chunk_docs):
            encoded = tokenizer.encode_batch(docs[lo:lo + chunk_docs])
            flat = np.fromiter((i for ids in encoded for i in (*head, *ids, tokenizer.eot_id)), dtype=np.int64,
                               count=sum(map(len, encoded)) + len(encoded) * (1 + len(head)))
            if flat.size and (flat.min() < 0 or flat.max() >= tokenizer.vocab_size):
                raise ConfigError(f"tokenizer produced id {int(flat.max())} outside its vocab size "
                                  f"{tokenizer.vocab_size} while writing {path}")
            flat.astype(dtype).tofile(f)
            count += flat.size
    meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "count": count,
            "docs": len(docs), "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
            "tokenizer": tokenizer.fingerprint}
    atomic_write(sidecar_path(path), json.dumps(meta, indent=1))
    return meta


def read_meta(path: str | Path) -> dict[str, object]:
    """The sidecar of ``path``, checked against the ``.bin`` file's size."""
    path, side = Path(path), sidecar_path(path)
    if not path.is_file():
        raise ConfigError(f"token file {path} does not exist")
    try:
        meta = plain_data.loads(side.read_bytes())
    except (OSError, ValueError) as e:
        raise ConfigError(f"token file {path}: missing or unreadable sidecar {side.name} ({e}); "
                          f"delete the folder to rebuild it") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("dtype") not in DTYPES:
        raise ConfigError(f"token file {path}: {side.name} is not a {FORMAT} sidecar with dtype in {DTYPES}")
    if meta.get("version") != VERSION:
        raise ConfigError(f"token file {path}: format version {meta.get('version')}, "
                          f"this code reads {VERSION}")
    expected = int(meta["count"]) * np.dtype(meta["dtype"]).itemsize
    size = path.stat().st_size
    if size != expected:
        raise ConfigError(f"token file {path} is truncated or corrupt: {size} bytes, but its sidecar says "
                          f"{meta['count']} {meta['dtype']} tokens ({expected} bytes); delete it to rebuild")
    return meta


def open_tokens(path: str | Path, vocab_size: int | None = None,
                tokenizer_fingerprint: str | None = None) -> np.ndarray:
    """A read-only memmap of ``path`` after :func:`read_meta`'s checks; with ``vocab_size`` or
    ``tokenizer_fingerprint`` given, data made with another tokenizer is refused."""
    meta = read_meta(path)
    if vocab_size is not None and meta["vocab_size"] != vocab_size:
        raise ConfigError(f"token file {path} was made with vocab size {meta['vocab_size']}, "
                          f"not {vocab_size} (vocab mismatch: use the tokenizer saved next to it)")
    if tokenizer_fingerprint is not None and meta["tokenizer"] != tokenizer_fingerprint:
        raise ConfigError(f"token file {path} was made with a different tokenizer "
                          f"({str(meta['tokenizer'])[:12]}, not {tokenizer_fingerprint[:12]})")
    if meta["count"] == 0:  # numpy cannot map an empty file
        return np.zeros(0, dtype=meta["dtype"])
    return np.memmap(path, dtype=meta["dtype"], mode="r", shape=(int(meta["count"]),))


def unigram_entropy(train: np.ndarray, val: np.ndarray, vocab_size: int, alpha: float = 1.0) -> float:
    """Cross-entropy (nats/token) of ``val`` under the add-``alpha`` unigram distribution of ``train``:
    the loss of a model that ignores context, the floor a trained LM should fall far below."""
    if len(val) == 0:
        return float("nan")
    counts = np.bincount(np.asarray(train), minlength=vocab_size)[:vocab_size].astype(np.float64) + alpha
    logp = np.log(counts) - np.log(counts.sum())
    val_counts = np.bincount(np.asarray(val), minlength=vocab_size)[:vocab_size]
    return float(-(val_counts * logp).sum() / len(val))
