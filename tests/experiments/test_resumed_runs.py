"""A grid run continued by hand (``train --resume`` in its folder) with settings other than its grid point's:
the report states what it trained with, from the trainer's own log, and does not pool or pair it as if it
had trained with its ``point.json`` config."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from hybridnorm.errors import ConfigError
from hybridnorm.experiments import as_run
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


def _resumed_on(corpus, folder, copy):
    """``train --resume`` by hand for 2 steps with ``data.source`` at ``copy`` (a copy of the grid's corpus)."""
    cfg = TrainConfig.from_dict(read_point(folder / "point.json")["config"])
    _by_hand(folder, data=dataclasses.replace(cfg.data, source=str(copy)), stop_after_steps=2)


def test_a_resume_on_a_copy_of_the_same_files_is_no_config_change(make_cfg, corpus, tmp_path):
    """data.source moved to a copy of its files (same sha256 before and after): the run read the same data,
    yet the report called it 'config changed on resume' and grouped it apart, unpaired."""
    out, copy = tmp_path / "g", shutil.copytree(corpus, tmp_path / "moved-corpus")
    plain = make_cfg(tmp_path / "u", "--max_steps=6", "--ckpt_interval=1", "--eval_interval=6")
    run_experiment(dataclasses.replace(plain, stop_after_steps=3), GRID, out)
    folder = out / "runs" / "pre-init=megatron-seed0"
    _resumed_on(corpus, folder, copy)
    text = run_experiment(plain, GRID, out).read_text()
    run = read_run(folder)
    shas = [m["data_sha256"] for m in run.metas]
    assert [m["step"] for m in run.metas] == [0, 3, 5] and len(set(shas)) == 1 and shas[0]
    changed = [e for e in run.events if e["event"] == "config_changed_on_resume"]  # the trainer's log keeps it
    assert [e["values"]["data.source"] for e in changed] == [[str(corpus), str(copy)], [str(copy), str(corpus)]]
    assert "config changed on resume" not in text
    report = json.loads((out / "runs.json").read_text())
    assert [r["config_changes"] for r in report["runs"]] == [[], []]
    groups = {g["placement"]: g for g in report["groups"]}
    assert groups["pre"]["label"] == "pre" and groups["post"]["diff_vs_baseline"] is not None

    # a session whose sha256 is not known (logged by a trainer from before 2026-12-02): not known the same,
    # neither from the one it resumed nor for the one that resumed it
    metrics = folder / "metrics.jsonl"
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    for rec in recs:
        if rec["kind"] == "meta" and rec["step"] == 3:
            del rec["data_sha256"]
    metrics.write_text("".join(json.dumps(rec) + "\n" for rec in recs))
    assert [(c["step"], c["fields"]) for c in as_run.config_changes(read_run(folder))] == [
        (3, ["data.source"]), (5, ["data.source"])]


def test_a_resume_on_other_files_is_still_a_config_change(make_cfg, corpus, tmp_path):
    out, copy = tmp_path / "g", shutil.copytree(corpus, tmp_path / "edited-corpus")
    doc = copy / "doc00.txt"  # a same-size edit: the data order of the checkpoint still resumes on it
    doc.write_text(doc.read_text(encoding="utf-8").replace("e", "a"), encoding="utf-8")
    plain = make_cfg(tmp_path / "u", "--max_steps=6", "--ckpt_interval=1", "--eval_interval=6")
    run_experiment(dataclasses.replace(plain, stop_after_steps=3), Grid(["pre"], ["megatron"], [], [0]), out)
    folder = out / "runs" / "pre-init=megatron-seed0"
    _resumed_on(corpus, folder, copy)
    run = read_run(folder)
    assert [e["step"] for e in run.events if e["event"] == "data_changed_on_resume"] == [3]
    assert [(c["step"], c["fields"], c["values"]) for c in as_run.config_changes(run)] == [
        (3, ["data.source"], {"data.source": [str(corpus), str(copy)]})]


def test_a_finished_run_trained_on_past_its_points_steps_is_not_called_cut_short(make_cfg, tmp_path):
    out = tmp_path / "g"
    plain = make_cfg(tmp_path / "u", "--max_steps=3", "--ckpt_interval=1", "--eval_interval=3")
    run_experiment(plain, Grid(["pre"], ["megatron"], [], [0]), out)
    folder = out / "runs" / "pre-init=megatron-seed0"
    _by_hand(folder, max_steps=5)
    with pytest.raises(ConfigError, match=r"last eval is at step 5, past the max_steps=3 of its grid point") as e:
        read_run(folder)
    assert "cut short" not in str(e.value)
