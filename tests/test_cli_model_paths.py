"""What the commands that read a model say when the path given is not one: a path that does not exist is said
to be so, naming it and what it should be (``import`` said 'no config.json', the others 'no run folder or
checkpoint at', as if the path were there, holding the wrong thing); a compare/sweep report folder is said to be
one, naming a few of its runs/<name> folders (it was 'no usable checkpoint')."""

from __future__ import annotations

from pathlib import Path

import pytest
from bad_input_helpers import assert_refused
from train_helpers import cli_in_process, tiny_overrides

RUN_PATHS = "(expected a run folder, a checkpoints/step_* folder or a local Hugging Face model folder)"


@pytest.mark.parametrize(("argv", "expected"), [
    (["import", "{missing}", "--out", "{tmp}/run"], "(expected a local Hugging Face model folder, one with a "
                                                    "config.json)"),
    (["export", "{missing}", "--to", "hf", "{tmp}/hf"], RUN_PATHS),
    (["generate", "{missing}", "--max-new-tokens", "1"], RUN_PATHS),
    (["eval", "{missing}"], RUN_PATHS),
    (["eval", "{missing}", "--text", "kjv"], RUN_PATHS),
    (["generate", "{missing}/checkpoints/step_5"], RUN_PATHS),
], ids=["import", "export", "generate", "eval", "eval-text", "generate-step"])
def test_a_path_that_does_not_exist_is_said_not_to(tmp_path: Path, capsys, argv: list[str], expected: str) -> None:
    if argv[0] in ("import", "export"):
        pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    missing = tmp_path / "nothere"
    argv = [a.format(missing=missing, tmp=tmp_path) for a in argv]
    line = assert_refused(argv, capsys, [], tmp_path)
    assert line == f"error: {argv[1]} does not exist {expected}"
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, corpus: Path, cache_dir: Path) -> Path:
    """A finished compare of four placements, 2 steps each: a report folder with four runs/<name> folders."""
    out = tmp_path_factory.mktemp("report") / "cmp"
    args = ["compare", "--placements", "pre,post,hybridnorm,peri", "--seeds", "0", "--max-steps", "2",
            *tiny_overrides(corpus, cache_dir, out), "--out", str(out)]
    cli_in_process(*[a for a in args if not a.startswith("--out_dir=")])
    return out


@pytest.mark.parametrize("argv", [["generate", "{report}", "--max-new-tokens", "1"], ["eval", "{report}"],
                                  ["export", "{report}", "--to", "hf", "{tmp}/hf"]], ids=["generate", "eval", "export"])
def test_a_report_folder_is_said_to_be_one_naming_its_runs(report: Path, tmp_path: Path, capsys,
                                                            argv: list[str]) -> None:
    """It was 'has no usable checkpoint (no checkpoints/step_* folder)', which left the user to find the runs."""
    if argv[0] == "export":
        pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    runs = sorted((report / "runs").iterdir())
    assert len(runs) == 4 and all((r / "checkpoints").is_dir() for r in runs)
    argv = [a.format(report=report, tmp=tmp_path) for a in argv]
    line = assert_refused(argv, capsys, [f"{report} is a compare/sweep report folder, not a run: pass one of its "
                                         f"runs/<name> folders, e.g. {runs[0]}, {runs[1]}, {runs[2]} (4 in all: ls "
                                         f"{report / 'runs'})"], report)
    assert "no usable checkpoint" not in line
    cli_in_process("generate", str(runs[0]), "--max-new-tokens", "1", "--prompt", "a")  # what it points at works
