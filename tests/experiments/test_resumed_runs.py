"""A grid run continued by hand (``train --resume`` in its folder) with settings other than its grid point's:
the report states what it trained with, from the trainer's own log, and does not pool or pair it as if it
had trained with its ``point.json`` config."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hybridnorm.errors import ConfigError
from hybridnorm.experiments.compare import run_experiment
from hybridnorm.experiments.grid import Grid
from hybridnorm.experiments.runs import read_point, read_run
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.trainer import train

GRID = Grid(["pre", "post"], ["megatron"], [], [0])


def _by_hand(folder, **changes):
    """``train --resume`` in a grid's run folder with ``changes`` to its point's config."""
    cfg = TrainConfig.from_dict(read_point(folder / "point.json")["config"])
    optim = dataclasses.replace(cfg.optim, lr=changes.pop("lr")) if "lr" in changes else cfg.optim
    train(dataclasses.replace(cfg, optim=optim, out_dir=str(folder), **changes), resume=True, quiet=True)


def test_a_run_resumed_by_hand_with_another_lr_is_named_and_kept_apart(make_cfg, tmp_path):
    """Paused at step 3, steps 4-5 trained by hand at lr 0.05, finished by the grid at its own 0.002: the
    report said "lr 0.002" for both runs, "What differs: placement" only, and paired the two as alike."""
    out = tmp_path / "g"
    plain = make_cfg(tmp_path / "u", "--max_steps=6", "--ckpt_interval=1", "--eval_interval=6")
    run_experiment(dataclasses.replace(plain, stop_after_steps=3), GRID, out)
    folder = out / "runs" / "pre-init=megatron-seed0"
    _by_hand(folder, lr=0.05, stop_after_steps=2)
    text = run_experiment(plain, GRID, out).read_text()
    run = read_run(folder)
    # the trainer's own record of each step's rate: steps 4-5 ran above anything the point's config reaches
    assert run.config["optim"]["lr"] == 0.002 and max(r["lr"] for r in run.train if r["step"] in (4, 5)) > 0.002
    assert "**What differs between runs:** `placement`, `config changed on resume`." in text
    assert ("`pre-init=megatron-seed0` (optim.lr 0.002 → 0.05 from step 3; optim.lr 0.05 → 0.002 from step 5)"
            in text)
    report = json.loads((out / "runs.json").read_text())
    pre = next(r for r in report["runs"] if r["placement"] == "pre")
    assert [(c["step"], c["fields"], c["values"]) for c in pre["config_changes"]] == [
        (3, ["optim.lr"], {"optim.lr": [0.002, 0.05]}), (5, ["optim.lr"], {"optim.lr": [0.05, 0.002]})]
    groups = {g["placement"]: g for g in report["groups"]}
    assert groups["pre"]["label"].startswith("pre [resumed with optim.lr 0.002 → 0.05 from step 3")
    assert groups["post"]["diff_vs_baseline"] is None  # not paired with a run trained otherwise
    # and its no-Δ line says why: the finished pre run is there, [bracketed] (it said no pre run had finished)
    assert groups["post"]["no_diff_because"] == (
        "the finished `pre` runs at its init axis value and knob values ran otherwise than it and are grouped "
        f"apart (`{groups['pre']['label']}`)")
    assert f"No Δ for `post`: {groups['post']['no_diff_because']}." in text
    post = next(r for r in report["runs"] if r["placement"] == "post")
    assert post["config_changes"] == []


def test_a_finished_run_trained_on_past_its_points_steps_is_not_called_cut_short(make_cfg, tmp_path):
    out = tmp_path / "g"
    plain = make_cfg(tmp_path / "u", "--max_steps=3", "--ckpt_interval=1", "--eval_interval=3")
    run_experiment(plain, Grid(["pre"], ["megatron"], [], [0]), out)
    folder = out / "runs" / "pre-init=megatron-seed0"
    _by_hand(folder, max_steps=5)
    with pytest.raises(ConfigError, match=r"last eval is at step 5, past the max_steps=3 of its grid point") as e:
        read_run(folder)
    assert "cut short" not in str(e.value)
