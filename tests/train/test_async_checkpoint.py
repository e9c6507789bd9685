"""Checkpoints written in a background thread (``async_checkpoint``): the checkpoint holds the state of the
moment the save began even while training changes the weights in place; nothing is published before
``wait``; a failure in the background is the same error as in the foreground, with the same clean-up; a
training run with it writes the same checkpoints as one without."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import DATA, model_and_optimizer, snapshot, trained_state
from safetensors.torch import load_file

import hybridnorm.train.checkpoint.save as save_module
import hybridnorm.train.trainer as trainer
from hybridnorm.train.checkpoint import (
    CheckpointSaveError,
    TrainState,
    list_checkpoints,
    save_checkpoint,
    start_checkpoint,
    verify_checkpoint,
)


def _state(step: int) -> TrainState:
    return TrainState(step=step, tokens=step * 128, data=dict(DATA), extra={"spike_detector": {"loss": [5.0]}})


def _held_writer(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """save_file waits for ``go`` (set ``started`` first): the background writer is held mid-save."""
    started, go, real = threading.Event(), threading.Event(), save_module.save_file

    def held(tensors, filename):
        started.set()
        assert go.wait(60)
        return real(tensors, filename)

    monkeypatch.setattr(save_module, "save_file", held)
    return started, go


def test_the_checkpoint_is_the_state_when_the_save_began_and_is_published_only_by_wait(tmp_path, monkeypatch):
    model, opt = model_and_optimizer(steps=2)
    rng_then = torch.get_rng_state()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    started, go = _held_writer(monkeypatch)
    state = _state(4)
    pending = start_checkpoint(tmp_path / "a", model, opt, state, background=True)
    assert started.wait(60)
    with torch.no_grad():  # the next steps change weights, optimizer state, counters and rng meanwhile
        for p in model.parameters():
            p.add_(1.0)
        for st in opt.state.values():
            st["exp_avg"].add_(1.0)
    state.step, state.data["step"] = 99, 99
    torch.rand(10)
    assert list_checkpoints(tmp_path / "a") == [] and list((tmp_path / "a").glob(".tmp_step_000004_*"))
    go.set()
    ckpt = pending.wait()
    assert ckpt == tmp_path / "a" / "step_000004"
    verify_checkpoint(ckpt)
    got = load_file(ckpt / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(load_file(ckpt / "rng.safetensors")["torch"], rng_then)
    assert '"step": 4' in (ckpt / "state.json").read_text()
    assert not list((tmp_path / "a").glob(".tmp_*"))


def test_background_and_foreground_saves_write_the_same_bytes(tmp_path):
    model, opt = model_and_optimizer(steps=2)
    rng = torch.get_rng_state()
    start_checkpoint(tmp_path / "bg", model, opt, _state(2), background=True).wait()
    torch.set_rng_state(rng)
    save_checkpoint(tmp_path / "fg", model, opt, _state(2))
    assert snapshot(tmp_path / "bg") == snapshot(tmp_path / "fg")


def test_a_failure_in_the_background_is_raised_by_wait_and_leaves_the_earlier_checkpoints(tmp_path, monkeypatch):
    model, opt = model_and_optimizer()
    save_checkpoint(tmp_path, model, opt, _state(2))
    before = snapshot(tmp_path)
    real, calls = save_module.save_file, []

    def full_disk(tensors, filename):  # the second file: half a checkpoint is on disk
        calls.append(filename)
        if len(calls) == 2:
            Path(filename).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real(tensors, filename)

    monkeypatch.setattr(save_module, "save_file", full_disk)
    pending = start_checkpoint(tmp_path, model, opt, _state(4), keep_last=1, background=True)
    with pytest.raises(CheckpointSaveError, match=r"step_000004 failed: No space left on device \(writing "
                                                  r".*optimizer\.safetensors\)"):
        pending.wait()
    assert snapshot(tmp_path) == before  # temporary folder gone, nothing pruned


def test_a_run_with_async_checkpoints_writes_what_a_run_without_them_writes(make_cfg, tmp_path):
    """Every checkpoint of a 6-step run (saved every 2 steps) is byte-identical with and without
    async_checkpoint, state.json and manifest included (but for the copy of the run's config.yaml, which
    records the setting), and no temporary folder is left."""
    runs = {}
    for mode in ("false", "true"):
        out = tmp_path / mode
        trainer.train(make_cfg(out, "--max_steps=6", "--ckpt_interval=2", "--keep_last=0",
                               f"--async_checkpoint={mode}"), quiet=True)
        runs[mode] = out / "checkpoints"
    names = [p.name for p in list_checkpoints(runs["true"])]
    assert names == ["step_000002", "step_000004", "step_000006"]
    assert names == [p.name for p in list_checkpoints(runs["false"])]
    for name in names:
        assert trained_state(runs["false"] / name) == trained_state(runs["true"] / name), name
        verify_checkpoint(runs["true"] / name)
    assert not list(runs["true"].glob(".tmp_*"))
