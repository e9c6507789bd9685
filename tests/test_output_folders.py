"""One rule for output folders, generated over what a folder holds and where it lies: ``import --out``,
``export --to hf``, ``train --out`` and ``compare --out`` refuse a non-empty folder that is not their own
kind (a run folder for ``train``, a report folder for ``compare``) and any folder that is their input or
inside it, with one ``error:`` line naming the folder, exit 2, and every file there byte-identical
afterwards. A new or empty folder works."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from bad_input_helpers import PROPS, assert_refused, copy_tree, make_hf_and_run
from hypothesis import given
from hypothesis import strategies as st

from hybridnorm.cli import main
from hybridnorm.train.preflight import RUN_MARKERS

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

names = st.text("abcdefghijklmnopqrstuvwxyz_.-", min_size=1, max_size=10).filter(
    lambda n: not n.startswith(".") and n not in (".", ".."))
# a user's files: including the names the commands write (config.yaml, tokenizer.json, config.json ...) and
# those that mark a run or report folder, holding a user's bytes instead of what ours hold
user_files = st.dictionaries(names | st.sampled_from(["config.yaml", "tokenizer.json", "config.json",
                                                      "model.safetensors", "README.md", "summary.md", "runs",
                                                      "runs.json", *RUN_MARKERS]),
                             st.binary(max_size=64), min_size=1, max_size=4).filter(
    lambda files: not any(files.get(m) == b"" for m in RUN_MARKERS))  # an empty marker holds nothing to lose


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_hf_and_run(tmp_path_factory.mktemp("outputs"))


def _argv(command: str, source: Path, out: Path, corpus: Path, cache: Path) -> list[str]:
    if command == "import":
        return ["import", str(source), "--out", str(out)]
    if command == "export":
        return ["export", str(source), "--to", "hf", str(out)]
    if command == "compare":
        return ["compare", "--placements", "pre,post", "--size", "tiny", "--max-steps", "1", "--data.tokenizer=bytes",
                f"--data.cache_dir={cache}", f"--data.source={corpus}", "--device=cpu", "--out", str(out)]
    return ["train", "--size", "tiny", "--max-steps", "1", "--data.tokenizer=bytes", f"--data.cache_dir={cache}",
            f"--data.source={corpus}", "--device=cpu", "--out", str(out)]


@pytest.mark.parametrize("command", ["import", "export", "train", "compare"])
@PROPS
@given(files=user_files, nested=st.booleans())
def test_a_non_empty_folder_of_other_files_is_refused_and_kept(folders, corpus, cache_dir, tmp_path, capsys,
                                                              command, files, nested) -> None:
    hf, run = folders
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    out = root / "mine" / ("deeper" if nested else "")
    out.mkdir(parents=True)
    for name, data in files.items():
        (out / name).write_bytes(data)
    source = hf if command == "import" else run
    assert_refused(_argv(command, source, out, corpus, cache_dir), capsys, [str(out).rstrip("/"), "not empty"], root)


@pytest.mark.parametrize("command", ["import", "export", "train"])
@PROPS
@given(depth=st.integers(0, 3), sub=names)
def test_the_input_folder_or_a_folder_inside_it_is_refused(folders, corpus, cache_dir, tmp_path, capsys, command,
                                                           depth, sub) -> None:
    hf, run = folders
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    # import reads an HF folder, export a run, train its corpus folder
    source = copy_tree({"import": hf, "export": run, "train": corpus}[command], root / "input")
    out = source.joinpath(*[sub] * depth)
    argv = _argv(command, source, out, source if command == "train" else corpus, cache_dir)
    assert_refused(argv, capsys, [str(source), "input folder"], root)
    assert not (source / sub).exists() or depth == 0  # nothing was made inside the input


@pytest.mark.parametrize("command", ["import", "export"])
def test_a_new_or_empty_folder_is_written(folders, tmp_path, capsys, command) -> None:
    hf, run = folders
    for out in (tmp_path / f"{command}-new" / "x", tmp_path / f"{command}-empty"):
        if out.name.endswith("empty"):
            out.mkdir()
        assert main(_argv(command, hf if command == "import" else run, out, tmp_path, tmp_path)) == 0
        assert (out / ("checkpoints" if command == "import" else "config.json")).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind


def test_a_report_folder_is_recognised_by_its_grid_points_not_by_its_file_names(tmp_path, corpus, cache_dir,
                                                                                capsys) -> None:
    """``compare --out`` continues its own report folder, and refuses one whose summary.md and runs/ are a
    user's (no grid point under runs/), keeping every file."""
    own = tmp_path / "report"
    argv = _argv("compare", tmp_path, own, corpus, cache_dir)
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 0
    assert "2 already done" in capsys.readouterr().err
    root = tmp_path / "user"
    theirs = root / "notes"
    (theirs / "runs" / "pre").mkdir(parents=True)
    (theirs / "runs" / "pre" / "notes.txt").write_text("mine")
    (theirs / "summary.md").write_text("# my summary")
    assert_refused(_argv("compare", tmp_path, theirs, corpus, cache_dir), capsys, [str(theirs), "not empty"], root)


@pytest.mark.parametrize("marker", RUN_MARKERS)
def test_a_run_marker_holding_a_users_data_does_not_make_a_run_folder(tmp_path, corpus, cache_dir, capsys,
                                                                       marker: str) -> None:
    """``train --out`` continues a run folder and refuses a folder whose metrics.jsonl, point.json,
    train.lock or checkpoints/ are the user's own (what they hold is not what ours hold)."""
    root = tmp_path / "user"
    out = root / "mine"
    out.mkdir(parents=True)
    if marker == "checkpoints":
        (out / marker).mkdir()
        (out / marker / "best.pt").write_bytes(b"weights of my own")
    else:
        (out / marker).write_text('{"step": 3, "loss": 2.5}\n' if marker == "metrics.jsonl" else "{}")
    assert_refused(_argv("train", tmp_path, out, corpus, cache_dir), capsys, [str(out), "not empty"], root)
    run = tmp_path / "run"
    argv = _argv("train", tmp_path, run, corpus, cache_dir)
    assert main(argv) == 0 and main([*argv, "--resume"]) == 0  # the second finds its own run folder
