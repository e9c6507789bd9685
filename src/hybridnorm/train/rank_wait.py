"""Work that some ranks do while the others wait, bounded by liveness rather than by ``dist_timeout``.

Preparing a corpus (training its tokenizer, tokenizing it) or checking a run's checkpoints happens on one
rank while every other one waits. A collective (``barrier``) bounds that wait by ``dist_timeout``, so a
corpus that took longer to prepare than the timeout (600 s by default: a few GB of text) failed every run
at its start with "waited 600 s for another rank, which is stuck", though rank 0 was only busy.

:func:`on_every_rank` waits through the process group's store instead: each rank runs its part, a
background thread counting a heartbeat in the store while it does; the others wait as long as the
heartbeat moves, and only a heartbeat still for ``dist_timeout`` (a frozen or hung process) ends the wait,
with an error naming the ranks that never finished. A rank whose process dies is torchrun's to tear down,
as everywhere else. A failure on one rank is raised on every rank (its own error there, a pointer to it
elsewhere), as :func:`~hybridnorm.train.distributed.agree` does for a collective.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from hybridnorm.errors import CollectiveError, ConfigError
from hybridnorm.train.distributed import Dist

T = TypeVar("T")

# a waiting rank reads the store (two small reads, whatever the world size) at once, then less and less
# often, up to every POLL_MAX_S: a wait of an hour costs a thousand ranks' store 1000 reads a second
POLL_MAX_S = 2.0
READ_WAIT_S = 30.0  # a failing wait's ranks wait this long at most for each other to read the failure
_calls = itertools.count()  # every rank makes the same calls in the same order: keys match across ranks


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _beating(store: dist.Store, key: str, every_s: float) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            try:
                store.add(key, 1)
            except Exception:  # the store is gone (the job is ending): the main thread hears of it itself
                return

    thread = threading.Thread(target=beat, name="hybridnorm-heartbeat", daemon=True)
    thread.start()
    return stop, thread


def on_every_rank(d: Dist, what: str, work: Callable[[], T], timeout_s: float) -> T:
    """Run ``work()`` on this rank (it may do nothing on some), then wait until every rank has run its own;
    returns this rank's result. ``what`` names the work in errors ("preparing the data")."""
    if not d.enabled:
        return work()
    store, key = _store(), f"hybridnorm/ranks/{next(_calls)}"
    stop, thread = _beating(store, f"{key}/beats", min(2.0, timeout_s / 4))
    failed: Exception | None = None
    try:
        result = work()
    except Exception as e:  # every rank must learn of it; this one raises it below
        failed, result = e, None
    finally:
        stop.set()
        thread.join()
    if failed is not None:
        store.set(f"{key}/error/{d.rank}", " ".join(str(failed).split())[:500] or type(failed).__name__)
        store.add(f"{key}/failed", 1)
    store.set(f"{key}/finished/{d.rank}", "1")
    store.add(f"{key}/done", 1)
    _wait_for_all(store, key, d, what, timeout_s)
    if store.add(f"{key}/failed", 0) > 0:
        if failed is None:
            first = next(r for r in range(d.world_size) if store.check([f"{key}/error/{r}"]))
            message = store.get(f"{key}/error/{first}").decode("utf-8", "replace")
            failed = ConfigError(f"rank {d.rank} of {d.world_size}: {what} failed on rank {first}: {message}")
        _until_every_rank_has_read(store, key, d)
        raise failed
    return result  # type: ignore[return-value]


def _until_every_rank_has_read(store: dist.Store, key: str, d: Dist) -> None:
    """Before leaving with a failure: wait (at most :data:`READ_WAIT_S`) until every rank holds it. A rank
    that leaves first ends its process, so torchrun stops the other ranks, and the machine hosting torchrun's
    store takes the store down with it: a rank still asleep in its wait was killed before it printed its error
    (found: on two machines the second one's output held no error at all, only torchrun's lost store)."""
    try:
        store.add(f"{key}/read", 1)
        deadline = time.monotonic() + READ_WAIT_S
        while store.add(f"{key}/read", 0) < d.world_size and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # the store is gone already: this rank says what it knows at once
        return


def _wait_for_all(store: dist.Store, key: str, d: Dist, what: str, timeout_s: float) -> None:
    beats, moved, pause = -1, time.monotonic(), 0.05
    while store.add(f"{key}/done", 0) < d.world_size:
        now_beats = store.add(f"{key}/beats", 0)
        if now_beats != beats:
            beats, moved = now_beats, time.monotonic()
        elif time.monotonic() - moved > timeout_s:
            missing = [r for r in range(d.world_size) if not store.check([f"{key}/finished/{r}"])]
            if store.add(f"{key}/done", 0) >= d.world_size:  # finished just now
                return
            named = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
            raise CollectiveError(f"rank {d.rank} of {d.world_size}: waited {timeout_s:g} s (dist_timeout) for "
                                  f"rank {named} {what}, which showed no sign of life in that time (frozen or "
                                  f"hung)")
        time.sleep(pause)
        pause = min(POLL_MAX_S, pause * 1.5)


def from_rank_0(d: Dist, text: str | None) -> str:
    """Rank 0's ``text`` on every rank (others pass None), through the store: no pickling. Call it where
    every rank is close behind rank 0 (after :func:`on_every_rank`): the read waits up to ``dist_timeout``."""
    if not d.enabled:
        return text or ""
    store, key = _store(), f"hybridnorm/ranks/{next(_calls)}/text"
    if d.is_main:
        store.set(key, text or "")
    return store.get(key).decode("utf-8")


def checked_against_rank_0(d: Dist, what: str, text: str | None, check: Callable[[str], None],
                           timeout_s: float) -> str:
    """Rank 0's ``text`` (others pass None), which every other rank then checks with ``check(text)`` (raising
    on a mismatch); a failed check is an error on every rank (:func:`on_every_rank`). Returns rank 0's text."""
    rank_0 = from_rank_0(d, text)
    on_every_rank(d, what, lambda: None if d.is_main else check(rank_0), timeout_s)
    return rank_0
