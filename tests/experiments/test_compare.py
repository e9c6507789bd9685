"""`hybridnorm compare` / `sweep` end to end on a tiny config, and the report's contents."""

import json

import matplotlib.image
import pytest

from hybridnorm import cli
from hybridnorm.experiments.compare import run_compare, run_experiment
from hybridnorm.experiments.grid import Grid
from hybridnorm.experiments.runs import read_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _valid_png(path):
    assert path.read_bytes()[:8] == PNG_MAGIC
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_compare_report(make_cfg, tmp_path):
    base = make_cfg(tmp_path / "unused", "--max_steps=12", "--diagnostics.every=5", "--eval_interval=6")
    summary = run_compare(base, ["pre", "post", "hybridnorm"], [0, 1], tmp_path / "cmp", command="hybridnorm x")
    text = summary.read_text()
    records = json.loads((tmp_path / "cmp" / "runs.json").read_text())
    assert len(records["runs"]) == 6 and records["baseline"] == "pre"
    for name in ("pre", "post", "hybridnorm"):
        assert f"| `{name}` |" in text
        for seed in (0, 1):
            run = read_run(tmp_path / "cmp" / "runs" / f"{name}-init=megatron-seed{seed}")
            assert run.last_step == 12 and not run.diverged and run.placement == name and run.seed == seed
            rec = next(r for r in records["runs"] if r["placement"] == name and r["seed"] == seed)
            assert rec["init"] == "megatron" and rec["verdict"] in ("trained", "stalled", "collapsed")
            assert rec["final_val_loss"] == pytest.approx(run.eval[-1]["val_loss"])
    assert "± " in text  # two seeds: mean ± spread
    assert "What differs between runs:** `placement`, `seed`." in text  # one init for all by default
    post = next(g for g in records["groups"] if g["placement"] == "post")
    pre_val = {r["seed"]: r["final_val_loss"] for r in records["runs"] if r["placement"] == "pre"}
    post_val = {r["seed"]: r["final_val_loss"] for r in records["runs"] if r["placement"] == "post"}
    want = sum(post_val[s] - pre_val[s] for s in (0, 1)) / 2
    assert post["diff_vs_baseline"]["mean"] == pytest.approx(want) and post["diff_vs_baseline"]["n"] == 2
    for png in ("loss_curves", "grad_norm_by_depth", "activation_rms_by_depth"):
        _valid_png(tmp_path / "cmp" / f"{png}.png")
    curves = json.loads((tmp_path / "cmp" / "loss_curves.json").read_text())
    assert set(curves) == {"pre", "post", "hybridnorm"}
    # the plotted mean equals the mean of the two seeds' logged losses at each step
    pre = [read_run(tmp_path / "cmp" / "runs" / f"pre-init=megatron-seed{s}") for s in (0, 1)]
    step = curves["pre"]["x"][3]
    want = sum(next(r["loss"] for r in p.train if r["step"] == step) for p in pre) / 2
    assert curves["pre"]["y"][3] == pytest.approx(want)
    grads = json.loads((tmp_path / "cmp" / "grad_norm_by_depth.json").read_text())
    assert {"pre@step1", "post@step1", "hybridnorm@step1"} <= set(grads)
    assert all(len(s["y"]) == 2 and all(v > 0 for v in s["y"]) for s in grads.values())  # 2 blocks

    # re-running reuses the finished runs (nothing retrained: metrics files unchanged)
    before = (tmp_path / "cmp" / "runs" / "pre-init=megatron-seed0" / "metrics.jsonl").read_text()
    run_compare(base, ["pre", "post", "hybridnorm"], [0, 1], tmp_path / "cmp")  # the same grid: a subset of it
    # would replace this report with one that leaves runs out, and is refused (test_grid_refusals)
    assert (tmp_path / "cmp" / "runs" / "pre-init=megatron-seed0" / "metrics.jsonl").read_text() == before


def test_sweep_finds_the_learning_rate_that_breaks(make_cfg, tmp_path):
    base = make_cfg(tmp_path / "unused", "--max_steps=10", "--optim.grad_clip=0")
    summary = run_experiment(base, Grid(["pre"], ["megatron"], [("lr", [1e-3, 1e3])], [0]), tmp_path / "sw")
    text = summary.read_text()
    runs = {v: read_run(tmp_path / "sw" / "runs" / f"pre-init=megatron-optim.lr={v}-seed0")
            for v in ("0.001", "1000.0")}
    # 10 steps of a byte model do not beat the unigram baseline: stalled, honestly; lr 1000 goes non-finite
    assert runs["0.001"].verdict.verdict == "stalled" and runs["1000.0"].verdict.verdict == "diverged"
    row = next(line for line in text.splitlines() if line.startswith("| `pre init=megatron` |"))
    assert "| none |" in row and "0.001: 1 stalled" in row and "1000.0: 1 diverged" in row
    series = json.loads((tmp_path / "sw" / "sweep_optim.lr.json").read_text())
    assert series["pre"]["x"] == [0.001, 1000.0]
    assert series["pre"]["y"] == [None, None]  # only trained runs are plotted as points
    _valid_png(tmp_path / "sw" / "sweep_optim.lr.png")


