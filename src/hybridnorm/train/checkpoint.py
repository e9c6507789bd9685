"""Checkpoints that never run code on load and never leave a half-written step behind.

Layout of one checkpoint (``<run>/checkpoints/step_000100/``)::

    model.safetensors       weights
    optimizer.safetensors   every optimizer state tensor, keyed ``state.<param index>.<name>``
    rng.safetensors         torch (and CUDA) RNG states
    state.json              step, counters, optimizer hyper-parameters and the names/shapes of its tensors,
                            data-loader position, extras
    manifest.json           size and sha256 of each file above — written last, so its presence marks
                            a complete checkpoint and its hashes catch truncation and corruption

A checkpoint is written to a temporary folder and renamed into place (atomic on POSIX); a save that fails
(a full disk, an I/O error) removes its temporary folder, leaves every earlier checkpoint as it was and
raises :class:`CheckpointSaveError` saying why. Then :func:`prune_checkpoints` keeps the newest
``keep_last`` good ones (see :mod:`hybridnorm.train.retention`: corrupt ones are set aside, never deleted).
Loading checks every file first (:func:`check_checkpoint`: hashes and schema) and changes nothing on disk;
:func:`latest_checkpoint` skips a corrupt one with a warning naming the bad file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from hybridnorm.errors import ConfigError
from hybridnorm.train.checkpoint_format import (
    FILES,
    MANIFEST,
    CheckpointError,
    check_checkpoint,
    list_checkpoints,
    sha256_of,
    verify_checkpoint,
)
from hybridnorm.train.retention import prune_checkpoints

__all__ = ["FILES", "CheckpointError", "CheckpointSaveError", "TrainState", "check_checkpoint", "latest_checkpoint",
           "list_checkpoints", "load_checkpoint", "load_weights", "save_checkpoint", "verify_checkpoint"]


class CheckpointSaveError(ConfigError):
    """Writing a checkpoint failed (disk full, I/O error, permissions); earlier checkpoints are untouched."""


@dataclass
class TrainState:
    """Everything beyond weights and optimizer tensors that an exact resume needs."""

    step: int = 0
    tokens: int = 0
    data: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def _optimizer_tensors(opt: torch.optim.Optimizer, model: nn.Module,
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    # which weight each parameter index is: lets a checkpoint be checked against itself (optimizer state vs
    # model.safetensors) without the model, so a swapped or replaced weights file reads as corrupt
    name_of = {id(p): n for n, p in model.named_parameters()}
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    live = [p for g in opt.param_groups for p in g["params"]]
    names = {str(i): name_of[id(p)] for i, p in zip(ids, live, strict=True) if id(p) in name_of}
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for name, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{idx}.{name}"] = value
    # the names and shapes written: a file later emptied or cut down no longer matches them (an optimizer
    # file holding no tensors is otherwise indistinguishable from a fresh AdamW)
    shapes = {k: list(v.shape) for k, v in tensors.items()}
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars, "tensors": shapes, "param_names": names}


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=1))
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _reason(e: BaseException) -> str:
    """'No space left on device', not a wrapped Rust error: safetensors reports I/O errors as its own type."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    m = re.search(r"I/O error: (.+?) \(os error \d+\)", str(e))
    return m.group(1) if m else str(e)


def _clear_leftovers(root: Path) -> None:
    """Remove what a save killed half-way left (the run folder is locked: no other save is running)."""
    for stale in root.glob(".tmp_step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in root.glob(".old_step_*"):  # killed between moving step_N aside and renaming its successor
        final = root / old.name[len(".old_"):].rsplit("_", 1)[0]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)


def save_checkpoint(ckpt_root: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainState, keep_last: int = 3) -> Path:
    """Write ``ckpt_root/step_<step>`` atomically, then prune to the newest ``keep_last`` good checkpoints."""
    root = Path(ckpt_root)
    final = root / f"step_{state.step:06d}"
    tmp = root / f".tmp_step_{state.step:06d}_{os.getpid()}"
    where = root
    try:
        root.mkdir(parents=True, exist_ok=True)
        _clear_leftovers(root)
        tmp.mkdir()
        where = tmp / "model.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(where))
        opt_tensors, opt_meta = _optimizer_tensors(optimizer, model)
        where = tmp / "optimizer.safetensors"
        save_file(opt_tensors, str(where))
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        where = tmp / "rng.safetensors"
        save_file(rng, str(where))
        where = tmp / "state.json"
        _write_json(where, {"step": state.step, "tokens": state.tokens, "data": state.data, "extra": state.extra,
                            "optimizer": opt_meta})
        for name in FILES[:3]:  # data on disk before the manifest vouches for it
            where = tmp / name
            _fsync(where)
        where = tmp / MANIFEST
        _write_json(where, {n: {"bytes": (tmp / n).stat().st_size, "sha256": sha256_of(tmp / n)} for n in FILES})
        where = final
        _publish(tmp, final)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(f"saving checkpoint {final} failed: {_reason(e)} (writing {where}); its "
                                  f"temporary folder was removed and the earlier checkpoints in {root} are kept"
                                  ) from None
    for moved in prune_checkpoints(root, keep_last, final):
        warnings.warn(f"set aside corrupt checkpoint {moved.checkpoint} -> {moved.moved_to}: {moved.reason}",
                      stacklevel=2)
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``; an existing ``final`` (the same step saved again) is replaced
    only once its successor is in place."""
    old = None
    if final.exists():
        old = final.with_name(f".old_{final.name}_{os.getpid()}")
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        if old is not None:
            os.replace(old, final)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a power cut (where folders can be synced)
        _fsync(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The newest checkpoint that passes :func:`check_checkpoint`; corrupt newer ones are skipped with a
    warning (and left where they are: this only reads)."""
    for path in reversed(list_checkpoints(ckpt_root)):
        try:
            check_checkpoint(path)
            return path
        except CheckpointError as e:
            warnings.warn(f"skipping bad checkpoint: {e}", stacklevel=2)
    return None


