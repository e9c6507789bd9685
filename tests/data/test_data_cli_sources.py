"""Data sources through the real command line, as a user meets them: a corpus whose validation split is
too small to evaluate or far from its share, folders with symbolic links (to a folder, back up the tree, to
nothing), a parquet file with a null text."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from train_helpers import tiny_overrides

from hybridnorm import cli
from hybridnorm.data import load_corpus


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def test_a_validation_split_too_small_to_evaluate_is_refused_before_training(tmp_path, capsys):
    """Twelve lines: train has windows for a step, validation (the last line: 5% of the text, cut at a line
    break) 30 bytes and an eot, under one window of seq_len+1=33. Before 2026-12 the run trained to its
    first evaluation and stopped there with "the data has 31 tokens", naming neither the split nor the
    source, and no checkpoint of the steps it had taken."""
    src = tmp_path / "small.txt"
    src.write_text("".join(f"line {i:02d} of the word and light\n" for i in range(12)), encoding="utf-8")
    out = tmp_path / "run"
    before = _snapshot(tmp_path)
    rc = cli.main(["train", *tiny_overrides(src, tmp_path / "cache", out), "--max_steps=3"])
    line = _error_line(capsys.readouterr().err)
    assert rc == 2
    assert "validation split" in line and f"data.source={str(src)!r}" in line and "seq_len+1=33" in line
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    assert {k: v for k, v in _snapshot(tmp_path).items() if "cache" not in k} == before


def _linked_folder(tmp_path: Path) -> Path:
    root, shared = tmp_path / "data", tmp_path / "shared"
    (root / "own").mkdir(parents=True)
    shared.mkdir()
    (root / "own" / "a.txt").write_text("the first document\n", encoding="utf-8")
    (shared / "b.txt").write_text("a document kept in a shared folder\n", encoding="utf-8")
    (root / "linked").symlink_to(shared, target_is_directory=True)  # how HF snapshots and shared data are kept
    (root / "own" / "up").symlink_to("..", target_is_directory=True)  # back up the tree: must not loop
    return root


def test_a_linked_folder_is_read_once_and_a_link_up_the_tree_does_not_loop(tmp_path):
    """``rglob`` left the linked folder out without a word; each real folder is read once."""
    c = load_corpus(_linked_folder(tmp_path), val_fraction=0.0)
    assert c.train == ["a document kept in a shared folder\n", "the first document\n"]  # linked/b.txt, own/a.txt


def test_a_link_to_nothing_is_one_error_naming_it(tmp_path, capsys):
    """A data file whose link target is gone was skipped silently: the run trained on less than the folder
    named. Now one error, before anything is written."""
    root = _linked_folder(tmp_path)
    (root / "gone.jsonl").symlink_to(tmp_path / "moved-away.jsonl")
    out = tmp_path / "run"
    before = _snapshot(tmp_path)
    rc = cli.main(["train", *tiny_overrides(root, tmp_path / "cache", out), "--max_steps=1"])
    line = _error_line(capsys.readouterr().err)
    assert rc == 2
    assert str(root / "gone.jsonl") in line and "moved-away.jsonl" in line and "does not exist" in line
    assert not out.exists() and _snapshot(tmp_path) == before
    assert os.path.islink(root / "gone.jsonl")


def test_eval_data_errors_name_eval_data_not_trainings_option(tiny_run, tmp_path, capsys):
    """``eval --data`` reads the corpus as training does, whose messages named ``data.source``, an option
    the eval user never typed."""
    empty, missing = tmp_path / "empty.txt", tmp_path / "nothere.txt"
    empty.write_text("\n\n", encoding="utf-8")
    for corpus, what in ((empty, "the corpus is empty"), (missing, "does not exist")):
        rc = cli.main(["eval", str(tiny_run), "--data", str(corpus)])
        line = _error_line(capsys.readouterr().err)
        assert rc == 2 and what in line and (f"--data {corpus}" in line or f"--data file {corpus}" in line)
        assert "data.source" not in line


def test_a_data_file_with_an_upper_case_suffix_is_read_in_a_folder_as_alone(tmp_path):
    """``A.TXT`` in a folder was skipped without a word (alone, it was refused as an unknown suffix)."""
    root = tmp_path / "data"
    root.mkdir()
    (root / "A.TXT").write_text("an old DOS file\n", encoding="utf-8")
    (root / "b.JsonL").write_text('{"text": "a record"}\n', encoding="utf-8")
    (root / "c.txt").write_text("a plain one\n", encoding="utf-8")
    assert load_corpus(root, val_fraction=0.0).train == ["an old DOS file\n", "a record", "a plain one\n"]
    assert load_corpus(root / "A.TXT", val_fraction=0.0).train == ["an old DOS file\n"]


def _train_on(tmp_path: Path, capsys, lines: list[str], *flags: str) -> tuple[Path, int, Path]:
    """``train`` one step of the tiny model on a text file of ``lines``: (the file, exit code, run folder)."""
    src, out = tmp_path / "c.txt", tmp_path / "run"
    src.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    capsys.readouterr()
    return src, cli.main(["train", *tiny_overrides(src, tmp_path / "cache", out), "--max_steps=1", *flags]), out


def test_a_train_split_smaller_than_one_batch_names_the_split_and_the_source(tmp_path, capsys):
    """The error said "the data has N tokens": neither which split nor which source."""
    src, rc, _ = _train_on(tmp_path, capsys, [f"line {i:02d} of the word and light, said over" for i in range(40)],
                           "--batch_size=64", "--grad_accum=1")
    line = _error_line(capsys.readouterr().err)
    assert rc == 2
    assert f"the train split of data.source={str(src)!r}" in line and "fewer than one global batch of 64" in line


def test_a_bpe_vocab_the_corpus_cannot_fill_is_noted_in_the_run_log(tmp_path, capsys):
    """config.yaml keeps the asked data.vocab_size while the model follows the tokenizer's smaller one; only
    the header's "vocab N" said so."""
    _, rc, out = _train_on(tmp_path, capsys, [f"line {i} of a small corpus about {i * 7} things" for i in range(300)],
                           "--data.tokenizer=bpe", "--data.vocab_size=100000")
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert rc == 0
    n = len(json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"])  # eot included
    assert f"note: data.vocab_size=100000: the BPE tokenizer trained on this corpus has {n} tokens" in text
    assert f"vocab {n};" in text


def test_a_parquet_null_text_is_one_error_naming_the_file_row_and_column(tmp_path, capsys):
    """A null in a .parquet file's text column was dropped without a word (a .jsonl record's null text was
    already one error naming file:line): the run trained on fewer documents than the file holds."""
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: parquet sources are optional")
    import pyarrow.parquet as pq

    src, out = tmp_path / "docs.parquet", tmp_path / "run"
    texts = [f"document {i}: " + "the river ran by the city gates " * 8 for i in range(40)]
    pq.write_table(pa.table({"body": [*texts[:7], None, *texts[7:], None], "id": list(range(42))}), src)
    before = _snapshot(tmp_path)
    rc = cli.main(["train", *tiny_overrides(src, tmp_path / "cache", out), "--max_steps=1", "--data.text_field=body"])
    line = _error_line(capsys.readouterr().err)
    assert rc == 2
    assert (f"{src}: row 7 (counted from 0): no string in column 'body' (null, as in 2 of its 42 rows; its columns: "
            f"'body', 'id'): drop the rows whose 'body' is null (pandas: df.dropna(subset=['body']))") in line
    assert not out.exists() and {k: v for k, v in _snapshot(tmp_path).items() if "cache" not in k} == before


def test_a_split_far_from_five_percent_is_noted_in_the_run_log_and_again_from_the_cache(tmp_path, capsys,
                                                                                          no_peak_measure):
    """Three documents of ~3.7k characters, one of which hashes into validation: a third of the text is
    validation against the ~5% a local source's split aims at, and nothing said so. Now a `note:` line, in
    the first run and in a second one, whose data comes from the cache."""
    body = "".join(f"line {j} of a long chapter about the river and the city gates\n" for j in range(60))
    src = tmp_path / "data"
    src.mkdir()
    for k in (0, 1, 17):  # "Chapter 17\n" + body hashes into validation, 0 and 1 do not
        (src / f"{k:02d}.txt").write_text(f"Chapter {k}\n{body}", encoding="utf-8")
    for run in ("first", "second"):
        capsys.readouterr()
        assert cli.main(["train", *tiny_overrides(src, tmp_path / "cache", tmp_path / run), "--max_steps=1"]) == 0
        captured = capsys.readouterr()
        notes = [line for line in (captured.out + captured.err).splitlines() if "validation holds" in line]
        assert len(notes) == 1 and notes[0].startswith("note: validation holds 33.3% of the text (1 of 3 documents"), \
            captured
        assert "give it more, smaller documents" in notes[0]
    assert len(list((tmp_path / "cache").iterdir())) == 1  # one prepared folder: the second run read the cache
    # eval scores that split too (its own corpus, or named with --data): the note again, and in its JSON
    for extra in ([], ["--data", str(src)]):
        assert cli.main(["eval", str(tmp_path / "first"), *extra, "--output", str(tmp_path / "e.json")]) == 0
        captured = capsys.readouterr()
        notes = [line for line in (captured.out + captured.err).splitlines() if "validation holds" in line]
        assert len(notes) == 1 and notes[0] == f"note: {notes[0][6:]}" and "33.3% of the text" in notes[0], captured
        assert json.loads((tmp_path / "e.json").read_text())["val"]["split_note"] == notes[0][6:]