def test_compare_cli_rejects_unknown_placement_before_training(tmp_path, capsys):
    rc = cli.main(["compare", "--placements", "pre,hybridnrom", "--size", "tiny", "--out", str(tmp_path / "c")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "hybridnrom" in err and "hybridnorm_star" in err
    assert not (tmp_path / "c" / "runs").exists()


def _fake_run(root, placement, lr, seed, val, n_layers=2, extra: dict | None = None, code: dict | None = None,
              hardware: dict | None = None):
    """A finished grid run folder written by hand: the verdict follows from val vs the baseline 6.0.
    ``extra``: more top-level config fields; ``code``, ``hardware``: the meta record's provenance."""
    run = root / "runs" / f"{placement}-lr{lr}-s{seed}"
    run.mkdir(parents=True)
    (run / "point.json").write_text(json.dumps({
        "point": {"placement": placement, "init": "megatron", "knobs": {"optim.lr": lr}, "seed": seed},
        "config": {"max_steps": 10, "model": {"n_layers": n_layers}, "optim": {"lr": lr}, **(extra or {})}}))
    meta = {"kind": "meta", "step": 0, "init": "megatron", "unigram_entropy": 6.0}
    meta = {**meta, **({"code": code} if code else {}), **({"hardware": hardware} if hardware else {})}
    recs = [meta,
            {"kind": "train", "step": 10, "loss": val, "tokens": 100},
            {"kind": "eval", "step": 10, "val_loss": val, "val_tokens": 100}]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, recs)) + "\n")
    (run / "done.json").write_text("{}")
    return read_run(run)


def test_largest_value_counts_only_values_where_every_seed_trained(tmp_path):
    from hybridnorm.experiments.report import write_report

    runs = [_fake_run(tmp_path, "pre", lr, s, v) for lr, s, v in
            [(1e-3, 0, 5.0), (1e-3, 1, 5.1), (1e-2, 0, 4.9), (1e-2, 1, 5.95), (1e-1, 0, 7.0), (1e-1, 1, 7.0)]]
    text = write_report(runs, tmp_path, baseline="pre").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `pre init=megatron` |"))
    # 1e-2: seed 1 ended 0.05 below the baseline (< 0.1): stalled, so 1e-2 does not count as trained
    assert "| 0.001 |" in row and "0.01: 1 trained, 1 stalled" in row
    series = json.loads((tmp_path / "sweep_optim.lr.json").read_text())
    assert series["pre"]["y"] == [pytest.approx(5.05), pytest.approx(4.9), None]  # mean of trained seeds only


def test_report_tells_fields_some_runs_lack_from_real_differences_and_names_the_code(tmp_path):
    """A field only newer runs record (added to the trainer since the older runs were made) is not a
    difference between the runs; a field both record with different values is; and the report counts the
    code versions that made the runs, 'not recorded' for runs made before versions were logged."""
    from hybridnorm.experiments.report import write_report

    new = {"hybridnorm": "0.1.0", "torch": "2.13.0", "git_commit": "0123456789abcdef" * 2 + "01234567",
           "git_dirty": False}
    runs = [_fake_run(tmp_path, "pre", 1e-3, 0, 5.0),  # an old run: no host_sync, no fast_kernels, no code
            _fake_run(tmp_path, "pre", 1e-3, 1, 5.1, extra={"host_sync": "auto", "grad_accum": 1}, code=new),
            _fake_run(tmp_path, "pre", 1e-3, 2, 5.2, extra={"host_sync": "step", "grad_accum": 1}, code=new),
            _fake_run(tmp_path, "hybridnorm", 1e-3, 0, 5.0, n_layers=4)]
    text = write_report(runs, tmp_path, baseline="pre").read_text()
    data = json.loads((tmp_path / "runs.json").read_text())
    assert data["varying"] == ["model.n_layers"]  # host_sync differs only between runs that both record it...
    assert data["partly_recorded"] == ["grad_accum", "host_sync"]  # ...and is named as partly recorded instead
    assert data["differs"] == ["placement", "model.n_layers", "seed"]  # one code recorded: not a difference
    assert "**What differs between runs:** `placement`, `model.n_layers`, `seed`." in text
    assert "Recorded in only some runs' configs" in text and "`grad_accum`, `host_sync`" in text
    assert "Code that made the runs: not recorded (2 runs); hybridnorm 0.1.0 @ 01234567, torch 2.13.0 (2 runs)." in text
    assert [r["code"] for r in data["runs"]] == [None, new, new, None]
    assert "Hardware that ran them: not recorded (4 runs)." in text


def test_report_counts_the_hardware_that_ran_the_runs(tmp_path):
    """Seeds run on different machines (a GPU for some, a CPU for others) are named with their counts, so a
    reader can see that a paired difference compares runs made on one kind of hardware or not."""
    from hybridnorm.experiments.report import write_report

    gpu = {"device": "cuda", "name": "NVIDIA H100 80GB HBM3", "processes": 1, "threads": 1}
    cpu = {"device": "cpu", "name": "AMD EPYC 7B13", "processes": 1, "threads": 2}
    runs = [_fake_run(tmp_path, "pre", 1e-3, 0, 5.0, hardware=cpu),
            _fake_run(tmp_path, "pre", 1e-3, 1, 5.1, hardware=gpu),
            _fake_run(tmp_path, "pre", 1e-3, 2, 5.2, hardware=gpu),
            _fake_run(tmp_path, "hybridnorm", 1e-3, 0, 5.0)]
    text = write_report(runs, tmp_path, baseline="pre").read_text()
    assert ("Hardware that ran them: cuda NVIDIA H100 80GB HBM3 (2 runs); cpu AMD EPYC 7B13 (2 threads) (1 run); "
            "not recorded (1 run).") in text
    data = json.loads((tmp_path / "runs.json").read_text())
    assert [r["hardware"] for r in data["runs"]] == [cpu, gpu, gpu, None]
