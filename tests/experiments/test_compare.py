"""`hybridnorm compare` / `sweep` end to end on a tiny config, and the report's contents."""

import json
import math

import matplotlib.image
import pytest

from hybridnorm import cli
from hybridnorm.experiments.compare import run_compare
from hybridnorm.experiments.runs import read_run
from hybridnorm.experiments.sweep import failed, run_sweep

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _valid_png(path):
    assert path.read_bytes()[:8] == PNG_MAGIC
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_compare_report(make_cfg, tmp_path):
    base = make_cfg(tmp_path / "unused", "--max_steps=12", "--diagnostics.every=5", "--eval_interval=6")
    summary = run_compare(base, ["pre", "post", "hybridnorm"], [0, 1], tmp_path / "cmp", command="hybridnorm x")
    text = summary.read_text()
    for name in ("pre", "post", "hybridnorm"):
        assert f"| `{name}` |" in text
        for seed in (0, 1):
            run = read_run(tmp_path / "cmp" / "runs" / f"{name}-seed{seed}", name, seed)
            assert run.last_step == 12 and not run.diverged
    assert "± " in text  # two seeds: mean ± spread
    for png in ("loss_curves", "grad_norm_by_depth", "activation_rms_by_depth"):
        _valid_png(tmp_path / "cmp" / f"{png}.png")
    curves = json.loads((tmp_path / "cmp" / "loss_curves.json").read_text())
    assert set(curves) == {"pre", "post", "hybridnorm"}
    # the plotted mean equals the mean of the two seeds' logged losses at each step
    pre = [read_run(tmp_path / "cmp" / "runs" / f"pre-seed{s}", "pre", s) for s in (0, 1)]
    step = curves["pre"]["x"][3]
    want = sum(next(r["loss"] for r in p.train if r["step"] == step) for p in pre) / 2
    assert curves["pre"]["y"][3] == pytest.approx(want)
    grads = json.loads((tmp_path / "cmp" / "grad_norm_by_depth.json").read_text())
    assert {"pre@step1", "post@step1", "hybridnorm@step1"} <= set(grads)
    assert all(len(s["y"]) == 2 and all(v > 0 for v in s["y"]) for s in grads.values())  # 2 blocks

    # re-running reuses the finished runs (nothing retrained: metrics files unchanged)
    before = (tmp_path / "cmp" / "runs" / "pre-seed0" / "metrics.jsonl").read_text()
    run_compare(base, ["pre"], [0], tmp_path / "cmp")
    assert (tmp_path / "cmp" / "runs" / "pre-seed0" / "metrics.jsonl").read_text().count('"kind": "train"') == \
        before.count('"kind": "train"')


def test_sweep_finds_the_learning_rate_that_breaks(make_cfg, tmp_path):
    base = make_cfg(tmp_path / "unused", "--max_steps=10", "--optim.grad_clip=0")
    summary = run_sweep(base, ["pre"], "lr", [1e-3, 1e3], tmp_path / "sw")
    text = summary.read_text()
    runs = {v: read_run(tmp_path / "sw" / "runs" / f"pre-optim.lr={v}", "pre", 0, v) for v in ("0.001", "1000.0")}
    assert not failed(runs["0.001"]) and failed(runs["1000.0"])  # lr 1000 cannot learn
    row = next(line for line in text.splitlines() if line.startswith("| `pre` |"))
    assert row.endswith("| 0.001 |")  # the largest learning rate that still trained
    series = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert series["pre"]["x"] == [0.001, 1000.0]
    assert math.isfinite(series["pre"]["y"][0]) and series["pre"]["y"][1] is None
    _valid_png(tmp_path / "sw" / "sweep.png")


def test_compare_cli_rejects_unknown_placement_before_training(tmp_path, capsys):
    rc = cli.main(["compare", "--placements", "pre,hybridnrom", "--size", "tiny", "--out", str(tmp_path / "c")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "hybridnrom" in err and "hybridnorm_star" in err
    assert not (tmp_path / "c" / "runs").exists()
