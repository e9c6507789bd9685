"""Memory-mapped token files: exact contents, sidecar checks, and the unigram and bigram references."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hybridnorm.data import (
    ByteTokenizer,
    bigram_entropy,
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


def _kneser_ney_by_hand(train: list[int], val: list[int], V: int, D: float = 0.75) -> tuple[float, list[float]]:
    """The interpolated Kneser-Ney bigram of ``bigram_entropy``'s docstring, with dicts and loops: its
    cross-entropy on ``val`` and, for every history, the sum of P(w | h) over the vocabulary."""
    pair: dict[tuple[int, int], int] = {}
    for h, w in itertools.pairwise(train):
        pair[h, w] = pair.get((h, w), 0) + 1
    c_h = {h: sum(k for (a, _), k in pair.items() if a == h) for h in range(V)}
    n_h = {h: sum(1 for (a, _) in pair if a == h) for h in range(V)}
    before = {w: sum(1 for (_, b) in pair if b == w) for w in range(V)}
    total = sum(before.values())

    def p(h: int, w: int) -> float:
        cont = (before[w] + 1) / (total + V)
        if c_h[h] == 0:
            return cont
        return max(pair.get((h, w), 0) - D, 0) / c_h[h] + D * n_h[h] / c_h[h] * cont

    loss = -sum(math.log(p(h, w)) for h, w in itertools.pairwise(val)) / (len(val) - 1)
    return loss, [sum(p(h, w) for w in range(V)) for h in range(V)]


@pytest.mark.parametrize("V,seed", [(2, 0), (7, 1), (31, 2)])
def test_bigram_entropy_against_the_equation_by_hand(V: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    train = rng.integers(0, max(V - 2, 1), 400)  # the top ids never occur in training: unseen histories/tokens
    val = rng.integers(0, V, 90)
    want, sums = _kneser_ney_by_hand(train.tolist(), val.tolist(), V)
    assert sums == pytest.approx([1.0] * V, abs=1e-12)  # a distribution for every history
    assert bigram_entropy(train.astype(np.uint16), val.astype(np.uint16), V) == pytest.approx(want, rel=1e-12)


def test_bigram_entropy_edges_and_its_reach(monkeypatch) -> None:
    val = np.array([0, 1, 0, 1, 0, 1], dtype=np.uint16)
    assert math.isnan(bigram_entropy(val, val[:1], 2))  # no pair to predict
    assert bigram_entropy(np.zeros(0, dtype=np.uint16), val, 4) == pytest.approx(math.log(4))  # nothing counted
    # an alternating sequence is all but certain after one token of context; the unigram sees a coin
    assert bigram_entropy(np.tile(val, 50), val, 2) < 0.05 < math.log(2) - 0.01 < unigram_entropy(val, val, 2)
    import hybridnorm.data.tokens as tokens

    monkeypatch.setattr(tokens, "BIGRAM_FIT_TOKENS", 3)  # counted on the first three tokens only
    assert bigram_entropy(np.array([0, 1, 0, 0, 0, 0, 0], dtype=np.uint16), val, 2) == pytest.approx(
        _kneser_ney_by_hand([0, 1, 0], val.tolist(), 2)[0], rel=1e-12)
