"""Writing checkpoints: never a half-written step behind, and (under FSDP) every rank writing its own shards.

Layout of one checkpoint (``<run>/checkpoints/step_000100/``)::

    model.safetensors       weights
    optimizer.safetensors   every optimizer state tensor, keyed ``state.<param index>.<name>``
    rng.safetensors         torch (and CUDA) RNG states
    state.json              format version, step, counters, optimizer hyper-parameters and the names/shapes
                            of its tensors, data-loader position, extras
    config.yaml             copies of the run's files as they were at this step (``run_files``; written by
    tokenizer.json          the trainer and by ``hybridnorm import``), so the folder opens on its own;
    tokenizer_config.json   only with a tokenizer whose end-of-text token its folder declared
    chat_templates.json     only in a run imported from a folder with chat templates (and its fine-tuning)
    manifest.json           size and sha256 of each file above — written last, so its presence marks
                            a complete checkpoint and its hashes catch truncation and corruption

A run whose weights are FSDP shards writes the sharded layout instead (``model-r<rank>.safetensors`` and
``optimizer-r<rank>.safetensors`` per rank, see :mod:`hybridnorm.train.checkpoint.layout`): every rank writes
its own pieces into the same temporary folder, then rank 0 writes the rest and the manifest over all of them.
Either layout loads into either kind of run (:mod:`hybridnorm.train.checkpoint.load`).

A checkpoint is written to a temporary folder and renamed into place (atomic on POSIX); a save that fails
(a full disk, an I/O error — on any rank) removes its temporary folder, leaves every earlier checkpoint as it
was and raises :class:`CheckpointSaveError` saying why (on every rank). Then :func:`prune_checkpoints` keeps
the newest ``keep_last`` good ones (see :mod:`hybridnorm.train.checkpoint.retention`: corrupt ones are set aside, never
deleted). Loading checks every file first (:func:`check_checkpoint`: hashes and schema) and changes nothing
on disk; :func:`latest_checkpoint` skips a corrupt one with a warning naming the bad file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from hybridnorm.errors import ConfigError, write_failure
from hybridnorm.train.checkpoint.format import (
    FILES,
    MANIFEST,
    CheckpointError,
    check_checkpoint,
    list_checkpoints,
    sha256_of,
)
from hybridnorm.train.checkpoint.layout import (
    COMMON,
    FORMAT_VERSION,
    KINDS,
    RUN_FILES,
    NewerFormatError,
    shard_file,
    shard_ranks,
)
from hybridnorm.train.checkpoint.load import TrainState
from hybridnorm.train.checkpoint.retention import prune_checkpoints
from hybridnorm.train.checkpoint.shards import is_sharded, local_pieces
from hybridnorm.train.distributed import Dist, all_reduce_max, current_dist

__all__ = ["CheckpointSaveError", "PendingSave", "latest_checkpoint", "save_checkpoint", "start_checkpoint"]


class CheckpointSaveError(ConfigError):
    """Writing a checkpoint failed (disk full, I/O error, permissions); earlier checkpoints are untouched.
    ``write_reason`` is the failure alone, for a caller that wrote the checkpoint somewhere of its own and
    names that instead (``errors.write_failure``)."""

    def __init__(self, message: str, write_reason: str) -> None:
        super().__init__(message)
        self.write_reason = write_reason


def _optimizer_tensors(opt: torch.optim.Optimizer, model: nn.Module,
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The optimizer's state tensors as they are (``DTensor`` shards under FSDP), keyed ``state.<i>.<name>``,
    and what ``state.json`` records of it."""
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
                tensors[f"state.{idx}.{name}"] = value.detach()
            else:
                scalars[f"{idx}.{name}"] = value
    # the names and (global) shapes written: a file later emptied or cut down no longer matches them (an
    # optimizer file holding no tensors is otherwise indistinguishable from a fresh AdamW)
    shapes = {k: list(v.shape) for k, v in tensors.items()}
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars, "tensors": shapes, "param_names": names}


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, obj: Any) -> None:
    _write_bytes(path, json.dumps(obj, indent=1).encode("utf-8"))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _whole(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}


