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


BIGRAM_DISCOUNT = 0.75         # Kneser–Ney's absolute discount (Chen & Goodman's usual single D)
BIGRAM_FIT_TOKENS = 2**25      # the bigram is counted on at most this many training tokens (at the cap: ~4 s, ~2 GB)


def bigram_entropy(train: np.ndarray, val: np.ndarray, vocab_size: int,
                   discount: float = BIGRAM_DISCOUNT) -> float:
    """Cross-entropy (nats/token) of ``val`` under an interpolated Kneser–Ney bigram model counted on ``train``
    (its first :data:`BIGRAM_FIT_TOKENS` tokens): the loss a model that sees one token of context reaches
    without learning anything else, a reference between the unigram floor and a trained LM.

    P(w | h) = max(c(h, w) - D, 0) / c(h) + D · N(h •) / c(h) · P_cont(w) for a history h seen in training
    (c(h) its count as a history, N(h •) the number of distinct tokens that followed it), P_cont(w) for an
    unseen one; P_cont(w) = (N(• w) + 1) / (Σ N(• w') + V), the number of distinct tokens w followed, add-one
    smoothed so that a token never seen after another keeps some probability. Each val token but the first
    is predicted from the one before it, across document separators as the LM's windows do."""
    train = np.asarray(train[:BIGRAM_FIT_TOKENS], dtype=np.int64)
    val = np.asarray(val, dtype=np.int64)
    if len(val) < 2:
        return float("nan")
    V = vocab_size
    pairs, count = np.unique(train[:-1] * V + train[1:], return_counts=True)  # sorted distinct (h, w) codes
    hist, nxt = pairs // V, pairs % V
    followers = np.bincount(nxt, minlength=V)[:V].astype(np.float64)            # N(• w)
    p_cont = (followers + 1) / (followers.sum() + V)
    c_h = np.bincount(hist, weights=count, minlength=V)[:V]                      # c(h)
    n_h = np.bincount(hist, minlength=V)[:V].astype(np.float64)                  # N(h •)
    h, w = val[:-1], val[1:]
    codes = h * V + w
    at = np.clip(np.searchsorted(pairs, codes), 0, max(len(pairs) - 1, 0))
    c_hw = np.where(pairs[at] == codes, count[at], 0) if len(pairs) else np.zeros(len(codes))
    seen, ch = c_h[h] > 0, np.maximum(c_h[h], 1)
    p = np.where(seen, np.maximum(c_hw - discount, 0) / ch + discount * n_h[h] / ch * p_cont[w], p_cont[w])
    return float(-np.log(p).mean())


def scored_references(train: np.ndarray, val: np.ndarray, tokens: int, vocab_size: int) -> tuple[float, float]:
    """(unigram, bigram) cross-entropies of the first ``tokens`` targets of windows laid from the start of
    ``val`` (``data.loader.val_batches``: targets ``val[1 : tokens + 1]``, each bigram conditioned on the token
    before it): the references on exactly the tokens a validation loss scored."""
    return (unigram_entropy(train, val[1:tokens + 1], vocab_size),
            bigram_entropy(train, val[:tokens + 1], vocab_size))
