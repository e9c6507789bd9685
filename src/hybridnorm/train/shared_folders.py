"""What every rank of a torchrun job must see alike before it trains: the run folder, the checkpoint a
resume starts from, the prepared data.

Rank 0 claims the run folder and decides what to resume from; every rank then writes into that folder
(FSDP's checkpoint shards) and reads from it (every rank loads the checkpoint on ``--resume``). On several
machines that holds only when ``--out`` is one folder on storage they share. Where it was not (a
machine-local disk, or a relative ``--out`` from another working directory), an FSDP job trained until its
first checkpoint and then failed writing it, and a resume let each rank pick its own checkpoint (rank 0
the newest, a rank on another disk none): the ranks' collectives no longer matched and gloo aborted the
job (SIGABRT), or they trained on from different states. Now every rank checks at the start that it sees
the lock file rank 0 holds, and takes rank 0's choice of checkpoint rather than making its own; a rank that
cannot see either ends the job at once with an error naming it and its host.

Data: rank 0 prepares the data (the cache is shared by the ranks of a machine, and often by all), then
the others map it, or prepare it themselves where they do not share rank 0's cache. Those waits are
:func:`~hybridnorm.train.rank_wait.on_every_rank`'s, bounded by liveness, not by ``dist_timeout``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from hybridnorm.data import PreparedData
from hybridnorm.errors import ConfigError
from hybridnorm.train.checkpoint import ResumePoint, checkpoint_for_resume, list_checkpoints
from hybridnorm.train.checkpoint.lock import LOCK_NAME, describe_holder
from hybridnorm.train.checkpoint.retention import problem_of
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.distributed import Dist
from hybridnorm.train.rank_wait import checked_against_rank_0, on_every_rank

# how long a rank waits for rank 0's files to appear to it: a network file system's client may serve a
# folder's cached listing for a few seconds after another machine changed it
SEE_WAIT_S = 10.0


def _seen(read: Callable[[], str | None], want: str | None) -> str | None:
    """``read()`` (what this rank sees) once it equals ``want``, else what it last was; retried for up to
    :data:`SEE_WAIT_S` seconds. ``read`` returns None for a missing file."""
    deadline = time.monotonic() + SEE_WAIT_S
    while True:
        got = read()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.25)


def _where(d: Dist) -> str:
    return f"rank {d.rank} of {d.world_size} (host {socket.gethostname()})"


SHARED = ("every rank writes into the run folder (checkpoint shards) and reads from it (--resume), so --out "
          "must be one folder on storage every machine of the job shares, under the same path")


def check_every_rank_sees_the_run_folder(run_dir: Path, d: Dist, timeout_s: float) -> None:
    """Every rank finds, in its ``run_dir``, the lock file rank 0 wrote when it claimed the folder: the same
    folder. Call it after rank 0 has claimed ``run_dir``."""
    if not d.enabled:
        return
    lock = run_dir / LOCK_NAME

    def read() -> str | None:
        try:
            return lock.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None

    def check(token: str) -> None:
        got = _seen(read, token)
        if got != token:
            what = "missing" if got is None else f"another ({describe_holder(got.encode('utf-8'))})"
            holder = describe_holder(token.encode("utf-8"))
            raise ConfigError(f"{_where(d)} does not see the run folder rank 0 holds ({holder}): its lock file "
                              f"{lock.absolute()} is {what} here; {SHARED}")

    checked_against_rank_0(d, f"checking that it sees the run folder {os.fspath(run_dir)}",
                           lock.read_text(encoding="utf-8") if d.is_main else None, check, timeout_s)


def resume_point(run_dir: Path, resume: bool, d: Dist, timeout_s: float) -> ResumePoint:
    """Rank 0 checks the run's checkpoints (setting corrupt ones aside) and decides; every rank resumes from
    that checkpoint, once it sees it whole, or the job stops with an error naming the rank."""
    root = run_dir / "checkpoints"

    def decide() -> ResumePoint | None:
        if not d.is_main:
            return None
        if not resume:
            if list_checkpoints(root):
                restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                why = (f" (torchrun restarted this group, restart {restart}: with --max-restarts, give the command "
                       f"--resume so that a restart continues from the newest checkpoint)" if restart != "0" else "")
                raise ConfigError(f"run folder {run_dir} already has checkpoints: pass --resume to continue it "
                                  f"or choose another --out{why}")
            return ResumePoint(None)
        return checkpoint_for_resume(root, set_aside_bad=True)

    found = on_every_rank(d, "checking the run's checkpoints", decide, timeout_s)
    if not d.enabled:
        return found  # type: ignore[return-value]

    def check(name: str) -> None:
        if not name:
            return
        problem = _seen(lambda: problem_of(root / name), None)
        if problem is not None:
            raise ConfigError(f"{_where(d)} cannot resume from {root / name}, the checkpoint rank 0 resumes "
                              f"from: {problem}; {SHARED}")

    name = checked_against_rank_0(d, "finding the checkpoint rank 0 resumes from",
                                  found.path.name if found is not None and found.path is not None else "", check,
                                  timeout_s)
    return found if d.is_main else ResumePoint(root / name if name else None)  # type: ignore[return-value]


def prepare_data_on_ranks(cfg: TrainConfig, d: Dist) -> PreparedData:
    """Rank 0 prepares the data into its cache while the others wait; then every other rank maps it (or
    prepares it, where its cache is not rank 0's), while rank 0 waits. Every rank must then hold rank 0's
    tokens: the same tokenizer and token counts (a rank that prepared its own from another copy of the
    corpus, or with another tokenizers release, would train on other token ids)."""
    first = on_every_rank(d, "preparing the data", lambda: cfg.data.prepare() if d.is_main else None,
                          cfg.dist_timeout)
    data = on_every_rank(d, "preparing the data", lambda: first if first is not None else cfg.data.prepare(),
                         cfg.dist_timeout)
    if not d.enabled:
        data.check_val_windows(cfg.seq_len)
        return data
    mine = (f"tokenizer {data.tokenizer.fingerprint[:12]}, {data.stats.train_tokens:,} train / "
            f"{data.stats.val_tokens:,} val tokens, data sha256 {data.data_sha256[:12]}")

    def check(rank_0: str) -> None:
        if mine != rank_0:
            raise ConfigError(f"{_where(d)} prepared other data than rank 0: {mine} in {data.dir}, where rank 0 "
                              f"has {rank_0} (another copy of data.source={cfg.data.source}, or another tokenizers "
                              f"release, on its machine); every rank must train on the same tokens: put the data "
                              f"cache ($HYBRIDNORM_CACHE) on storage every machine shares, or the same corpus and "
                              f"software on each")

    checked_against_rank_0(d, "comparing its data with rank 0's", mine, check, cfg.dist_timeout)
    data.check_val_windows(cfg.seq_len)  # after the comparison: every rank holds rank 0's tokens and stops alike
    return data
