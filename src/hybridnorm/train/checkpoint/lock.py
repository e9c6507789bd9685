"""One trainer per run folder: check ``out_dir`` before any work, then hold an exclusive lock on it.

Two trainers writing one folder interleave checkpoints, prune each other's and append two histories to one
``metrics.jsonl``. :func:`claim_run_dir` refuses a second one with one line naming the folder and the
holder (pid, host, start time — written into the lock file by the holder). The lock is ``fcntl.flock`` on
``<out_dir>/train.lock``: the kernel drops it when the holding process dies, however it dies (SIGKILL, OOM,
power loss of the process), so a crashed run never leaves its folder locked; the holder deletes the file
when it finishes.

An ``out_dir`` that is a file, lies under a file, or cannot be created or written is refused up front with
one line, before data preparation or model building spend minutes on a run that could not be saved.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from hybridnorm import plain_data
from hybridnorm.errors import ConfigError
from hybridnorm.train.preflight import check_output_folder

LOCK_NAME = "train.lock"


class RunFolderBusy(ConfigError):
    """Another live process holds the run folder's lock; the message names it."""


def check_out_dir(run_dir: Path) -> None:
    """Refuse (:class:`ConfigError`) a file, a path under a file, or a folder that cannot be written (see
    :func:`check_writable_dir`); then create ``run_dir``: the lock file goes inside it."""
    check_output_folder(run_dir, "out_dir (--out)", may_hold=("run",))  # never into a folder of the user's other files
    ckpts = run_dir / "checkpoints"
    if ckpts.exists() and not ckpts.is_dir():  # else a resume would find no checkpoint and start the run over
        raise ConfigError(f"{ckpts} is a file, not the run's checkpoints folder: move it away or choose another "
                          "--out (nothing was changed)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"out_dir {run_dir} cannot be created: {e.strerror or e}") from None


def describe_holder(text: bytes) -> str:
    """Who holds a lock, from what it wrote into the lock file (it may not have written yet)."""
    try:
        info = plain_data.loads(text)
        return f"pid {info['pid']} on host {info['host']}, running since {info['since']}"
    except (ValueError, KeyError, TypeError):
        return "a process that is just starting (no pid recorded yet)"


def _holder(fd: int) -> str:
    try:
        return describe_holder(os.pread(fd, 4096, 0))
    except OSError:
        return describe_holder(b"")


class RunLock:
    """An exclusive, non-blocking ``flock`` on ``<run_dir>/train.lock`` (see the module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        for _ in range(100):  # each retry means a holder released in between: a handful at most
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:  # read-only file system, permissions
                raise ConfigError(f"out_dir {self.run_dir} is not writable: {e.strerror or e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _holder(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise RunFolderBusy(f"run folder {self.run_dir} is in use by another trainer ({holder}; lock "
                                        f"file {self.path}): wait for it to finish or stop it, or choose another "
                                        "--out") from None
                raise ConfigError(f"cannot lock run folder {self.run_dir}: {e.strerror or e}") from None
            # A holder deletes the file as it releases: if that happened between our open and our flock we
            # locked a file nobody else will ever open; retry on the one now at the path.
            try:
                current = os.stat(self.path)
                mine = os.fstat(fd)
                same = (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino)
            except OSError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise ConfigError(f"cannot lock run folder {self.run_dir}: its lock file keeps being replaced")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode("utf-8"), 0)
        except OSError as e:  # a full disk: the run could not save anything either
            os.close(fd)
            raise ConfigError(f"out_dir {self.run_dir} is not writable: {e.strerror or e}") from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still holding it: see acquire() for why this is safe
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def claim_run_dir(run_dir: str | Path, enabled: bool = True) -> Iterator[None]:
    """Check ``run_dir`` and hold its lock for the ``with`` block. ``enabled=False`` (a DDP rank other than
    0, which never writes the folder) does nothing."""
    if not enabled:
        yield
        return
    run_dir = Path(run_dir)
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # the folders this run will create
    check_out_dir(run_dir)
    try:
        with RunLock(run_dir):
            yield
    finally:  # a run refused before it wrote anything (bad data, a seed torch refuses) leaves no empty folder
        for folder in made:  # innermost first; a folder that holds anything stays
            with contextlib.suppress(OSError):
                folder.rmdir()
