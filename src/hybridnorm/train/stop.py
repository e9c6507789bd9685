"""SIGINT / SIGTERM during training: finish the step, save, exit 130 — and a second signal cannot break that.

:class:`StopFlag` (around the training loop) turns the first signal into a flag the loop checks after each
step; it then saves a checkpoint and returns. People and schedulers repeat signals (Ctrl-C twice; SLURM's
SIGTERM then SIGTERM), and a repeated signal that killed the process during the save, or printed a
``KeyboardInterrupt`` traceback during the exit after it, would turn a clean stop into an unclear one. So
once a stop is under way every further SIGINT/SIGTERM is ignored with a note on stderr, while the loop
runs (the save) and — for a command-line process, through :func:`process_signals` — until the process has
exited with 130.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a Dist only in hints: this module is imported before torch is
    from hybridnorm.train.distributed import Dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stopping = False  # a StopFlag in this process took a signal: the process is on its way out


def stop_requested() -> bool:
    """Whether a :class:`StopFlag` in this process has taken a stop signal."""
    return _stopping


def _note(signum: int) -> None:
    # os.write, not print: a handler may run in the middle of another write to sys.stderr
    with contextlib.suppress(OSError):
        os.write(2, f"{signal.Signals(signum).name} again: already stopping — exiting as soon as the stop is done "
                    "(a checkpoint due is saved, a partly written output removed)\n".encode())


class StopFlag:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each step (then saves and returns); later
    signals are ignored. Outside the main thread it installs nothing (signals only reach the main thread)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopFlag:
        if _stopping:  # a signal before the loop whose KeyboardInterrupt third-party code caught (a library's
            raise KeyboardInterrupt  # import that catches everything): stop now, not after every step is trained
        for sig in SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread: leave handlers alone
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        global _stopping
        if self.signal is not None:
            _note(signum)
            return
        self.signal = signum
        _stopping = True

    def agreed(self, out_of_time: bool, out_of_steps: bool, d: Dist) -> tuple[bool, bool, bool]:
        """(signalled, out of time, out of steps) as any rank of ``d`` found them: each rank times
        the run from its own start, and a signal may reach one rank only. Every rank must act on the same reasons:
        a rank alone out of time once ran the closing evaluation's collectives alone (a hang until
        ``dist_timeout``) and the others named another reason for the stop."""
        import torch  # here: this module is imported before torch is (process_signals)

        from hybridnorm.train.distributed import all_reduce_max

        flags = torch.tensor([float(self.signal is not None), float(out_of_time), float(out_of_steps)])
        signalled, timed_out, stepped = (v > 0 for v in all_reduce_max(flags, d).tolist())
        return signalled, timed_out, stepped

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _outside_loop(signum: int, frame: object) -> None:
    global _stopping
    if _stopping:
        _note(signum)
        return
    _stopping = True  # the stop is under way: a repeated signal must not interrupt its unwinding
    raise KeyboardInterrupt  # before the loop (data, model, resume): stop at once, exit 130 through the CLI


@contextlib.contextmanager
def process_signals() -> Iterator[None]:
    """For a command-line process (every command, not only train): SIGINT and SIGTERM outside a training
    loop raise KeyboardInterrupt, so a command unwinds (removing what it half wrote) instead of dying where it
    stands — until a stop is under way, after which they are ignored. The handlers are restored
    on leaving unless a stop happened: then the process is exiting with 130 and must stay unkillable by a
    repeated signal until it has."""
    global _stopping
    _stopping = False
    old: dict[int, object] = {}
    for sig in SIGNALS:
        with contextlib.suppress(ValueError):
            old[sig] = signal.signal(sig, _outside_loop)
    try:
        yield
    finally:
        for sig, handler in old.items():
            # stopping: ignored from here to the end. Not this module's handler: Python's shutdown puts the
            # default action back in place of a Python handler before the slow part of the exit (torch's
            # teardown), where a repeated SIGTERM then killed the process with 143 instead of its 130
            signal.signal(sig, signal.SIG_IGN if _stopping else handler)
