"""The prepared-token cache is keyed by the data files' content (sha256), not their names, sizes and mtimes:
an edit that keeps size and mtime (``touch -r``, ``rsync -t``, ``cp -p``) gets fresh tokens, and a run
records the hash of what it read (before 2026-12 it reused the stale tokens and recorded only counts)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from train_helpers import read_metrics

from hybridnorm.data import corpus as corpus_mod
from hybridnorm.data import prepare_data
from hybridnorm.errors import ConfigError
from hybridnorm.train.trainer import train

DOCS = [f"document {i}: in the beginning was the word, and the word was with light number {i}" for i in range(60)]


def _write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def _edit_keeping_size_and_mtime(path: Path, old: str, new: str) -> None:
    """What ``git checkout`` of same-size content, or a copy with ``cp -p``, leaves behind."""
    assert len(old) == len(new)
    st = path.stat()
    path.write_text(path.read_text(encoding="utf-8").replace(old, new), encoding="utf-8")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def _segments(tokens: np.ndarray, eot: int) -> list[list[int]]:
    """The documents of a token stream (each ends with the eot)."""
    out, cur = [], []
    for t in tokens.tolist():
        if t == eot:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    assert cur == []
    return out


def test_an_edit_that_keeps_size_and_mtime_gets_fresh_tokens(tmp_path):
    src = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    bpe = prepare_data(str(src), "bpe", 300, cache_dir=tmp_path / "bpe", val_fraction=0.1)
    tok_json = str(bpe.dir / "tokenizer.json")  # a fixed tokenizer: only the text changes below
    first = prepare_data(str(src), tok_json, cache_dir=tmp_path / "c", val_fraction=0.1)
    _edit_keeping_size_and_mtime(src, "beginning", "BEGINNING")
    again = prepare_data(str(src), tok_json, cache_dir=tmp_path / "c", val_fraction=0.1)
    assert not again.cached and again.dir != first.dir

    # oracle: HF tokenizers itself on the new text, every document once, train and val together
    hf = HFTokenizer.from_file(tok_json)
    want = sorted(hf.encode(d.replace("beginning", "BEGINNING")).ids for d in DOCS)
    got = sorted(_segments(np.asarray(again.train_tokens()), again.eot_id)
                 + _segments(np.asarray(again.val_tokens()), again.eot_id))
    assert got == want
    assert again.data_sha256 == hashlib.sha256(src.read_bytes()).hexdigest() != first.data_sha256


def test_a_copy_elsewhere_reuses_the_cache_and_a_folder_hash_is_sha256sums(tmp_path, monkeypatch):
    """The key holds no path: a copy of the data (another checkout, cp -r) reuses its tokens. A folder's
    data hash is the sha256 of ``sha256sum``'s lines for its files, in the order read."""
    folder = tmp_path / "d"
    (folder / "sub").mkdir(parents=True)
    _write_jsonl(folder / "sub" / "b.jsonl", DOCS[:30])
    (folder / "a.txt").write_text("a plain text document\nof two lines\n", encoding="utf-8")
    first = prepare_data(str(folder), "bytes", cache_dir=tmp_path / "c")
    lines = "".join(f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}\n" for n in ("a.txt", "sub/b.jsonl"))
    assert first.data_sha256 == hashlib.sha256(lines.encode()).hexdigest()
    meta = json.loads((first.dir / "meta.json").read_text())
    assert meta["data_sha256"] == first.data_sha256
    assert [f["path"] for f in meta["data_files"]] == ["a.txt", "sub/b.jsonl"]

    copy = tmp_path / "copy"
    os.rename(folder, copy)
    monkeypatch.setattr("hybridnorm.data.prepare.tokenize_to_memmap", lambda *a, **k: pytest.fail("rebuilt"))
    moved = prepare_data(str(copy), "bytes", cache_dir=tmp_path / "c")
    assert moved.cached and moved.dir == first.dir and moved.data_sha256 == first.data_sha256


def test_a_file_changed_while_it_is_prepared_is_one_error(tmp_path, monkeypatch):
    """The tokens must be of the text that was hashed: a file written between the hash and the read is
    caught (its size or mtime moved), not cached under the old hash."""
    src = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    real = corpus_mod._read_file

    def read_then_append(path, text_field):
        docs = real(path, text_field)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"text": "a late record"}) + "\n")
        return docs

    monkeypatch.setattr(corpus_mod, "_read_file", read_then_append)
    with pytest.raises(ConfigError, match=r"data file .*docs\.jsonl changed while it was being prepared"):
        prepare_data(str(src), "bytes", cache_dir=tmp_path / "c")
    assert not any((tmp_path / "c").glob("*/meta.json"))


def test_the_digest_is_read_once(tmp_path, monkeypatch):
    """One streamed hash per file per preparation, cold or warm (the corpus reader reuses it)."""
    from hybridnorm.data import source_digest  # here: the module's other tests run on code without it

    src = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    calls = []
    real = corpus_mod.file_sha256
    monkeypatch.setattr(corpus_mod, "file_sha256", lambda p: calls.append(p) or real(p))
    prepare_data(str(src), "bytes", cache_dir=tmp_path / "c")
    prepare_data(str(src), "bytes", cache_dir=tmp_path / "c")
    assert calls == [src, src]
    assert source_digest(str(src)).sha256 == hashlib.sha256(src.read_bytes()).hexdigest()


def test_the_run_records_the_hash_and_a_resume_on_edited_data_logs_it(make_cfg, tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text("".join(f"line {i} of the word and the light\n" for i in range(400)), encoding="utf-8")
    run = tmp_path / "run"
    cfg = ("--max_steps=2", "--ckpt_interval=2", f"--data.source={src}", f"--data.cache_dir={tmp_path / 'c'}")
    train(make_cfg(run, *cfg), quiet=True)
    before = hashlib.sha256(src.read_bytes()).hexdigest()
    (meta,) = read_metrics(run, "meta")
    assert meta["data_sha256"] == before

    train(make_cfg(run, *cfg[1:], "--max_steps=3"), resume=True, quiet=True)  # same data: no data event
    assert not [e for e in read_metrics(run, "event") if e["event"] == "data_changed_on_resume"]

    _edit_keeping_size_and_mtime(src, "line 7 ", "LINE 7 ")
    train(make_cfg(run, *cfg[1:], "--max_steps=4"), resume=True, quiet=True)
    after = hashlib.sha256(src.read_bytes()).hexdigest()
    (event,) = [e for e in read_metrics(run, "event") if e["event"] == "data_changed_on_resume"]
    assert (event["step"], event["recorded_data_sha256"], event["data_sha256"]) == (3, before, after)
    assert [m["data_sha256"] for m in read_metrics(run, "meta")] == [before, before, after]