def _read_tensors(f: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(f))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"checkpoint file {f} cannot be read: {e}") from None


def _weights_for(ckpt: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of ``ckpt``, refused (naming the file) unless every name and shape fits ``model``."""
    f = ckpt / "model.safetensors"
    weights = _read_tensors(f)
    expected = model.state_dict()
    if set(weights) != set(expected):
        missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
        raise CheckpointError(f"checkpoint file {f} does not fit this model: missing {missing[:5]}, "
                              f"unexpected {extra[:5]}")
    for k, v in weights.items():
        if v.shape != expected[k].shape:
            raise CheckpointError(f"checkpoint file {f}: {k} has shape {tuple(v.shape)}, "
                                  f"the model expects {tuple(expected[k].shape)} (vocab or size mismatch?)")
    return weights


def _optimizer_state(ckpt: Path, opt: torch.optim.Optimizer, meta: dict[str, Any]) -> dict[str, Any]:
    """An ``opt.load_state_dict`` argument from ``ckpt``, refused unless its groups and tensor shapes fit ``opt``
    (torch would accept a misfit here and fail, or worse not fail, at the next step)."""
    f, sj = ckpt / "optimizer.safetensors", ckpt / "state.json"
    saved, live = meta["param_groups"], opt.param_groups
    sizes = [len(g["params"]) for g in saved], [len(g["params"]) for g in live]
    if sizes[0] != sizes[1]:
        raise CheckpointError(f"checkpoint files {sj} and {f} do not fit this optimizer: parameter groups of "
                              f"sizes {sizes[0]}, this model's are {sizes[1]} (decay settings changed?)")
    # torch pairs saved parameter indices with live parameters by position, group by group
    shape_of = {i: p.shape for g, lg in zip(saved, live, strict=True) for i, p in zip(g["params"], lg["params"],
                                                                                       strict=True)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in _read_tensors(f).items():
        _, idx, name = key.split(".", 2)
        if value.dim() and value.shape != shape_of[int(idx)]:
            raise CheckpointError(f"checkpoint file {f}: {key} has shape {tuple(value.shape)} but its parameter "
                                  f"(per {sj}) has {tuple(shape_of[int(idx)])}")
        state.setdefault(int(idx), {})[name] = value
    for key, value in meta["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g) for g in saved]
    return {"state": state, "param_groups": groups}


def _rng_states(ckpt: Path) -> dict[str, torch.Tensor]:
    f = ckpt / "rng.safetensors"
    rng = _read_tensors(f)
    try:
        torch.Generator().set_state(rng["torch"])  # a throwaway generator: refuse a bad state before using it
    except (RuntimeError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint file {f} holds an invalid RNG state: {e}") from None
    return rng


def load_weights(path: str | Path, model: nn.Module) -> None:
    """Load ``model.safetensors`` of a checkpoint folder (every file checked first) into ``model``."""
    ckpt = Path(path)
    check_checkpoint(ckpt)
    model.load_state_dict(_weights_for(ckpt, model))


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    ) -> TrainState:
    """Restore weights, optimizer and RNG from a checked checkpoint; return its :class:`TrainState`. Everything
    is read and checked before anything is changed, so a refused checkpoint leaves model and optimizer as
    they were."""
    ckpt = Path(path)
    body = check_checkpoint(ckpt)
    weights = _weights_for(ckpt, model)
    opt_state = _optimizer_state(ckpt, optimizer, body["optimizer"]) if optimizer is not None else None
    rng = _rng_states(ckpt)
    model.load_state_dict(weights)
    if optimizer is not None:
        try:
            optimizer.load_state_dict(opt_state)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint files {ckpt / 'state.json'} and {ckpt / 'optimizer.safetensors'} "
                                  f"do not load into this optimizer: {e}") from None
    torch.set_rng_state(rng["torch"])
    cuda = [rng[k] for k in sorted((k for k in rng if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    return TrainState(step=body["step"], tokens=body["tokens"], data=body["data"], extra=body["extra"])
