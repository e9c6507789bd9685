"""Keep-last pruning never loses the newest good checkpoint; corrupt checkpoints are set aside (moved into
``checkpoints/corrupt/``, byte for byte), never deleted, never counted; ``--resume`` falls back to the newest
good one, and refuses to restart at step 0 when there is none."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from checkpoint_helpers import (
    as_older_checkpoint,
    flip_byte,
    model_and_optimizer,
    rewrite,
    snapshot,
    tiny_model,
    write_checkpoint,
)
from safetensors.torch import save
from train_helpers import read_metrics, tiny_overrides

from hybridnorm import cli
from hybridnorm.train.checkpoint import (
    CheckpointError,
    check_checkpoint,
    list_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from hybridnorm.train.checkpoint import TrainState as State
from hybridnorm.train.checkpoint.retention import checkpoint_for_resume, prune_checkpoints


def _names(root) -> list[str]:
    return [p.name for p in list_checkpoints(root)]


def _corrupt_two_ways(a, b) -> None:
    """``a``: bad bytes (caught by the hash); ``b``: state.json of the wrong type with a manifest that
    vouches for it (caught only by the schema)."""
    flip_byte(a / "model.safetensors")
    body = json.loads((b / "state.json").read_text(encoding="utf-8"))
    body["step"] = str(body["step"])
    rewrite(b, "state.json", json.dumps(body).encode())


def test_pruning_keeps_good_ones_and_sets_corrupt_ones_aside(tmp_path):
    mo = model_and_optimizer()
    for step in (10, 15, 20):
        write_checkpoint(tmp_path, step, model_opt=mo)
    _corrupt_two_ways(tmp_path / "step_000015", tmp_path / "step_000020")
    bad = {name: snapshot(tmp_path / name) for name in ("step_000015", "step_000020")}

    with pytest.warns(UserWarning, match="set aside corrupt checkpoint"):
        write_checkpoint(tmp_path, 12, keep_last=2, model_opt=mo)  # as a run resumed from 10 would

    assert _names(tmp_path) == ["step_000010", "step_000012"]  # the good one and the one just written
    for name, snap in bad.items():  # moved whole, not deleted
        assert snapshot(tmp_path / "corrupt" / name) == snap
    for name in ("step_000010", "step_000012"):
        verify_checkpoint(tmp_path / name)


def test_the_newest_good_checkpoint_survives_any_keep_last(tmp_path):
    mo = model_and_optimizer()
    write_checkpoint(tmp_path, 20, model_opt=mo)
    write_checkpoint(tmp_path, 12, keep_last=1, model_opt=mo)  # written after a newer good one exists
    assert _names(tmp_path) == ["step_000012", "step_000020"]  # the one written, and the newest good one
    write_checkpoint(tmp_path, 25, keep_last=1, model_opt=mo)
    assert _names(tmp_path) == ["step_000025"]


def test_keep_last_counts_only_good_checkpoints(tmp_path):
    mo = model_and_optimizer()
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step, model_opt=mo)
    flip_byte(tmp_path / "step_000006" / "optimizer.safetensors")
    with pytest.warns(UserWarning, match=r"step_000006.*optimizer\.safetensors"):
        write_checkpoint(tmp_path, 8, keep_last=3, model_opt=mo)
    assert _names(tmp_path) == ["step_000002", "step_000004", "step_000008"]
    assert (tmp_path / "corrupt" / "step_000006").is_dir()
    assert prune_checkpoints(tmp_path, 0, tmp_path / "step_000008") == []  # 0: keep everything


def test_resume_point_falls_back_and_names_what_it_set_aside(tmp_path):
    mo = model_and_optimizer()
    for step in (10, 15, 20):
        write_checkpoint(tmp_path, step, model_opt=mo)
    _corrupt_two_ways(tmp_path / "step_000015", tmp_path / "step_000020")
    found = checkpoint_for_resume(tmp_path)
    assert found.path == tmp_path / "step_000010"
    assert [(m.checkpoint.name, m.moved_to.name) for m in found.set_aside] == [
        ("step_000020", "step_000020"), ("step_000015", "step_000015")]
    assert "state.json" in found.set_aside[0].reason and "model.safetensors" in found.set_aside[1].reason

    write_checkpoint(tmp_path, 20, model_opt=mo)  # the same step goes bad again: a second name in corrupt/
    flip_byte(tmp_path / "step_000020" / "rng.safetensors")
    assert checkpoint_for_resume(tmp_path).path == tmp_path / "step_000010"
    assert sorted(p.name for p in (tmp_path / "corrupt").iterdir()) == ["step_000015", "step_000020",
                                                                        "step_000020.1"]


def test_resume_refuses_when_every_checkpoint_is_corrupt(tmp_path):
    mo = model_and_optimizer()
    for step in (4, 8):
        write_checkpoint(tmp_path, step, model_opt=mo)
    _corrupt_two_ways(tmp_path / "step_000004", tmp_path / "step_000008")
    before = {f"corrupt/{k}": v for k, v in snapshot(tmp_path).items()}
    with pytest.raises(CheckpointError, match=rf"every checkpoint in {tmp_path} is corrupt"):
        checkpoint_for_resume(tmp_path)
    assert snapshot(tmp_path) == before  # all moved into corrupt/, nothing lost
    with pytest.raises(CheckpointError, match=rf"{tmp_path} holds no good checkpoint.*{tmp_path / 'corrupt'}"):
        checkpoint_for_resume(tmp_path)  # asked again: still refused, not a silent fresh start
    assert checkpoint_for_resume(tmp_path / "empty").path is None  # never had any: a fresh start


def test_save_replaces_the_same_step_atomically(tmp_path):
    model, opt = model_and_optimizer()
    first = save_checkpoint(tmp_path, model, opt, State(step=5), keep_last=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = save_checkpoint(tmp_path, model, opt, State(step=5, tokens=1), keep_last=3)
    assert first == again and _names(tmp_path) == ["step_000005"]
    assert json.loads((again / "state.json").read_text(encoding="utf-8"))["tokens"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def _cli(corpus, cache, run, *extra) -> list[str]:
    return ["train", *tiny_overrides(corpus, cache, run), *extra]


def test_resume_keep_last_scenario_end_to_end(corpus, cache_dir, tmp_path, capsys, no_peak_measure):
    """step_10 good, step_15 and step_20 corrupt: --resume --keep_last=2 goes on from 10, keeps 10 and its
    new checkpoint, and sets 15 and 20 aside, saying so in the log and in metrics.jsonl."""
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    assert cli.main(_cli(corpus, cache_dir, run, "--max_steps=20", "--ckpt_interval=5", "--keep_last=3")) == 0
    assert _names(ckpts) == ["step_000010", "step_000015", "step_000020"]
    _corrupt_two_ways(ckpts / "step_000015", ckpts / "step_000020")
    bad = {name: snapshot(ckpts / name) for name in ("step_000015", "step_000020")}
    capsys.readouterr()

    rc = cli.main(_cli(corpus, cache_dir, run, "--max_steps=20", "--ckpt_interval=5", "--keep_last=2", "--resume",
                       "--stop_after_steps=2"))
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert _names(ckpts) == ["step_000010", "step_000012"]
    for name, snap in bad.items():
        assert snapshot(ckpts / "corrupt" / name) == snap
    assert f"resumed from {ckpts / 'step_000010'}" in out.err
    events = [r for r in read_metrics(run, "event") if r["event"] == "corrupt_checkpoint_set_aside"]
    assert sorted(e["checkpoint"] for e in events) == [str(ckpts / "step_000015"), str(ckpts / "step_000020")]
    assert "Traceback" not in out.err

    # now every checkpoint is corrupt: --resume stops with one error line, twice, and deletes nothing
    _corrupt_two_ways(ckpts / "step_000010", ckpts / "step_000012")
    last = {name: snapshot(ckpts / name) for name in ("step_000010", "step_000012")}
    for _ in range(2):
        rc = cli.main(_cli(corpus, cache_dir, run, "--max_steps=20", "--resume"))
        err = capsys.readouterr().err
        assert rc == 2
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and str(ckpts) in lines[0], err
        assert "Traceback" not in err
    assert _names(ckpts) == []
    assert sorted(p.name for p in (ckpts / "corrupt").iterdir()) == [f"step_0000{n}" for n in (10, 12, 15, 20)]
    for name, snap in {**bad, **last}.items():
        assert snapshot(ckpts / "corrupt" / name) == snap


def test_a_replaced_weights_file_is_corrupt_but_a_changed_config_is_not(corpus, cache_dir, tmp_path, capsys,
                                                                       no_peak_measure):
    """Weights that disagree with the checkpoint's own optimizer state: corrupt, set aside, fallback. A
    checkpoint that agrees with itself but not with this run's model: an error (exit 2), nothing moved."""
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    assert cli.main(_cli(corpus, cache_dir, run, "--max_steps=4", "--ckpt_interval=2")) == 0
    other = {k: v.contiguous() for k, v in tiny_model().state_dict().items() if "blocks.1." not in k}
    rewrite(ckpts / "step_000004", "model.safetensors", save(other))  # a valid file, vouched for by the manifest
    with pytest.raises(CheckpointError, match=r"step_000004/model\.safetensors"):
        check_checkpoint(ckpts / "step_000004")
    capsys.readouterr()
    assert cli.main(_cli(corpus, cache_dir, run, "--max_steps=4", "--resume")) == 0
    assert _names(ckpts) == ["step_000002", "step_000004"] and _names(ckpts / "corrupt") == ["step_000004"]

    before = snapshot(ckpts)
    rc = cli.main(_cli(corpus, cache_dir, run, "--max_steps=6", "--resume", "--model.n_layers=3"))
    err = capsys.readouterr().err  # the run's config.yaml says it is another model: refused before loading
    assert rc == 2 and "as a different model (model.n_layers: 2 -> 3" in err and "Traceback" not in err
    assert snapshot(ckpts) == before
    (run / "config.yaml").unlink()  # the checkpoint's own copy still says what it was trained as
    rc = cli.main(_cli(corpus, cache_dir, run, "--max_steps=6", "--resume", "--model.n_layers=3"))
    err = capsys.readouterr().err
    assert rc == 2 and "as a different model (model.n_layers: 2 -> 3" in err and "step_000004/config.yaml" in err
    assert snapshot(ckpts) == before
    as_older_checkpoint(ckpts / "step_000004")  # without any record, the checkpoint loader finds the mismatch
    before = snapshot(ckpts)
    rc = cli.main(_cli(corpus, cache_dir, run, "--max_steps=6", "--resume", "--model.n_layers=3"))
    err = capsys.readouterr().err
    assert rc == 2 and "does not fit this model" in err and "Traceback" not in err
    assert snapshot(ckpts) == before


