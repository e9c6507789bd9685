"""Helpers for the checkpoint and run-folder tests: a tiny trained checkpoint, a snapshot of a folder's bytes
(or of what a checkpoint holds apart from its copy of the run's settings), rewriting one file of a checkpoint
with (or without) a manifest that vouches for the new bytes, a checkpoint made into one written before
checkpoints kept copies of the run's files, and a trainer in a subprocess."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridnorm.config import ModelConfig
from hybridnorm.nn.model import lm_loss
from hybridnorm.train.checkpoint import RUN_FILES, TrainState, save_checkpoint
from hybridnorm.train.optim import OptimConfig, build_optimizer

DATA = {"epoch": 0, "step": 3, "seed": 0, "seq_len": 32, "global_batch": 4, "n_tokens": 17206}


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ModelConfig.from_preset("tiny", vocab_size=256).build()


def model_and_optimizer(steps: int = 1, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny model and its AdamW after ``steps`` updates (0: an optimizer with no state yet)."""
    model = tiny_model(seed)
    opt = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=gen)
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def write_checkpoint(root: Path, step: int, keep_last: int = 0, model_opt=None) -> Path:
    model, opt = model_opt or model_and_optimizer()
    state = TrainState(step=step, tokens=step * 128, data=dict(DATA),
                       extra={"spike_detector": {"loss": [5.0, 4.9], "grad_norm": [1.0, 1.1]}})
    return save_checkpoint(root, model, opt, state, keep_last)


def snapshot(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder``: equal snapshots mean nothing was changed,
    deleted or added."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def trained_state(ckpt: Path) -> dict[str, str]:
    """:func:`snapshot` of a checkpoint without its copy of the run's ``config.yaml`` (its manifest entry
    too): what two runs that differ only in where and how they save (``out_dir``, ``async_checkpoint``)
    must write alike."""
    snap = snapshot(ckpt)
    del snap["config.yaml"]
    manifest = json.loads((ckpt / "manifest.json").read_text(encoding="utf-8"))
    del manifest["config.yaml"]
    snap["manifest.json"] = json.dumps(manifest, sort_keys=True)
    return snap


def as_older_checkpoint(ckpt: Path) -> None:
    """Make ``ckpt`` one written before checkpoints kept copies of the run's files (RUN_FILES)."""
    manifest = json.loads((ckpt / "manifest.json").read_text(encoding="utf-8"))
    for name in RUN_FILES:
        if name in manifest:
            (ckpt / name).unlink()
            del manifest[name]
    (ckpt / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")


def rewrite(ckpt: Path, name: str, data: bytes, fix_manifest: bool = True) -> None:
    """Replace ``ckpt/name`` with ``data``; with ``fix_manifest`` also record its new size and hash, as a
    hand edit (or a bug in a writer) would, so only the schema checks can catch it."""
    (ckpt / name).write_bytes(data)
    if fix_manifest:
        manifest_path = ckpt / "manifest.json"
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        manifest[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        manifest_path.write_text(json.dumps(manifest), encoding="utf-8")


def flip_byte(path: Path, offset_from_end: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def start_trainer(args: list[str], log: Path, wrapper: list[str] | None = None) -> subprocess.Popen:
    """``python -m hybridnorm.cli train ARGS`` (or ``python WRAPPER... ARGS``) in a clean environment, its
    output in ``log`` (a file, not a pipe: a full pipe would block the trainer)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    cmd = [sys.executable, *(wrapper or ["-m", "hybridnorm.cli"]), "train", *args]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def wait_for(proc: subprocess.Popen, cond: Callable[[], bool], log: Path, timeout: float = 120.0) -> None:
    """Poll ``cond`` until true; fail (with the log's tail) if the process exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"trainer exited early with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"timed out waiting for the trainer:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.02)


def train_records(run_dir: Path) -> int:
    """How many ``train`` records the run has logged so far (0 before metrics.jsonl exists)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum('"kind": "train"' in line for line in path.read_text(encoding="utf-8").splitlines())
