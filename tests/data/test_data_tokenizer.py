"""Byte and BPE tokenizers: round trips, vocabulary size, deterministic training, caching, loading."""

from __future__ import annotations

import random

import pytest

from hybridnorm.data import (
    EOT,
    BPETokenizer,
    ByteTokenizer,
    Corpus,
    Tokenizer,
    get_tokenizer,
    load_tokenizer,
    train_bpe,
)
from hybridnorm.data import tokenizer as tokenizer_mod
from hybridnorm.errors import ConfigError

WORDS = "the quick brown fox jumps over lazy dog and cat sat on a mat while birds sing softly".split()


def _texts(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) + "." for _ in range(n)]


UNICODE = "Grüße, 世界! 🙂 naïve café — ÆØÅ \u200b tab\tnewline\n\x00 end"


def test_bytes_round_trips_any_unicode():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    ids = tok.encode(UNICODE)
    assert ids == list(UNICODE.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == UNICODE
    assert tok.decode([*ids, tok.eot_id, *tok.encode("next")]) == UNICODE + EOT + "next"
    assert (tok.vocab_size, tok.eot_id) == (257, 256)
    assert tok.encode_batch(["a", "é"]) == [[97], [195, 169]]


def test_named_tokens_and_stop_token_ids():
    """A vocabulary entry's id both ways (what data.stop_tokens names): the BPE's are its ``tokenizers``
    vocabulary's; the byte tokenizer names only its end-of-text token (a byte is no string)."""
    from hybridnorm.data.tokenizer import stop_token_ids
    from hybridnorm.errors import ConfigError

    bpe = train_bpe(_texts(), vocab_size=300)
    vocab = bpe.hf.get_vocab(with_added_tokens=True)
    assert all(bpe.token_to_id(t) == i and bpe.id_to_token(i) == t for t, i in vocab.items())
    assert bpe.token_to_id("<|not a token|>") is None and bpe.id_to_token(300) is None
    byte = ByteTokenizer()
    assert (byte.token_to_id(EOT), byte.id_to_token(256)) == (256, EOT)
    assert byte.token_to_id("a") is None and byte.id_to_token(97) is None
    some = sorted(vocab)[5:8]
    assert stop_token_ids([*some, some[0]], bpe, "f") == tuple(vocab[t] for t in some)  # once each, in order
    assert stop_token_ids([EOT], byte, "f") == (256,) and stop_token_ids([], byte, "f") == ()
    for tok in (bpe, byte):
        with pytest.raises(ConfigError, match=r"^cfg\.yaml: data\.stop_tokens names 'zz\?', which is not a token"):
            stop_token_ids([EOT, "zz?"], tok, "cfg.yaml")


def test_bpe_round_trips_and_has_the_requested_vocab():
    tok = train_bpe(_texts(), vocab_size=300)
    assert isinstance(tok, BPETokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == 300
    assert tok.eot_id == 0 and tok.hf.id_to_token(0) == EOT
    for text in ("the lazy dog sat.", UNICODE, "  leading spaces and unseen words: xylophone"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < 300 and i != tok.eot_id for i in ids)
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges were learned
    assert tok.encode_batch(["the cat", "a mat"]) == [tok.encode("the cat"), tok.encode("a mat")]


def test_bpe_training_is_deterministic():
    a, b = train_bpe(_texts(), vocab_size=320), train_bpe(iter(_texts()), vocab_size=320)
    assert a.hf.get_vocab() == b.hf.get_vocab()
    assert a.fingerprint == b.fingerprint
    assert train_bpe(_texts(seed=1), vocab_size=320).fingerprint != a.fingerprint


def test_save_and_load(tmp_path):
    bpe = train_bpe(_texts(), vocab_size=300)
    bpe.save(tmp_path / "bpe")
    loaded = load_tokenizer(tmp_path / "bpe")
    assert loaded.fingerprint == bpe.fingerprint and loaded.encode(UNICODE) == bpe.encode(UNICODE)
    ByteTokenizer().save(tmp_path / "bytes")
    assert isinstance(load_tokenizer(tmp_path / "bytes" / "tokenizer.json"), ByteTokenizer)
    with pytest.raises(ConfigError, match=r"tokenizer\.json has vocab size 300, expected 8192"):
        load_tokenizer(tmp_path / "bpe", vocab_size=8192)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"cannot read tokenizer file .*junk\.json"):
        load_tokenizer(tmp_path / "junk.json")


def test_cache_hit_does_not_retrain(tmp_path, monkeypatch):
    corpus = Corpus("toy", _texts(), _texts(20, seed=5))
    first = get_tokenizer(corpus, "bpe", 300, cache_dir=tmp_path)
    assert (tmp_path / f"{corpus.fingerprint[:16]}-bpe300" / "tokenizer.json").is_file()

    def no_training(*args, **kwargs):
        raise AssertionError("retrained despite a cached tokenizer")

    monkeypatch.setattr(tokenizer_mod, "train_bpe", no_training)
    second = get_tokenizer(corpus, "bpe", 300, cache_dir=tmp_path)
    assert second.fingerprint == first.fingerprint
    monkeypatch.setenv("HYBRIDNORM_CACHE", str(tmp_path))
    assert get_tokenizer(corpus, "bpe", 300).fingerprint == first.fingerprint  # default dir from env
    with pytest.raises(AssertionError, match="retrained"):  # another vocab size is another cache entry
        get_tokenizer(corpus, "bpe", 310, cache_dir=tmp_path)


def test_bad_tokenizer_choices(tmp_path):
    corpus = Corpus("toy", _texts(10), [])
    with pytest.raises(ConfigError, match=r"data\.tokenizer='wordpiece' is not one of 'bpe', 'bytes'"):
        get_tokenizer(corpus, "wordpiece", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"data\.vocab_size=100 must be an integer >= 257"):
        get_tokenizer(corpus, "bpe", 100, cache_dir=tmp_path)
    assert isinstance(get_tokenizer(corpus, "bytes"), ByteTokenizer)
