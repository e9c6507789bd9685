"""Which checkpoints a run keeps: keep-last pruning that can never lose the newest good checkpoint, corrupt
checkpoints set aside instead of deleted, and the checkpoint a resumed run starts from.

Rules, each there because breaking it once loses a run:

* **Corrupt checkpoints are never deleted.** They are moved (a rename, nothing copied) into
  ``checkpoints/corrupt/step_N`` (``step_N.1``, ... if that name is taken), out of :func:`list_checkpoints`'
  sight, so a person can still inspect or repair them. They do not count towards ``keep_last``.
* **Pruning counts good checkpoints only.** Walking from the newest step down, the checkpoint just written
  and the next good ones fill the ``keep_last`` window; only checkpoints older than the window are deleted.
  So neither the one just written nor the newest good one can be pruned, whatever else is in the folder.
* **Resume takes the newest good checkpoint**, setting aside every corrupt one newer than it. If there is
  none but there were checkpoints (now, or set aside before), resuming is refused: restarting at step 0
  would silently throw the run's progress away.

Both checkpoint layouts (whole, or sharded by FSDP ranks: :mod:`hybridnorm.train.checkpoint.layout`) follow
these rules alike. "Good" means :func:`check_checkpoint` passes (hashes and the schema of every file).
Hashing gigabytes at every save would be slow, so a checkpoint that passed in this process is remembered
with the size, mtime and inode of each of its files, and checked again only when one of them changes (each
checkpoint is thus hashed about once more in a run's life, at the first save after it settled, not at every
save).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridnorm.train.checkpoint.format import CheckpointError, check_checkpoint, list_checkpoints
from hybridnorm.train.checkpoint.layout import NewerFormatError

CORRUPT_DIR = "corrupt"

_SETTLED_S = 2.0  # seconds after its last write a checkpoint's file signature is trusted (see remember_good)
_good: dict[Path, tuple] = {}  # checkpoint folder -> file signature when it last passed check_checkpoint


@dataclass
class SetAside:
    """A corrupt checkpoint moved out of the way: where it was, where it is now, and what is wrong with it."""

    checkpoint: Path
    moved_to: Path
    reason: str


@dataclass
class ResumePoint:
    """The checkpoint to resume from (None: a fresh start) and the corrupt ones set aside on the way."""

    path: Path | None
    set_aside: list[SetAside] = field(default_factory=list)


def _signature(ckpt: Path) -> tuple | None:
    try:
        return tuple(sorted((p.name, st.st_size, st.st_mtime_ns, st.st_ino)
                            for p in ckpt.iterdir() for st in (p.stat(),)))
    except OSError:
        return None


def remember_good(ckpt: Path) -> None:
    """Record ``ckpt`` as good (it was just checked) as long as its files do not change. Not while its files
    are fresh: file times tick coarsely (a jiffy or more), so a change within the same tick as the last
    write would keep the signature; a checkpoint recorded later is re-hashed once more instead."""
    sig = _signature(ckpt)
    if sig is not None and max(mtime for _, _, mtime, _ in sig) < (time.time() - _SETTLED_S) * 1e9:
        _good[ckpt.absolute()] = sig


def problem_of(ckpt: Path) -> str | None:
    """Why ``ckpt`` is unusable (the :class:`CheckpointError` message naming the file), or None if it is good.
    A checkpoint of a newer format is not corrupt: its :class:`NewerFormatError` is raised, not returned, so that
    no caller sets it aside."""
    sig = _signature(ckpt)
    if sig is not None and _good.get(ckpt.absolute()) == sig:
        return None
    try:
        check_checkpoint(ckpt)
    except NewerFormatError:
        raise
    except CheckpointError as e:
        return str(e)
    remember_good(ckpt)
    return None


def set_aside(ckpt: Path) -> Path:
    """Move ``ckpt`` into ``<its folder>/corrupt/`` under a free name; returns the new path. Never deletes."""
    dest_dir = ckpt.parent / CORRUPT_DIR
    dest_dir.mkdir(exist_ok=True)
    dest, k = dest_dir / ckpt.name, 0
    while dest.exists() or dest.is_symlink():
        k += 1
        dest = dest_dir / f"{ckpt.name}.{k}"
    os.replace(ckpt, dest)  # same file system: a rename, atomic, no copy
    _good.pop(ckpt.absolute(), None)
    return dest


def prune_checkpoints(ckpt_root: str | Path, keep_last: int, just_written: Path) -> list[SetAside]:
    """Keep the newest ``keep_last`` good checkpoints (``just_written`` always, and counted); delete the ones
    older than that window; set aside (not count, not delete) corrupt ones met inside it. ``keep_last`` <= 0
    keeps everything. Returns what was set aside."""
    if keep_last <= 0:
        return []
    moved: list[SetAside] = []
    kept = 0
    for ckpt in reversed(list_checkpoints(ckpt_root)):
        if ckpt == just_written:
            kept += 1
        elif kept >= keep_last:
            shutil.rmtree(ckpt, ignore_errors=True)
            _good.pop(ckpt.absolute(), None)
        else:
            try:
                problem = problem_of(ckpt)
            except NewerFormatError:  # this code cannot tell whether it is good: left where it is, uncounted
                continue
            if problem is None:
                kept += 1
                continue
            try:
                moved.append(SetAside(ckpt, set_aside(ckpt), problem))
            except OSError:  # cannot move it: leave it where it is (still uncounted), never delete it
                continue
    return moved


def checkpoint_for_resume(ckpt_root: str | Path, set_aside_bad: bool = True) -> ResumePoint:
    """The newest good checkpoint under ``ckpt_root``, setting aside each corrupt one newer than it (with
    ``set_aside_bad``; a DDP rank other than 0 only looks, after rank 0 has moved them). Raises
    :class:`CheckpointError` naming the folder when checkpoints exist (or were set aside) but none is good, and
    :class:`NewerFormatError` at a checkpoint of a newer format (left in place: an older one behind it would
    resume the run from the past)."""
    root = Path(ckpt_root)
    moved: list[SetAside] = []
    for ckpt in reversed(list_checkpoints(root)):
        problem = problem_of(ckpt)
        if problem is None:
            return ResumePoint(ckpt, moved)
        if set_aside_bad:
            try:
                moved.append(SetAside(ckpt, set_aside(ckpt), problem))
            except OSError as e:
                raise CheckpointError(f"cannot set aside the corrupt checkpoint {ckpt} ({problem}): "
                                      f"{e.strerror or e}") from None
    corrupt = root / CORRUPT_DIR
    if moved:
        raise CheckpointError(
            f"cannot resume: every checkpoint in {root} is corrupt ({len(moved)} moved to {corrupt}; newest: "
            f"{moved[0].reason}). Delete {corrupt} to start this run over from step 0, or train into another "
            "--out")
    if corrupt.is_dir() and any(corrupt.iterdir()):
        raise CheckpointError(
            f"cannot resume: {root} holds no good checkpoint, only corrupt ones set aside in {corrupt}. Delete "
            f"{corrupt} to start this run over from step 0, or train into another --out")
    if not set_aside_bad and list_checkpoints(root):
        raise CheckpointError(f"cannot resume: no checkpoint in {root} is good")
    return ResumePoint(None, [])
