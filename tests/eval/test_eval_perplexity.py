"""Document perplexity: token perplexity, bits per byte and word perplexity against a hand computation
(lm-eval's wikitext definitions), and where the documents come from."""

from __future__ import annotations

import math

import pytest
from eval_helpers import naive_pair, write_jsonl

from hybridnorm.data import KJV_VAL_BOOKS
from hybridnorm.errors import ConfigError
from hybridnorm.eval.perplexity import count_words, perplexity, perplexity_of_run, read_documents
from hybridnorm.eval.scoring import loglikelihood_rolling
from hybridnorm.loading import load_run

DOCS = ["the lord said unto moses.", " milk  and honey\n", "café au lait"]
# by hand: words are the pieces between whitespace runs, so the leading and trailing space of the second
# document each add an empty piece; bytes are UTF-8 bytes (é is two)
WORDS, BYTES = [5, 5, 3], [25, 17, 13]


def test_definitions_match_a_hand_computation(model, tok):
    lls = [naive_pair(model, [256], list(d.encode()))[0] for d in DOCS]  # short: one plain forward each
    res = perplexity(model, tok, DOCS, batch_size=2, source="three docs")
    assert (res.n_docs, res.n_tokens, res.n_bytes, res.n_words) == (3, sum(BYTES), sum(BYTES), sum(WORDS))
    assert res.loglikelihood == pytest.approx(sum(lls), rel=1e-6)
    total = sum(lls)
    assert res.token_perplexity == pytest.approx(math.exp(-total / sum(BYTES)), rel=1e-6)  # bytes are tokens here
    assert res.bits_per_byte == pytest.approx(-total / sum(BYTES) / math.log(2), rel=1e-6)
    assert res.byte_perplexity == pytest.approx(2 ** res.bits_per_byte, rel=1e-6)
    assert res.word_perplexity == pytest.approx(math.exp(-total / sum(WORDS)), rel=1e-6)
    assert [count_words(d) for d in DOCS] == WORDS
    d = res.to_dict()
    assert d["bits_per_byte"] == res.bits_per_byte and d["source"] == "three docs"


def test_aggregation_agrees_with_lm_evals_metric_functions(model, tok):
    metrics = pytest.importorskip("lm_eval.api.metrics", reason="lm_eval is not installed (pip install "
                                                                "'hybridnorm[eval]')")
    res = perplexity(model, tok, DOCS)
    lls = loglikelihood_rolling(model, tok.encode_batch(DOCS), tok.eot_id)
    assert res.bits_per_byte == pytest.approx(metrics.bits_per_byte(list(zip(lls, BYTES, strict=True))), rel=1e-9)
    assert res.word_perplexity == pytest.approx(metrics.weighted_perplexity(list(zip(lls, WORDS, strict=True))),
                                                rel=1e-9)


def test_long_documents_use_the_rolling_scorer(model, tok):
    doc = "the people shall keep my law by day and by night, behold the river ran dry " * 3
    assert len(doc) > 3 * model.config.max_seq_len
    res = perplexity(model, tok, [doc])
    assert res.n_tokens == len(doc)
    assert res.loglikelihood == pytest.approx(loglikelihood_rolling(model, [list(doc.encode())], 256)[0])


def test_documents_of_files_folders_and_kjv(tmp_path):
    (tmp_path / "a.txt").write_text("one whole document\nwith two lines\n", encoding="utf-8")
    write_jsonl(tmp_path / "b.jsonl", [{"text": "first"}, {"text": "  "}, {"text": "third"}])
    assert read_documents(tmp_path / "a.txt") == ["one whole document\nwith two lines\n"]
    assert read_documents(tmp_path / "b.jsonl") == ["first", "third"]  # blank documents are skipped
    assert read_documents(tmp_path) == ["one whole document\nwith two lines\n", "first", "third"]
    assert read_documents(tmp_path / "b.jsonl", max_docs=1) == ["first"]
    kjv = read_documents("kjv", max_docs=3)
    assert len(kjv) == 3 and kjv[0].startswith(f"{KJV_VAL_BOOKS[0]} 1\n")  # the held-out books only
    with pytest.raises(ConfigError, match=r"nope\.txt"):
        read_documents(tmp_path / "nope.txt")
    with pytest.raises(ConfigError, match="no documents"):
        perplexity(None, None, [])


def test_perplexity_of_a_run(run_dir, tmp_path, model, tok):
    (tmp_path / "t.txt").write_text(DOCS[0], encoding="utf-8")
    res = perplexity_of_run(load_run(run_dir), tmp_path / "t.txt")
    assert res.loglikelihood == pytest.approx(perplexity(model, tok, DOCS[:1]).loglikelihood, rel=1e-6)
    assert res.source == str(tmp_path / "t.txt")
