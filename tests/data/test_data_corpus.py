"""Corpus sources: the embedded KJV, local txt/jsonl/parquet files and folders, hf:, and their errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hybridnorm.data import KJV_VAL_BOOKS, kjv_path, load_corpus, source_fingerprint
from hybridnorm.data.corpus import split_documents
from hybridnorm.errors import ConfigError


def _book(doc: str) -> str:
    return doc.split("\n", 1)[0].rsplit(" ", 1)[0]  # header "1 Peter 3" -> "1 Peter"


def test_kjv_loads_with_whole_books_held_out():
    assert kjv_path().name == "kjv.jsonl"
    c = load_corpus("kjv")
    train_chars, val_chars = c.chars
    assert 4.0e6 < train_chars + val_chars < 4.3e6
    assert 0.04 < val_chars / (train_chars + val_chars) < 0.06
    train_books, val_books = {_book(d) for d in c.train}, {_book(d) for d in c.val}
    assert val_books == set(KJV_VAL_BOOKS)
    assert not train_books & val_books
    assert len(train_books) + len(val_books) == 66
    assert len(c.train) + len(c.val) == 1189  # chapters
    assert c.train[0].startswith("Genesis 1\nIn the beginning God created the heaven and the earth.\n")
    again = load_corpus("kjv")
    assert (again.train, again.val, again.fingerprint) == (c.train, c.val, c.fingerprint)


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    return _write(path, "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))


DOCS = [f"document number {i}: " + " ".join(f"w{(i * 7 + j) % 13}" for j in range(40)) for i in range(200)]


def test_jsonl_hash_split_is_deterministic_and_partitions(tmp_path):
    c = load_corpus(_jsonl(tmp_path / "a.jsonl", DOCS), val_fraction=0.1)
    assert sorted(c.train + c.val) == sorted(DOCS)
    assert 5 <= len(c.val) <= 40  # ~20 expected
    c2 = load_corpus(str(tmp_path / "a.jsonl"), val_fraction=0.1)
    assert (c2.train, c2.val, c2.fingerprint) == (c.train, c.val, c.fingerprint)
    # a document's side depends on its own text only: order and neighbours do not matter
    c3 = load_corpus(_jsonl(tmp_path / "b.jsonl", DOCS[::-1]), val_fraction=0.1)
    assert set(c3.val) == set(c.val)


def test_text_field_and_max_docs(tmp_path):
    c = load_corpus(_jsonl(tmp_path / "a.jsonl", DOCS, field="content"), text_field="content", max_docs=50)
    assert len(c.train) + len(c.val) == 50
    assert set(c.train + c.val) == set(DOCS[:50])


def test_single_txt_gets_a_tail_split(tmp_path):
    text = "".join(f"line {i} of the only file\n" for i in range(1000))
    c = load_corpus(_write(tmp_path / "one.txt", text), val_fraction=0.05)
    assert len(c.train) == len(c.val) == 1
    assert c.train[0] + c.val[0] == text
    assert c.val[0].startswith("line ") and 0.04 < len(c.val[0]) / len(text) < 0.07


def test_folder_is_sorted_recursive_and_mixed(tmp_path):
    _write(tmp_path / "d" / "b.txt", "bee text\r\nsecond line")
    _write(tmp_path / "d" / "a" / "z.txt", "\ufeffzed text")
    _jsonl(tmp_path / "d" / "c.jsonl", ["from jsonl one", "from jsonl two"])
    _write(tmp_path / "d" / ".hidden" / "x.txt", "hidden")
    _write(tmp_path / "d" / "notes.md", "ignored")
    c = load_corpus(tmp_path / "d", val_fraction=0.0)
    assert c.train == ["zed text", "bee text\nsecond line", "from jsonl one", "from jsonl two"]
    assert c.val == []


def test_fingerprint_tracks_file_changes(tmp_path):
    f = _write(tmp_path / "a.txt", "some text\n" * 50)
    before = source_fingerprint(str(f))
    assert source_fingerprint(str(f)) == before
    _write(f, "other text\n" * 50)
    assert source_fingerprint(str(f)) != before
    assert source_fingerprint(str(f), val_fraction=0.2) != source_fingerprint(str(f))


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: parquet sources are optional")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS[:30], "n": list(range(30))}), tmp_path / "a.parquet")
    c = load_corpus(tmp_path / "a.parquet", val_fraction=0.2)
    assert sorted(c.train + c.val) == sorted(DOCS[:30])
    with pytest.raises(ConfigError, match=r"a\.parquet.*no column.*'body'.*'text', 'n'"):
        load_corpus(tmp_path / "a.parquet", text_field="body")


def test_blank_texts_are_left_out_alike_from_jsonl_and_parquet(tmp_path):
    """An empty or blank text holds nothing to train on: left out of both formats, as a blank .txt is (a null
    one is an error in both: test_bad_inputs_raise_one_clear_error, tests/data/test_data_cli_sources.py)."""
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: parquet sources are optional")
    import pyarrow.parquet as pq

    texts = ["first", "", "  \n", "last"]
    pq.write_table(pa.table({"text": texts}), tmp_path / "a.parquet")
    for f in (tmp_path / "a.parquet", _jsonl(tmp_path / "a.jsonl", texts)):
        assert load_corpus(f, val_fraction=0.0).train == ["first", "last"], f
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(ConfigError, match=r"n\.parquet: column 'text' must hold strings \(it holds int64\)"):
        load_corpus(tmp_path / "n.parquet")


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    f = _write(tmp_path / "a.parquet", b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes the import fail
    with pytest.raises(ConfigError, match=r"a\.parquet needs pyarrow: pip install pyarrow"):
        load_corpus(f)


def test_hf_source_on_a_local_file(tmp_path):
    pytest.importorskip("datasets", reason="the datasets package is not installed: hf: sources are optional")
    f = _jsonl(tmp_path / "a.jsonl", DOCS[:40])
    c = load_corpus(f"hf:{f}", val_fraction=0.1, cache_dir=tmp_path / "cache")
    assert sorted(c.train + c.val) == sorted(DOCS[:40])
    assert c.val == load_corpus(str(f), val_fraction=0.1).val  # same hash split as the direct reader
    assert len(load_corpus(f"hf:{f}", max_docs=7, cache_dir=tmp_path / "cache").train) <= 7
    with pytest.raises(ConfigError, match=r"no column 'body' \(columns: 'text', 'id'\): name the text's field with"):
        load_corpus(f"hf:{f}", text_field="body", cache_dir=tmp_path / "cache")
    # a null text was skipped without a word (as a .parquet file's were; a .jsonl record's is an error)
    _write(tmp_path / "n.jsonl", '{"text": "a record"}\n{"text": null}\n')
    with pytest.raises(ConfigError, match=r"hf:.*n\.jsonl': row 1 \(counted from 0\): no string in column 'text' "
                                          r"\(null\): drop those rows"):
        load_corpus(f"hf:{tmp_path / 'n.jsonl'}", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("name, content, pattern", [
    ("missing.txt", None, r"missing\.txt does not exist"),
    ("empty.txt", "  \n\n", r"empty\.txt.*the corpus is empty"),
    ("latin1.txt", "caf\xe9 au lait".encode("latin-1"), r"latin1\.txt is not UTF-8 text \(byte 3"),
    ("nofield.jsonl", '{"body": "x"}\n', r"nofield\.jsonl:1: no string field 'text' \(missing; its fields: "
                                         r"'body'\): name the text's field with train's --data\.text_field"),
    ("null.jsonl", '{"text": "ok"}\n{"text": null, "id": 2}\n', r"null\.jsonl:2: no string field 'text' \(null; its "
                                                             r"fields: 'text', 'id'\): drop the records whose 'text' "
                                                             r"is null, or name the text's field with"),
    ("badjson.jsonl", '{"text": "ok"}\n{"text": \n', r"badjson\.jsonl:2: not valid JSON"),
    ("table.csv", "a,b\n", r"table\.csv: unsupported suffix '\.csv'; use one of \.txt, \.jsonl, \.parquet"),
])
def test_bad_inputs_raise_one_clear_error(tmp_path, name, content, pattern):
    path = tmp_path / name
    if content is not None:
        _write(path, content)
    with pytest.raises(ConfigError, match=pattern):
        load_corpus(str(path))


def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match=r"holds no \.txt/\.jsonl/\.parquet files"):
        load_corpus(tmp_path)
    with pytest.raises(ConfigError, match=r"data\.val_fraction=1\.5 must be in \[0, 1\)"):
        load_corpus("kjv", val_fraction=1.5)
    with pytest.raises(ConfigError, match="too small to split"):
        split_documents(["x"], 0.05)


def test_the_field_an_error_names_is_a_config_field_the_commands_follow(tmp_path, no_peak_measure):
    """A .jsonl whose text is under another key: `train` says the field 'text' is missing, lists the record's
    fields and names the option; `--data.text_field=content` trains on it, and `eval` of the run reads the
    same field again (its validation loss is the one training logged). `eval --text` / `--data` of files
    keyed otherwise take `--text-field`. An empty field, or `--text-field` with nothing to read, is refused."""
    from train_helpers import cli_in_process, read_metrics, tiny_overrides  # tests/

    def one_error(*args: str) -> str:
        err = cli_in_process(*args, ok=False).stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:"), err
        return err[0]

    source = tmp_path / "c.jsonl"
    source.write_text("".join(json.dumps({"content": f"{d} {d}", "id": i}) + "\n" for i, d in enumerate(DOCS)))
    out = tmp_path / "run"
    args = [*tiny_overrides(source, tmp_path / "cache", out), "--max_steps=2", "--eval_interval=2"]
    assert ("no string field 'text' (missing; its fields: 'content', 'id'): name the text's field with train's "
            "--data.text_field or eval's --text-field") in one_error("train", *args)
    assert "data.text_field='' must name the field" in one_error("train", *args, "--data.text_field=")
    cli_in_process("train", *args, "--data.text_field=content")
    logged = read_metrics(out, "eval")[-1]["val_loss"]
    assert f"val loss {logged:.4f}" in cli_in_process("eval", str(out)).stdout

    assert "no string field 'text'" in one_error("eval", str(out), "--text", str(source))
    text = cli_in_process("eval", str(out), "--text", str(source), "--text-field", "content").stdout
    assert f"{len(DOCS):,} documents" in text, text
    other = tmp_path / "b.jsonl"
    other.write_text(source.read_text().replace('"content"', '"body"'))
    # the same documents under another key: the same validation split, the same loss
    keyed_body = cli_in_process("eval", str(out), "--data", str(other), "--text-field", "body").stdout
    assert f"val loss {logged:.4f}" in keyed_body, keyed_body
    assert "--text-field names the text of --text's or --data's records" in one_error(
        "eval", str(out), "--text-field", "content")
