"""``hybridnorm eval RUN`` without ``--data`` where the run's ``data.source`` now holds other content than the
checkpoint recorded it trained on (``data_sha256``): the file edited since, or a relative path read from
another folder. The loss is scored (an edited corpus may be meant) with one ``note:`` line saying it is not on
the run's validation data; with ``--data`` (the user's choice of corpus) nothing is said."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from train_helpers import tiny_overrides

from hybridnorm import cli


def _eval(capsys, *args: str) -> list[str]:
    capsys.readouterr()
    rc = cli.main(["eval", *args])
    captured = capsys.readouterr()
    assert rc == 0 and "Traceback" not in captured.err
    return (captured.out + captured.err).strip().splitlines()


def _notes(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("note:")]


def _sha(file: Path) -> str:  # a one-file source's data_sha256 is its bytes' sha256 (the trainer's record)
    return hashlib.sha256(file.read_bytes()).hexdigest()[:16]


@pytest.fixture
def text(corpus: Path, tmp_path: Path) -> Path:
    """One small .txt: the shared corpus's documents, a blank line apart."""
    file = tmp_path / "data" / "corpus.txt"
    file.parent.mkdir()
    file.write_text("\n\n".join(f.read_text(encoding="utf-8") for f in sorted(corpus.glob("*.txt"))),
                    encoding="utf-8")
    return file


def test_eval_of_a_run_whose_corpus_was_edited_says_it_scores_other_data(text, tmp_path, capsys, no_peak_measure):
    run, cache = tmp_path / "run", tmp_path / "cache"
    assert cli.main(["train", *tiny_overrides(text, cache, run), "--max_steps=2"]) == 0
    trained = _sha(text)
    assert _notes(_eval(capsys, str(run))) == []  # unedited: the run's own validation data

    text.write_text(text.read_text(encoding="utf-8").replace("e", "a"), encoding="utf-8")  # edited after training
    out = tmp_path / "r.json"
    (note,) = _notes(_eval(capsys, str(run), "--output", str(out)))
    assert f"data.source={text}" in note and trained in note and _sha(text) in note and _sha(text) != trained
    assert "other data than the run's validation" in note
    assert json.loads(out.read_text(encoding="utf-8"))["val"]["changed_note"] == note.removeprefix("note: ")

    lines = _eval(capsys, str(run), "--data", str(text), "--output", str(out))  # chosen: nothing to say
    assert _notes(lines) == [] and "changed_note" not in json.loads(out.read_text(encoding="utf-8"))["val"]


def test_a_relative_source_read_from_another_folder_is_noted(text, tmp_path, capsys, monkeypatch, no_peak_measure):
    run, cache = tmp_path / "run", tmp_path / "cache"
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", *tiny_overrides(Path("data/corpus.txt"), cache, run), "--max_steps=2"]) == 0
    assert _notes(_eval(capsys, str(run))) == []

    other = tmp_path / "elsewhere" / "data" / "corpus.txt"  # the same relative path, other files
    other.parent.mkdir(parents=True)
    other.write_text(text.read_text(encoding="utf-8").upper(), encoding="utf-8")
    monkeypatch.chdir(tmp_path / "elsewhere")
    (note,) = _notes(_eval(capsys, str(run)))
    assert "data.source=data/corpus.txt (a relative path" in note and str(tmp_path / "elsewhere") in note
    assert _sha(text) in note and _sha(other) in note
