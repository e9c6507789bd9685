"""What a grid refuses, with one ConfigError naming the cause and nothing written, before it trains or
reports (``hybridnorm.experiments.grid_checks``): two names of one placement (once trained twice and
reported as two placements), a data source that is not there (once a worker's failure half-way through the
grid, reported as 'unfinished'), and ``--report-only`` where the report would describe the runs falsely: a
folder that is not a grid's report folder (it once wrote a summary.md of 'unfinished' runs into any folder
and exited 0), or options that contradict what the runs were trained with (the report's command block once
showed those options)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridnorm import cli
from hybridnorm.errors import ConfigError
from hybridnorm.experiments.grid import Grid, run_grid


def _argv(out: Path, corpus: Path, cache: Path, *extra: str) -> list[str]:
    return ["compare", "--placements", "pre", "--size", "tiny", "--max-steps", "2", "--batch_size=2", "--seq_len=32",
            "--eval_batches=1", "--data.tokenizer=bytes", f"--data.cache_dir={cache}", f"--data.source={corpus}",
            "--device=cpu", "--out", str(out), *extra]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory, corpus: Path, cache_dir: Path) -> Path:
    """A finished one-run grid (2 steps, lr 2e-3 from --size tiny's defaults)."""
    import hybridnorm.train.trainer as trainer

    out = tmp_path_factory.mktemp("grid") / "cmp"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "measured_peak_flops", lambda *a, **k: 1e12)
        assert cli.main(_argv(out, corpus, cache_dir)) == 0
    return out


def test_options_the_runs_were_not_trained_with_are_refused(grid, corpus, cache_dir, capsys):
    before = _snapshot(grid)
    argv = _argv(grid, corpus, cache_dir, "--optim.lr=0.1", "--report-only")
    argv[argv.index("--max-steps") + 1] = "500"
    assert cli.main(argv) == 2
    line = _one_error(capsys)
    assert "run pre-init=megatron-seed0 was trained with max_steps=2 (given: 500)" in line
    assert "optim.lr=0.002 (given: 0.1)" in line and "nothing was written" in line
    assert _snapshot(grid) == before


def test_the_training_command_is_the_reports_command(grid, corpus, cache_dir, capsys):
    argv = _argv(grid, corpus, cache_dir, "--report-only")
    assert cli.main(argv) == 0
    text = (grid / "summary.md").read_text()
    assert text.splitlines()[3] == "hybridnorm " + " ".join(_argv(grid, corpus, cache_dir))
    # a pause option is not what trained the runs: it may differ
    assert cli.main([*argv, "--stop_after_steps=1"]) == 0


@pytest.mark.parametrize("kind", ["missing", "empty", "run", "other"])
def test_a_folder_that_is_not_a_grids_report_folder_is_refused(tmp_path, tiny_run, corpus, cache_dir, capsys, kind):
    folder = {"missing": tmp_path / "none", "empty": tmp_path / "empty", "run": tiny_run,
              "other": tmp_path / "other"}[kind]
    if kind == "empty":
        folder.mkdir()
    if kind == "other":
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    before = _snapshot(folder) if folder.exists() else None
    assert cli.main(_argv(folder, corpus, cache_dir, "--report-only")) == 2
    line = _one_error(capsys)
    assert f"--report-only --out {folder}: the folder" in line and "not a compare/sweep report folder" in line
    assert (_snapshot(folder) if folder.exists() else None) == before
    assert kind != "run" or "is a training run's folder" in line


@pytest.mark.parametrize(("names", "first", "second", "resolved"), [
    (["hybridnorm", "QKV-Post"], "hybridnorm", "QKV-Post", "hybridnorm"), (["pre", "pre_ln"], "pre", "pre_ln", "pre"),
    (["pre", "Pre"], "pre", "Pre", "pre"), (["pre", "post", "PRE"], "pre", "PRE", "pre"),
    (["Pre-Pre", "pre"], "Pre-Pre", "pre", "Pre-Pre = pre"), (["pre_qk_pre", "Pre-QK-Pre"], "pre_qk_pre", "Pre-QK-Pre",
                                                             "qk_norm"),
])
def test_two_names_of_one_placement_are_refused(names, first, second, resolved):
    """Each would train the same model; the report would count one placement twice."""
    with pytest.raises(ConfigError, match=f"lists {first!r} and {second!r}, two names of one placement "
                                          f"\\({resolved}\\)"):
        Grid(names).validate()


def test_placements_that_build_different_models_are_accepted():
    assert Grid(["pre", "post", "hybridnorm", "hybridnorm_star", "Pre-QKV-Post", "post_shifted"]).validate()


