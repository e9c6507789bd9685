"""Memory-mapped token files: exact contents, sidecar checks, and the unigram-entropy reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hybridnorm.data import (
    ByteTokenizer,
    open_tokens,
    read_meta,
    tokenize_to_memmap,
    train_bpe,
    unigram_entropy,
)
from hybridnorm.errors import ConfigError

DOCS = ["first document", "second, with ünïcode 🙂", "", "third\nhas two lines",
        *(f"doc {i}" for i in range(50))]


def test_count_is_encoded_lengths_plus_one_eot_per_doc(tmp_path):
    tok = train_bpe(DOCS * 3, vocab_size=300)
    meta = tokenize_to_memmap(DOCS, tok, tmp_path / "t.bin", chunk_docs=7)  # several chunks
    lengths = [len(tok.encode(d)) for d in DOCS]
    assert meta["count"] == sum(lengths) + len(DOCS)
    arr = open_tokens(tmp_path / "t.bin", vocab_size=300, tokenizer_fingerprint=tok.fingerprint)
    assert isinstance(arr, np.memmap) and arr.dtype == np.uint16 and len(arr) == meta["count"]
    expected = [i for d in DOCS for i in (*tok.encode(d), tok.eot_id)]
    assert arr.tolist() == expected
    assert (tmp_path / "t.bin").stat().st_size == 2 * meta["count"]
    assert not list(tmp_path.glob(".*tmp"))  # no temporaries left behind


def test_truncated_file_is_refused_naming_it(tmp_path):
    tokenize_to_memmap(DOCS, ByteTokenizer(), tmp_path / "t.bin")
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(data[:-3])
    with pytest.raises(ConfigError, match=r"token file .*t\.bin is truncated or corrupt"):
        open_tokens(tmp_path / "t.bin")


def test_sidecar_and_vocab_checks(tmp_path):
    tokenize_to_memmap(DOCS, ByteTokenizer(), tmp_path / "t.bin")
    assert read_meta(tmp_path / "t.bin")["vocab_size"] == 257
    with pytest.raises(ConfigError, match=r"made with vocab size 257, not 8192 \(vocab mismatch"):
        open_tokens(tmp_path / "t.bin", vocab_size=8192)
    with pytest.raises(ConfigError, match="made with a different tokenizer"):
        open_tokens(tmp_path / "t.bin", tokenizer_fingerprint="0" * 64)
    with pytest.raises(ConfigError, match=r"token file .*nope\.bin does not exist"):
        open_tokens(tmp_path / "nope.bin")
    (tmp_path / "t.bin.json").unlink()
    with pytest.raises(ConfigError, match=r"t\.bin: missing or unreadable sidecar t\.bin\.json"):
        open_tokens(tmp_path / "t.bin")


class _BigVocab(ByteTokenizer):
    vocab_size = 70_000
    eot_id = start_id = 69_999


def test_large_vocab_uses_uint32_and_empty_splits_work(tmp_path):
    tokenize_to_memmap(["ab"], _BigVocab(), tmp_path / "big.bin")
    assert open_tokens(tmp_path / "big.bin").tolist() == [97, 98, 69_999]
    assert open_tokens(tmp_path / "big.bin").dtype == np.uint32
    tokenize_to_memmap([], ByteTokenizer(), tmp_path / "empty.bin")
    assert len(open_tokens(tmp_path / "empty.bin")) == 0


def test_unigram_entropy_by_hand():
    train, val = np.array([0, 0, 1], dtype=np.uint16), np.array([0, 1, 2, 2], dtype=np.uint16)
    # add-one counts over a vocab of 4: [3, 2, 1, 1] / 7
    expected = -(math.log(3 / 7) + math.log(2 / 7) + 2 * math.log(1 / 7)) / 4
    assert unigram_entropy(train, val, vocab_size=4) == pytest.approx(expected, rel=1e-12)
    uniform = unigram_entropy(np.zeros(0, dtype=np.uint16), val, vocab_size=4)
    assert uniform == pytest.approx(math.log(4))
