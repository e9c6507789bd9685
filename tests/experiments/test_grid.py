"""Grids: the points and their configs, resuming an interrupted grid, skipping finished runs, refusing a
changed config, and --jobs (worker processes) giving the runs one process would."""

import json

import pytest
import torch

from hybridnorm.errors import ConfigError
from hybridnorm.experiments.compare import run_experiment
from hybridnorm.experiments.grid import Grid, one_precision, point_config, run_grid
from hybridnorm.experiments.runs import read_run


def test_points_cover_the_product_seeds_outermost_and_configs_follow(make_cfg, tmp_path):
    grid = Grid(["pre", "hybridnorm"], ["paper", "normal"], [("lr", [1e-3, 1e-2]), ("depth", [2, 3])], [0, 1],
                warmup_frac=0.25)
    points = grid.points()
    assert len(points) == 2 * 2 * 2 * 2 * 2
    assert [p.seed for p in points[:16]] == [0] * 16  # a partial grid holds whole comparisons of one seed
    assert len({p.name for p in points}) == len(points)
    base = make_cfg(tmp_path / "x", "--max_steps=40")
    p = next(p for p in points if p.placement == "hybridnorm" and p.init == "paper" and dict(p.knobs) ==
             {"optim.lr": 1e-2, "model.n_layers": 3} and p.seed == 1)
    cfg = point_config(base, grid, p, tmp_path / p.name)
    assert (cfg.optim.lr, cfg.model.n_layers, cfg.seed, cfg.optim.warmup_steps) == (1e-2, 3, 1, 10)
    assert cfg.model.resolved_init() == "megatron"  # paper: HybridNorm's own init
    q = next(q for q in points if q.placement == "hybridnorm" and q.init == "normal")
    assert point_config(base, grid, q, tmp_path / q.name).model.resolved_init() == "normal"
    assert cfg.diagnostics.every > 0  # the verdicts need diagnostics: collected without being asked


@pytest.mark.parametrize("bad", [dict(inits=["xavier"]), dict(placements=["pre", "hybridnrom"]),
                                 dict(axes=[("seed", [1])]), dict(axes=[("lr", [1]), ("optim.lr", [2])]),
                                 dict(warmup_frac=1.5), dict(seeds=[])])
def test_bad_grids_are_refused_by_name(bad):
    args = dict(placements=["pre"], inits=["megatron"], axes=[], seeds=[0])
    args.update(bad)
    with pytest.raises(ConfigError):
        Grid(**args).validate()


def _losses(run_dir):
    return [r["loss"] for r in read_run(run_dir).train]


def test_interrupted_grid_resumes_and_finished_runs_are_skipped(make_cfg, tmp_path):
    grid = Grid(["pre", "hybridnorm"], ["megatron"], [], [0])
    # the reference: the same grid in one go
    full = run_grid(make_cfg(tmp_path / "u", "--max_steps=8", "--ckpt_interval=2"), grid, tmp_path / "full")
    assert all(r.done and r.last_step == 8 for r in full)

    # interrupted: every run stops after 5 of its 8 steps (checkpoint saved, no done.json)
    paused = make_cfg(tmp_path / "u", "--max_steps=8", "--ckpt_interval=2", "--stop_after_steps=5")
    first = run_grid(paused, grid, tmp_path / "g")
    assert all(not r.done and r.last_step == 5 for r in first)
    second = run_grid(paused, grid, tmp_path / "g")  # the same command again continues each run
    assert all(r.done and r.last_step == 8 for r in second)
    for a, b in zip(full, second, strict=True):
        assert _losses(b.path) == _losses(a.path)  # resumed runs reproduce the uninterrupted ones exactly

    before = {r.path: (r.path / "metrics.jsonl").read_text() for r in second}
    again = run_grid(paused, grid, tmp_path / "g")  # nothing left to train: nothing is touched
    assert {r.path: (r.path / "metrics.jsonl").read_text() for r in again} == before


def test_a_moved_grid_resumes_where_it_now_lies(make_cfg, tmp_path):
    import shutil

    grid = Grid(["pre"], ["megatron"], [], [0])
    full = run_grid(make_cfg(tmp_path / "u", "--max_steps=6", "--ckpt_interval=2"), grid, tmp_path / "full")
    paused = make_cfg(tmp_path / "u", "--max_steps=6", "--ckpt_interval=2", "--stop_after_steps=3")
    run_grid(paused, grid, tmp_path / "g")
    shutil.move(tmp_path / "g", tmp_path / "moved")  # e.g. a clone of the repo, or another working directory
    runs = run_grid(paused, grid, tmp_path / "moved")
    assert runs[0].done and runs[0].last_step == 6 and not (tmp_path / "g").exists()
    assert _losses(runs[0].path) == _losses(full[0].path)  # continued from its checkpoint, in its new place