def test_a_missing_data_source_is_refused_before_any_run_trains(make_cfg, tmp_path, corpus):
    grid = Grid(["pre"], ["megatron"], [("data.source", [str(corpus), str(tmp_path / "none.txt")])], [0])
    with pytest.raises(ConfigError, match=r"none.txt does not exist .*\(grid point pre-init=megatron-data.source="):
        run_grid(make_cfg(tmp_path / "u", "--max_steps=2"), grid, tmp_path / "g", jobs=2)
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize("how", [("--axis", "steps=0,2"), ("--max-steps", "0")])
def test_a_point_of_zero_steps_is_refused_before_any_run_trains(tmp_path, corpus, cache_dir, capsys, how):
    """Before 2026-12-02 it trained the other points and reported the zero-step one as a lost log."""
    out = tmp_path / "cmp"
    argv = _argv(out, corpus, cache_dir, *how)
    at = argv.index("--max-steps")
    argv[at:at + 2] = how if how[0] == "--max-steps" else []  # steps=2 for the axis's other point
    assert cli.main(argv) == 2
    line = _one_error(capsys)
    assert "max_steps=0 (grid point pre-" in line and "trains no step" in line, line
    assert not list(out.glob("runs/*/metrics.jsonl"))


def test_a_point_adamw_cannot_train_is_refused_before_any_run_trains(tmp_path, corpus, cache_dir, capsys):
    """``--axis optim.eps=1e-8,0``: train refuses eps=0 at its start, but the grid first trained every point
    before that one, then ended on the refusal half-way through the grid."""
    out = tmp_path / "cmp"
    assert cli.main(_argv(out, corpus, cache_dir, "--axis", "optim.eps=1e-8,0")) == 2
    line = _one_error(capsys)
    assert "optim.eps=0 (grid point pre-" in line and "must be > 0" in line, line
    assert not list(out.glob("runs/*/metrics.jsonl"))


@pytest.mark.parametrize("report_only", [False, True])
def test_a_report_folder_of_another_grid_is_refused_and_kept(grid, tmp_path, corpus, cache_dir, capsys, report_only):
    """Before 2026-12-02 ``compare --placements post`` into the folder of a ``pre`` grid (or a sweep's, with
    its sweep_<knob> plots) trained post and replaced summary.md and runs.json with a report of post alone,
    the pre run left out and the other grid's plots left beside it."""
    import shutil

    out = Path(shutil.copytree(grid, tmp_path / "cmp"))
    before = _snapshot(out)
    argv = _argv(out, corpus, cache_dir, *(["--report-only"] if report_only else []))
    argv[argv.index("--placements") + 1] = "post"
    assert cli.main(argv) == 2
    line = _one_error(capsys)
    assert f"--out) {out} holds" in line or f"--out {out} holds" in line, line
    assert "holds runs that are no point of this grid (pre-init=megatron-seed0)" in line, line
    assert "nothing was written" in line
    assert _snapshot(out) == before and not (out / "runs" / "post-init=megatron-seed0").exists()


def test_a_grown_grid_in_its_own_report_folder_is_still_reported(grid, tmp_path, corpus, cache_dir, capsys):
    """More placements (or seeds, values) than the folder's runs: the same grid, grown; the report covers all."""
    import json
    import shutil

    out = Path(shutil.copytree(grid, tmp_path / "cmp"))
    argv = _argv(out, corpus, cache_dir, "--report-only")
    argv[argv.index("--placements") + 1] = "pre,post"
    assert cli.main(argv) == 0
    assert "pre-init=megatron-seed0" in (out / "runs.json").read_text()
    assert json.loads((out / "runs.json").read_text())


def test_a_baseline_spelled_unlike_the_grids_name_is_that_placement(grid, tmp_path, corpus, cache_dir, capsys):
    """``--baseline Pre-Pre`` for a grid of ``pre``: one placement (the grid refuses the two names side by side),
    so the report compares against it under the grid's name; it was refused as 'not one of the placements'."""
    import json
    import shutil

    out = Path(shutil.copytree(grid, tmp_path / "cmp"))
    assert cli.main(_argv(out, corpus, cache_dir, "--report-only", "--baseline", "Pre-Pre")) == 0
    assert json.loads((out / "runs.json").read_text())["baseline"] == "pre"
    capsys.readouterr()
    before = _snapshot(out)
    for baseline, said in (("post", "is not one of the grid's placements: pre"), ("Pre-", "empty part")):
        assert cli.main(_argv(out, corpus, cache_dir, "--report-only", "--baseline", baseline)) == 2
        line = _one_error(capsys)
        assert f"--baseline {baseline!r}" in line and said in line, line
    assert _snapshot(out) == before