class _Save:
    """One checkpoint being written into its temporary folder. ``where`` is the path being written, so a
    failure names it."""

    def __init__(self, root: Path, step: int, tmp_name: str) -> None:
        self.root, self.final, self.tmp = root, root / f"step_{step:06d}", root / tmp_name
        self.where = root

    def begin(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        _clear_leftovers(self.root)
        self.tmp.mkdir()

    def tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self.where = self.tmp / name
        save_file(tensors, str(self.where))

    def fsync(self, names: tuple[str, ...] | list[str]) -> None:
        for name in names:  # data on disk before the manifest vouches for it
            self.where = self.tmp / name
            _fsync(self.where)

    def seal(self, state: TrainState, rng: dict[str, torch.Tensor], body: dict[str, Any],
             data_files: tuple[str, ...] | list[str], run_files: dict[str, bytes]) -> None:
        """rng + state.json (``body`` adds to it) + ``run_files``, then the manifest over ``data_files`` and
        those, then rename into place. ``data_files`` were written and fsynced before."""
        self.tensors("rng.safetensors", rng)
        self.where = self.tmp / "state.json"
        _write_json(self.where, {"format": FORMAT_VERSION, "step": state.step, "tokens": state.tokens,
                                 "data": state.data, "extra": state.extra, **body})
        self.fsync(["rng.safetensors"])
        for name, data in run_files.items():
            self.where = self.tmp / name
            _write_bytes(self.where, data)
        files = [*data_files, *COMMON, *run_files]
        self.where = self.tmp / MANIFEST
        _write_json(self.where, {n: {"bytes": (self.tmp / n).stat().st_size, "sha256": sha256_of(self.tmp / n)}
                                 for n in files})
        self.where = self.final
        _publish(self.tmp, self.final)

    def error(self, e: BaseException | None) -> CheckpointSaveError:
        shutil.rmtree(self.tmp, ignore_errors=True)
        if e is None:
            reason = why = "another rank failed to write (its error says why)"
        else:  # 'No space left on device', not safetensors' wrapped Rust error
            reason = write_failure(e) or str(e)
            why = f"{reason} (writing {self.where})"
        return CheckpointSaveError(f"saving checkpoint {self.final} failed: {why}; its temporary folder was removed "
                                   f"and the earlier checkpoints in {self.root} are kept", reason)


def _rng_state() -> dict[str, torch.Tensor]:
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return rng


def _agree(failed: BaseException | None, save: _Save, d: Dist) -> None:
    """Every rank learns whether any failed, and then all raise: none may go on training (and wait forever
    for the others) while another stops."""
    if all_reduce_max(torch.tensor(float(failed is not None)), d).item() > 0:
        raise save.error(failed) from None  # failed is None: this rank wrote its part, another did not


class PendingSave:
    """A checkpoint whose files this rank writes, in a background thread when ``background`` (the training
    steps go on meanwhile) or at once. :meth:`wait` joins the writer and then seals the checkpoint (rng,
    state.json, manifest, rename into place: every rank together under FSDP) and prunes: nothing is
    published before. A process killed in between leaves only the temporary folder the next save clears."""

    def __init__(self, save: _Save, write: Callable[[], None], seal: Callable[[], None], sharded: bool,
                 d: Dist, keep_last: int, background: bool) -> None:
        self.save, self._seal, self.sharded, self.d, self.keep_last = save, seal, sharded, d, keep_last
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None

        def run() -> None:
            try:
                write()
            except Exception as e:  # reported (and agreed on) in wait()
                self._failed = e

        if background:
            self._thread = threading.Thread(target=run, name=f"checkpoint {save.final.name}", daemon=True)
            self._thread.start()
        else:
            run()

    def wait(self) -> Path:
        """The published checkpoint; raises :class:`CheckpointSaveError` (on every rank under FSDP) if
        writing or sealing failed anywhere, leaving the earlier checkpoints as they were."""
        if self._thread is not None:
            self._thread.join()
        failed = self._failed
        for stage in ("write", "seal"):
            if stage == "seal" and self.d.is_main:
                try:
                    self._seal()
                except (OSError, SafetensorError) as e:
                    failed = e
            if self.sharded:
                _agree(failed, self.save, self.d)
            elif failed is not None:
                raise self.save.error(failed) from None
        if self.d.is_main:
            for moved in prune_checkpoints(self.save.root, self.keep_last, self.save.final):
                warnings.warn(f"set aside corrupt checkpoint {moved.checkpoint} -> {moved.moved_to}: {moved.reason}",
                              stacklevel=2)
        return self.save.final


def _owned(tensors: dict[str, torch.Tensor], copy: bool) -> dict[str, torch.Tensor]:
    """``tensors`` (already on the CPU) as this save's own copies when ``copy``: a background writer must not
    read weights that the next optimizer steps change in place (a GPU tensor's ``.cpu()`` is a copy already)."""
    return {k: v.clone() for k, v in tensors.items()} if copy else tensors


def start_checkpoint(ckpt_root: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                     state: TrainState, keep_last: int = 3, d: Dist | None = None,
                     background: bool = False, run_files: dict[str, bytes] | None = None) -> PendingSave | None:
    """Begin writing ``ckpt_root/step_<step>``: what it holds is fixed now (weights, optimizer state, rng,
    ``state``), the files are written at once or, with ``background``, while training goes on; call
    :meth:`PendingSave.wait` (on every rank, at the same point) to publish it. ``run_files`` (name -> content,
    names from :data:`~hybridnorm.train.checkpoint.layout.RUN_FILES`; rank 0's count) are the run's
    ``config.yaml`` and the files its tokenizer saved (``Tokenizer.files``) to keep with it.

    In a run of several processes (``d``) call it on every rank: a sharded (FSDP) model is saved by all of
    them together; a whole one by rank 0 alone (the others get None)."""
    run_files = dict(run_files or {})
    if unknown := sorted(set(run_files) - set(RUN_FILES)):
        raise ValueError(f"run_files may hold {RUN_FILES}, not {unknown}")
    d = d or current_dist()
    root, sharded = Path(ckpt_root), is_sharded(model)
    if not sharded and not d.is_main:
        return None
    copy = background and next(iter(model.parameters())).device.type == "cpu"
    state = replace(state, data=json.loads(json.dumps(state.data)), extra=json.loads(json.dumps(state.extra)))
    # one temporary name every rank can compute (the run folder is locked: no other save of this step runs)
    save = _Save(root, state.step, f".tmp_step_{state.step:06d}_" + ("sharded" if sharded else str(os.getpid())))
    failed: BaseException | None = None
    if d.is_main:
        try:
            save.begin()
        except OSError as e:
            failed = e
    if sharded:
        _agree(failed, save, d)  # also: the folder exists before anyone writes into it
    elif failed is not None:
        raise save.error(failed) from None
    rng = _rng_state()
    weights = model.state_dict()
    opt_tensors, opt_meta = _optimizer_tensors(optimizer, model)
    if sharded:
        names = [shard_file(k, d.rank) for k in KINDS]
        pieces = _owned(local_pieces(weights, d.rank), copy)
        opt_pieces = _owned(local_pieces(opt_tensors, d.rank), copy)
        shapes = {k: list(v.shape) for k, v in weights.items()}

        def write() -> None:
            if pieces or d.is_main:  # under HSDP a replica whose shards another group writes has nothing to add
                save.tensors(names[0], pieces)
                save.tensors(names[1], opt_pieces)
                save.fsync(names)

        def seal() -> None:
            ranks = shard_ranks(p.name for p in save.tmp.iterdir())
            save.seal(state, rng, {"optimizer": opt_meta, "shards": {"ranks": ranks, "model": shapes}},
                      [shard_file(k, r) for r in ranks for k in KINDS], run_files)
    else:
        whole = {"model.safetensors": _owned(_whole(weights), copy),
                 "optimizer.safetensors": _owned(_whole(opt_tensors), copy)}

        def write() -> None:
            for name, tensors in whole.items():
                save.tensors(name, tensors)
            save.fsync(FILES[:2])

        def seal() -> None:
            save.seal(state, rng, {"optimizer": opt_meta}, FILES[:2], run_files)

    return PendingSave(save, write, seal, sharded, d, keep_last, background)


def save_checkpoint(ckpt_root: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainState, keep_last: int = 3, d: Dist | None = None,
                    run_files: dict[str, bytes] | None = None) -> Path | None:
    """Write ``ckpt_root/step_<step>`` atomically, then prune to the newest ``keep_last`` good checkpoints
    (:func:`start_checkpoint` and its ``wait``, in the foreground)."""
    pending = start_checkpoint(ckpt_root, model, optimizer, state, keep_last, d, run_files=run_files)
    return pending.wait() if pending is not None else None


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


def latest_checkpoint(ckpt_root: str | Path, *, why_none: list[str] | None = None) -> Path | None:
    """The newest checkpoint that passes :func:`check_checkpoint`; corrupt newer ones are skipped with a
    warning (and left where they are: this only reads); one of a newer format raises ``NewerFormatError``.
    With ``why_none``, a caller that makes no good checkpoint an error gets each one's problem there (newest
    first) instead of the warnings."""
    problems, good = [], None
    for path in reversed(list_checkpoints(ckpt_root)):
        try:
            check_checkpoint(path)
        except NewerFormatError:  # not corrupt: skipping it would quietly read an older step instead
            raise
        except CheckpointError as e:
            problems.append(str(e))
            continue
        good = path
        break
    if good is None and why_none is not None:
        why_none.extend(problems)
    else:
        for problem in problems:
            warnings.warn(f"skipping bad checkpoint: {problem}", stacklevel=2)
    return good