def test_a_run_read_while_its_saves_prune_the_checkpoint_being_read_opens_the_newer_one(tmp_path, corpus, cache_dir,
                                                                                      monkeypatch) -> None:
    """``generate``/``eval`` of a run still training with ``--keep_last 1``: the newest checkpoint is removed
    (a newer one saved, the old one pruned) while it is read. Before 2026-12-02 one try in six failed so."""
    import shutil

    from hybridnorm.train import run as run_module

    run = tmp_path / "run"
    assert cli.main(["train", *tiny_overrides(corpus, cache_dir, run), "--max-steps", "4", "--ckpt_interval=2",
                     "--keep_last=2"]) == 0
    ckpts = run / "checkpoints"
    newer = tmp_path / "step_000004"
    shutil.move(ckpts / "step_000004", newer)  # saved while step 2 is read, below
    real, calls = run_module.load_weights, []

    def save_and_prune_while_reading(ckpt, model):
        calls.append(ckpt.name)
        if len(calls) == 1:
            shutil.move(newer, ckpts / "step_000004")  # what the training process does meanwhile
            shutil.rmtree(ckpt)
        return real(ckpt, model)

    monkeypatch.setattr(run_module, "load_weights", save_and_prune_while_reading)
    opened = run_module.open_run(run)
    assert calls == ["step_000002", "step_000004"] and opened.checkpoint == ckpts / "step_000004"
    monkeypatch.setattr(run_module, "load_weights", real)
    again = run_module.open_run(ckpts / "step_000004")
    for (name, a), (_, b) in zip(opened.model.state_dict().items(), again.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # a checkpoint that is still there and fails is not retried: its error, once
    calls.clear()
    monkeypatch.setattr(run_module, "load_weights", lambda ckpt, model: calls.append(ckpt) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run_module.open_run(run)
    assert len(calls) == 1
