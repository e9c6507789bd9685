"""Checkpoints that never run code on load and never leave a half-written step behind.

Layout of one checkpoint (``<run>/checkpoints/step_000100/``)::

    model.safetensors       weights
    optimizer.safetensors   every optimizer state tensor, keyed ``state.<param index>.<name>``
    rng.safetensors         torch (and CUDA) RNG states
    state.json              step, counters, optimizer hyper-parameters, data-loader position, extras
    manifest.json           size and sha256 of each file above — written last, so its presence marks
                            a complete checkpoint and its hashes catch truncation and corruption

A checkpoint is written to a temporary folder and renamed into place (atomic on POSIX), then all but
the newest ``keep_last`` are deleted. Loading verifies the manifest; :func:`latest_checkpoint` skips a
corrupt one with a warning naming the bad file and falls back to the newest good one.
"""

from __future__ import annotations

import hashlib
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

FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ConfigError):
    """A checkpoint is missing, truncated or corrupt; the message names the file."""


@dataclass
class TrainState:
    """Everything beyond weights and optimizer tensors that an exact resume needs."""

    step: int = 0
    tokens: int = 0
    data: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for name, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for key, value in meta["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in meta["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})


def save_checkpoint(ckpt_root: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainState, keep_last: int = 3) -> Path:
    """Write ``ckpt_root/step_<step>`` atomically and prune to the newest ``keep_last``."""
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.step:06d}"
    for stale in root.glob(".tmp_step_*"):  # left by a save that was killed half-way
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp_step_{state.step:06d}_{os.getpid()}"
    tmp.mkdir()
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(weights, str(tmp / "model.safetensors"))
    opt_tensors, opt_meta = _optimizer_tensors(optimizer)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(rng, str(tmp / "rng.safetensors"))
    body = {"step": state.step, "tokens": state.tokens, "data": state.data, "extra": state.extra,
            "optimizer": opt_meta}
    (tmp / "state.json").write_text(json.dumps(body, indent=1), encoding="utf-8")
    manifest = {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in FILES}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    for f in tmp.iterdir():  # data on disk before the rename makes it visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """Completed-looking checkpoint folders, oldest first (temporary folders are ignored)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def verify_checkpoint(path: str | Path) -> None:
    """Raise :class:`CheckpointError` naming the first missing, truncated or corrupt file."""
    path = Path(path)
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {manifest_path} is missing")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint file {manifest_path} is corrupt: {e}") from None
    for name in FILES:
        f = path / name
        if name not in manifest or not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        if f.stat().st_size != manifest[name]["bytes"]:
            raise CheckpointError(f"checkpoint file {f} is truncated ({f.stat().st_size} bytes, "
                                  f"expected {manifest[name]['bytes']})")
        if _sha256(f) != manifest[name]["sha256"]:
            raise CheckpointError(f"checkpoint file {f} is corrupt (sha256 mismatch)")


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The newest checkpoint that verifies; corrupt newer ones are skipped with a warning."""
    for path in reversed(list_checkpoints(ckpt_root)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            warnings.warn(f"skipping bad checkpoint: {e}", stacklevel=2)
    return None


def load_weights(path: str | Path, model: nn.Module) -> None:
    """Load ``model.safetensors`` of a checkpoint folder (verified) into ``model``."""
    path = Path(path)
    verify_checkpoint(path)
    f = path / "model.safetensors"
    try:
        weights = load_file(str(f))
    except SafetensorError as e:
        raise CheckpointError(f"checkpoint file {f} cannot be read: {e}") from None
    model_keys = set(model.state_dict())
    if set(weights) != model_keys:
        missing, extra = sorted(model_keys - set(weights)), sorted(set(weights) - model_keys)
        raise CheckpointError(f"checkpoint file {f} does not fit this model: missing {missing[:5]}, "
                              f"unexpected {extra[:5]}")
    for k, v in weights.items():
        want = model.state_dict()[k].shape
        if v.shape != want:
            raise CheckpointError(f"checkpoint file {f}: {k} has shape {tuple(v.shape)}, "
                                  f"the model expects {tuple(want)} (vocab or size mismatch?)")
    model.load_state_dict(weights)


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    ) -> TrainState:
    """Restore weights, optimizer and RNG from a verified checkpoint; return its :class:`TrainState`."""
    path = Path(path)
    load_weights(path, model)
    body = json.loads((path / "state.json").read_text(encoding="utf-8"))
    if optimizer is not None:
        _restore_optimizer(optimizer, load_file(str(path / "optimizer.safetensors")), body["optimizer"])
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["torch"])
    cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    return TrainState(step=body["step"], tokens=body["tokens"], data=body["data"], extra=body["extra"])
