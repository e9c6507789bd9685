"""torch.distributed set-up from the environment ``torchrun`` provides (gloo on CPU; on GPU nccl for CUDA
tensors and gloo for CPU ones) and the few collectives the loop and the checkpoints use."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridnorm.errors import CollectiveError, ConfigError


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    joined: bool = False  # in a process group (torchrun), even one of a single rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or self.joined


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` (this rank's GPU) | ``cuda:N`` | ``mps`` -> a device that exists here, or a
    ConfigError naming it: found now, not as a traceback when the first tensor moves."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"device={name!r} is not a device: {e}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ConfigError(f"device={name!r}: CUDA is not available ({why}); use --device=cpu or auto")
        index = local_rank if device.index is None else device.index
        count = torch.cuda.device_count()
        if index >= count:
            raise ConfigError(f"device={name!r}: there is no cuda:{index}; this machine has {count} CUDA "
                              f"device(s), cuda:0..cuda:{count - 1}")
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device={name!r}: MPS (Apple GPU) is not available here; use --device=cpu or auto")
    return device


# what gloo / nccl / the store say when a peer is late or gone (gloo raises plain RuntimeErrors)
_COLLECTIVE_MARKS = ("gloo", "nccl", "NCCL", "Timed out", "timed out", "Connection reset", "Connection closed",
                     "Broken pipe", "ProcessGroup")


def collective_error(e: BaseException, d: Dist, timeout_s: float) -> CollectiveError | None:
    """``e`` as a :class:`CollectiveError` naming this rank and the cause, if it came from the process
    group; None for any other error (which keeps its own message)."""
    if not d.enabled or not isinstance(e, RuntimeError):
        return None
    text = " ".join(str(e).split())
    if not (isinstance(e, dist.DistError) or any(m in text for m in _COLLECTIVE_MARKS)):
        return None
    cause = (f"waited {timeout_s:g} s (dist_timeout) for another rank, which is stuck or stopped"
             if "imed out" in text or "imeout" in text else "another rank's process went away (killed or failed)")
    return CollectiveError(f"rank {d.rank} of {d.world_size}: a collective failed: {cause} [{text[:300]}]")


def launched_world() -> int:
    """How many processes torchrun started (its ``WORLD_SIZE``, with ``RANK`` beside it); 1 outside torchrun: a
    ``WORLD_SIZE`` a job script exported alone launches nothing, and one that is not an integer is not
    torchrun's."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1
    return world if "RANK" in os.environ else 1


_timeout_s = 600.0  # the joined group's dist_timeout, for leave()'s message


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> Dist:
    """Join the process group when launched by torchrun (with any number of processes, one included); a no-op
    otherwise. Every collective (and the joining itself) fails after ``timeout_s`` seconds of waiting for
    another rank. A CUDA ``device`` becomes this process's current device first, also outside torchrun."""
    if device.type == "cuda":
        # what runs on "the current device" (pinned host memory for the batches, nccl's barrier, a bare
        # synchronize) must run on this rank's GPU: left at cuda:0, every rank also opened a context on GPU 0
        torch.cuda.set_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # torchrun with one process still joins a group of one: --parallel=fsdp then shards over it (bf16
    # mixed-precision policy, sharded checkpoints) exactly as on N ranks, instead of silently not
    if world <= 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        return Dist()
    if not dist.is_initialized():
        # On GPU, nccl carries the CUDA tensors (gradients, FSDP's all-gathers) and gloo the small CPU ones the
        # loop reduces (stop flags, eval sums, checkpoint save status): nccl alone refuses CPU tensors.
        global _timeout_s
        _timeout_s = timeout_s
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", timeout=timeout,
                                **_attempt_store(timeout))
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), joined=True)


def _attempt_store(timeout: timedelta) -> dict[str, object]:
    """``init_process_group``'s store arguments under torchrun: its agent's store, with keys prefixed by the
    attempt (``TORCHELASTIC_RESTART_COUNT``, counted by ``--max-restarts``); none, so ``env://``, elsewhere.
    The agent keeps one store for every attempt and the process group keys its peers' addresses by name
    only, so a restarted group read the dead group's addresses and failed to connect ("Gloo connectFullMesh
    failed ... Connection refused", on every rendezvous backend, torch 2.13; pytorch/pytorch#167288 for
    nccl). Keying each attempt apart lets the new group meet."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"hybridnorm/attempt_{attempt}", agent),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def current_dist() -> Dist:
    """This process's place in the process group already joined (a single process when there is none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Dist()
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), joined=True)


def all_reduce_mean(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= d.world_size
    return t


def all_reduce_max(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def agree(failed: BaseException | None, d: Dist, what: str) -> None:
    """Every rank learns whether ``what`` failed on any rank, and then all raise: the ranks where it failed
    their own error, the others a :class:`ConfigError` pointing to it. So a failure on one rank (rank 0's lock
    or save) is the same collective on every rank, never one rank gone while the others wait for it."""
    if all_reduce_max(torch.tensor(float(failed is not None)), d).item() > 0:
        if failed is not None:
            raise failed
        raise ConfigError(f"rank {d.rank} of {d.world_size}: {what} failed on another rank (its error says why)")


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def leave() -> None:
    """Leave the process group once every rank has got here (a no-op outside one), so that no rank exits
    while another still holds it: a rank that did could abort in gloo's teardown ("terminate called without
    an active exception", exit -6; seen on a grid re-run with nothing left to train)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError as e:  # a rank gone after the last collective: one error line, as in the loop
            lost = collective_error(e, current_dist(), _timeout_s)
            if lost is None:
                raise
            raise lost from None
        dist.destroy_process_group()
