"""The built-in multiple-choice evaluator against a hand computation, and its file errors."""

from __future__ import annotations

import math

import pytest
from eval_helpers import naive_pair, write_jsonl

from hybridnorm.errors import ConfigError
from hybridnorm.eval.multiple_choice import argmax, evaluate_mc, mean_stderr, read_mc_jsonl

# Endings of very different lengths: the summed log-likelihood favours short ones, the per-character one
# does not, so acc and acc_norm can pick different endings.
QUESTIONS = [
    {"context": "The lord said", "endings": ["unto moses and aaron", "go", "by day and by night"], "label": 1},
    {"ctx": "And the river", "endings": ["ran dry", "x", "was built upon a hill"], "label": 2},
    {"context": "Milk and", "endings": ["honey", "qz", "the people shall keep my law"], "label": 0, "id": 7},
]


def _oracle(model, questions):
    """Each ending's log-likelihood from one plain forward of [EOT] + context + " " + ending (bytes)."""
    per_item = []
    for q in questions:
        ctx = [256, *(q.get("context", q.get("ctx"))).encode()]
        per_item.append([naive_pair(model, ctx, list((" " + e).encode()))[0] for e in q["endings"]])
    preds = [max(range(len(lls)), key=lambda i: lls[i]) for lls in per_item]
    preds_norm = [max(range(len(lls)), key=lambda i: lls[i] / len(q["endings"][i]))
                  for lls, q in zip(per_item, questions, strict=True)]
    acc = sum(p == q["label"] for p, q in zip(preds, questions, strict=True)) / len(questions)
    acc_norm = sum(p == q["label"] for p, q in zip(preds_norm, questions, strict=True)) / len(questions)
    return per_item, preds, preds_norm, acc, acc_norm


def test_mc_equals_a_hand_computation(model, tok, tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    per_item, preds, preds_norm, acc, acc_norm = _oracle(model, QUESTIONS)
    assert acc != acc_norm, "the questions no longer separate acc from acc_norm: pick other endings"
    res = evaluate_mc(model, tok, path, batch_size=4)
    assert res.n == 3 and res.source == str(path)
    for r, lls, p, pn, q in zip(res.items, per_item, preds, preds_norm, QUESTIONS, strict=True):
        assert list(r.loglikelihoods) == pytest.approx(lls, rel=1e-5, abs=1e-5)
        assert (r.pred, r.pred_norm, r.label) == (p, pn, q["label"])
    assert (res.acc, res.acc_norm) == (acc, acc_norm)
    hits = [float(p == q["label"]) for p, q in zip(preds, QUESTIONS, strict=True)]
    mu = sum(hits) / 3
    assert res.acc_stderr == pytest.approx(math.sqrt(sum((h - mu) ** 2 for h in hits) / 2) / math.sqrt(3))
    d = res.to_dict(per_item=True)
    assert d["acc_norm"] == acc_norm and [it["pred_norm"] for it in d["items"]] == preds_norm
    assert evaluate_mc(model, tok, path, batch_size=1, limit=2).n == 2


def test_argmax_ties_go_to_the_first_and_stderr_is_lm_evals():
    assert argmax([1.0, 3.0, 3.0, 2.0]) == 1
    assert mean_stderr([1.0, 0.0, 1.0, 1.0]) == pytest.approx(0.25)  # sample std 0.5 / sqrt(4)
    assert math.isnan(mean_stderr([1.0]))


def test_reader_accepts_ctx_string_labels_and_blank_lines(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text('{"ctx": "a", "endings": ["b", "c"], "label": "1", "extra": 3}\n\n'
                    '{"context": "d", "endings": ["e"], "label": 0}\n', encoding="utf-8")
    items = read_mc_jsonl(path)
    assert [(i.context, i.endings, i.label, i.line) for i in items] == [("a", ("b", "c"), 1, 1), ("d", ("e",), 0, 3)]


BAD = {
    "bad json": ('{"context": "a", "endings": ["b"], "label": 0}\n{"context": "a",\n', [":2:", "not valid JSON"]),
    "missing field": ('{"context": "a", "label": 0}\n', [":1:", "'endings'"]),
    "missing context": ('{"endings": ["b"], "label": 0}\n', [":1:", "'context'", "'ctx'"]),
    "label out of range": ('{"context": "a", "endings": ["b", "c"], "label": 2}\n', [":1:", "label 2", "2 endings"]),
    "empty endings": ('{"context": "a", "endings": [], "label": 0}\n', [":1:", "non-empty list"]),
    "empty ending": ('{"context": "a", "endings": ["b", ""], "label": 0}\n', [":1:", "endings[1]"]),
    "bool label": ('{"context": "a", "endings": ["b"], "label": true}\n', [":1:", "'label'"]),
    "not an object": ('[1, 2]\n', [":1:", "JSON object"]),
    "empty file": ("\n\n", ["holds no items"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_files_name_the_file_and_line(case, tmp_path):
    text, needles = BAD[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        read_mc_jsonl(path)
    assert str(path) in str(e.value)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_missing_and_non_utf8_files(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read multiple-choice file .*nope\.jsonl"):
        read_mc_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes('{"context": "café"}'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.jsonl is not UTF-8"):
        read_mc_jsonl(tmp_path / "latin1.jsonl")