def test_a_run_folder_made_with_another_config_is_refused(make_cfg, tmp_path):
    grid = Grid(["pre"], ["megatron"], [], [0])
    run_grid(make_cfg(tmp_path / "u", "--max_steps=2"), grid, tmp_path / "g")
    with pytest.raises(ConfigError, match="batch_size"):
        run_grid(make_cfg(tmp_path / "u", "--max_steps=2", "--batch_size=2"), grid, tmp_path / "g")


def test_jobs_train_in_worker_processes_with_the_same_results(make_cfg, tmp_path):
    grid = Grid(["pre", "post"], ["megatron"], [("lr", [1e-3, 3e-3])], [0])
    base = make_cfg(tmp_path / "u", "--max_steps=4")
    serial = run_grid(base, grid, tmp_path / "serial")
    parallel = run_grid(base, grid, tmp_path / "parallel", jobs=2)
    assert all(r.done for r in parallel) and len(parallel) == 4
    for a, b in zip(serial, parallel, strict=True):
        assert a.path.name == b.path.name
        assert _losses(b.path) == pytest.approx(_losses(a.path), rel=1e-5)  # 1 thread vs 2: reduction order only
        assert (b.path / "worker.log").is_file()
    with pytest.raises(ConfigError, match="jobs"):
        run_grid(base, grid, tmp_path / "p2", jobs=0)


def test_a_failing_worker_is_reported_as_failed_and_the_command_fails(make_cfg, tmp_path, monkeypatch):
    """The other run still trains; the failed one is *failed* with its error in summary.md and runs.json (it
    once read 'unfinished' with no reason, and the command exited 0), and the command raises the error."""
    grid = Grid(["pre", "post"], ["megatron"], [], [0])
    base = make_cfg(tmp_path / "u", "--max_steps=2")
    out = tmp_path / "g"
    # break one run's point file after it is written: its worker exits 2, the other run still trains
    from hybridnorm.experiments import grid as grid_mod

    real = grid_mod.prepare_point

    def sabotage(cfg, point, run_dir):
        real(cfg, point, run_dir)
        if point.placement == "post":
            spec = json.loads((run_dir / "point.json").read_text())
            spec["config"]["model"]["placement"] = "no_such_placement"
            (run_dir / "point.json").write_text(json.dumps(spec))

    monkeypatch.setattr(grid_mod, "prepare_point", sabotage)
    with pytest.raises(ConfigError, match=r"1 of 2 runs failed \(post-init=megatron-seed0: .*no_such_placement"):
        run_experiment(base, grid, out, jobs=2)
    log = (out / "runs" / "post-init=megatron-seed0" / "worker.log").read_text()
    error = next(x for x in log.splitlines() if x.startswith("error: "))[len("error: "):]
    records = {r["placement"]: r for r in json.loads((out / "runs.json").read_text())["runs"]}
    assert records["pre"]["done"] and records["pre"]["verdict"] is not None
    assert records["post"]["failed"] and records["post"]["verdict_reason"] == f"failed: {error}"
    row = next(x for x in (out / "summary.md").read_text().splitlines() if x.startswith("| post-init"))
    assert "| *failed* |" in row and "no_such_placement" in row
    assert "**1 failed**" in (out / "summary.md").read_text()


def test_a_point_failing_in_the_grid_process_stops_the_grid_and_is_reported_as_failed(make_cfg, tmp_path,
                                                                                       monkeypatch):
    """--jobs 1: the point's error stops the grid (as before); its folder now says it failed, so a report
    written later lists it as failed with that error rather than as unfinished."""
    from hybridnorm.experiments import grid as grid_mod

    real = grid_mod.prepare_point

    def sabotage(cfg, point, run_dir):  # the point file breaks after it is written
        real(cfg, point, run_dir)
        spec = json.loads((run_dir / "point.json").read_text())
        (run_dir / "point.json").write_text(json.dumps({**spec, "config": {**spec["config"], "seq_len": "x"}}))

    monkeypatch.setattr(grid_mod, "prepare_point", sabotage)
    grid, base, out = Grid(["pre"], ["megatron"], [], [0]), make_cfg(tmp_path / "u", "--max_steps=2"), tmp_path / "g"
    with pytest.raises(ConfigError, match="seq_len='x'") as e:
        run_experiment(base, grid, out)
    failed = json.loads((out / "runs" / "pre-init=megatron-seed0" / "failed.json").read_text())
    assert failed["error"] == " ".join(str(e.value).split())
    with pytest.raises(ConfigError, match="1 of 1 runs failed"):
        run_experiment(base, grid, out, train=False)
    assert "| *failed* |" in (out / "summary.md").read_text()


def test_a_grid_paused_with_stop_after_steps_is_finished_by_the_command_without_it(make_cfg, tmp_path):
    """Once refused: 'run folder ... was trained with a different config (stop_after_steps differ)'."""
    grid = Grid(["pre"], ["megatron"], [], [0])
    plain = make_cfg(tmp_path / "u", "--max_steps=6", "--ckpt_interval=2")
    full = run_grid(plain, grid, tmp_path / "full")
    (paused,) = run_grid(make_cfg(tmp_path / "u", "--max_steps=6", "--ckpt_interval=2", "--stop_after_steps=3"),
                         grid, tmp_path / "g")
    assert not paused.done and paused.last_step == 3
    (run,) = run_grid(plain, grid, tmp_path / "g")
    assert run.done and run.last_step == 6 and run.config["stop_after_steps"] == 0
    assert _losses(run.path) == _losses(full[0].path)


def test_report_only_reads_without_training(make_cfg, tmp_path):
    grid = Grid(["pre"], ["megatron"], [], [0])
    runs = run_grid(make_cfg(tmp_path / "u", "--max_steps=2"), grid, tmp_path / "g", train=False)
    assert len(runs) == 1 and not runs[0].done and not (tmp_path / "g" / "runs").exists()


def test_records_of_unstarted_and_unfinished_runs_name_their_point_and_have_no_verdict(make_cfg, tmp_path):
    grid = Grid(["pre", "post"], ["normal"], [("optim.lr", [1e-3])], [0, 1])
    paused = make_cfg(tmp_path / "u", "--max_steps=6", "--ckpt_interval=2", "--stop_after_steps=3")
    run_grid(paused, Grid(["pre"], ["normal"], [("optim.lr", [1e-3])], [0]), tmp_path / "g")  # one run, paused
    records = [r.to_record() for r in run_grid(paused, grid, tmp_path / "g", train=False)]
    assert [(r["placement"], r["seed"], r["init_axis"], r["knobs"]) for r in records] == [
        (p, s, "normal", {"optim.lr": 1e-3}) for s in (0, 1) for p in ("pre", "post")]
    assert all(r["verdict"] is None for r in records)
    assert records[0]["verdict_reason"] == "unfinished: step 3 of 6" and records[0]["steps"] == 3
    assert records[1]["verdict_reason"].startswith("unfinished: step 0")


def test_an_unfinished_run_without_checkpoints_restarts_with_a_clean_log(make_cfg, tmp_path):
    import shutil

    grid = Grid(["pre"], ["megatron"], [], [0])
    paused = make_cfg(tmp_path / "u", "--max_steps=6", "--ckpt_interval=2", "--stop_after_steps=3")
    (run,) = run_grid(paused, grid, tmp_path / "g")
    shutil.rmtree(run.path / "checkpoints")  # as in a grid folder committed without its bulk
    (run,) = run_grid(paused, grid, tmp_path / "g")
    assert [r["step"] for r in run.train] == [1, 2, 3]  # one history, from step 0 again
    assert (run.path / "metrics.stale.jsonl").is_file()


@pytest.mark.parametrize(("widths", "expected"), [((256, 512), "bf16"), ((64, 256), "fp32")])
def test_auto_precision_is_one_choice_for_the_whole_grid(make_cfg, tmp_path, monkeypatch, widths, expected):
    """With native bf16, auto picks bf16 for d_model >= 256 only: a grid whose widths straddle that trains
    every run in fp32 rather than mixing precisions between the runs it compares."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    base = make_cfg(tmp_path / "base", "--precision=auto", "--model.n_heads=4", "--model.n_kv_heads=2")
    grid = Grid(placements=["pre"], axes=[("model.d_model", list(widths))]).validate()
    points = grid.points()
    resolved = one_precision([point_config(base, grid, p, tmp_path / "grid" / p.name) for p in points])
    assert [c.precision for c in resolved] == [expected] * len(widths)
    assert [c.model.d_model for c in resolved] == list(widths)
    fixed = make_cfg(tmp_path / "b", "--precision=bf16", "--model.n_heads=4", "--model.n_kv_heads=2")
    kept = one_precision([point_config(fixed, grid, p, tmp_path / "grid" / p.name) for p in points])
    assert [c.precision for c in kept] == ["bf16"] * len(widths)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(placements=["pre", "hybridnorm", "pre"]), "--placements lists 'pre' twice"),
    (dict(placements=["pre"], inits=["normal", "normal"]), "--init lists 'normal' twice"),
    (dict(placements=["pre"], seeds=[0, 1, 0]), "--seeds lists 0 twice"),
    (dict(placements=["pre"], axes=[("optim.lr", [1e-3, 2e-3, 0.001])]), "--axis optim.lr lists 0.001 twice"),
    (dict(placements=["pre"], axes=[("model.n_layers", [2, 2.0])]), r"lists 2.0 twice \(2 and 2.0 are one value\)"),
])
def test_a_value_listed_twice_is_refused(kwargs, message):
    """Each grid point trains once; a value listed twice would be counted twice by the report's statistics
    (a doubled seed makes a paired interval look tighter than the data allow)."""
    with pytest.raises(ConfigError, match=message):
        Grid(**kwargs).validate()
    assert Grid(placements=["pre"], axes=[("optim.lr", [1e-3, 2e-3])], seeds=[0, 1]).validate()


def test_values_that_name_the_same_run_folder_are_refused():
    with pytest.raises(ConfigError, match=r"share the run folder 'pre-init=paper-data.source=a_b-seed0'"):
        Grid(placements=["pre"], axes=[("data.source", ["a b", "a_b"])]).validate()
