"""Data-parallel lm-eval under ``torchrun``: lm-eval's model API for ranks over the process group that
``hybridnorm eval --tasks`` joins there (:func:`hybridnorm.train.distributed.init_distributed`).

lm-eval's evaluator does the splitting itself once the model says it is one of several ranks: rank r builds
the requests of documents r, r + W, r + 2W, ... of every task, the ranks with fewer requests repeat their last
one so that every rank runs as many (it gathers the counts with ``all_gather``), and each document's metric
values are gathered on rank 0 (``gather_object``), which alone gets the results; the others get None. This is
what lm-eval's HF backend does under ``accelerate launch``. lm-eval 0.4.13 (installed here) calls the methods below;
earlier 0.4 releases call ``lm.accelerator.gather`` / ``.wait_for_everyone()`` and ``torch.distributed``'s
``gather_object`` directly, which :class:`_Collectives` and the joined group serve.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from hybridnorm.train.distributed import current_dist, init_distributed, launched_world

# how long a rank waits for the others at a collective: ranks whose documents generate longer replies finish
# their share much later (lm-eval's HF backend waits up to a year); a rank that dies ends the wait at once
# (its connection closes)
RANK_WAIT_S = 24 * 3600.0


def launched_local_rank() -> int:
    """This process's GPU index on its machine under torchrun (``LOCAL_RANK``), else 0."""
    return int(os.environ.get("LOCAL_RANK", "0")) if launched_world() > 1 else 0


class _Collectives:
    """The two ``accelerate.Accelerator`` methods older lm-eval versions call on ``lm.accelerator``."""

    def __init__(self, lm: RankedLM) -> None:
        self.lm = lm

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.lm.all_gather(tensor)

    def wait_for_everyone(self) -> None:
        self.lm.barrier()


class RankedLM:
    """Mixin for an lm-eval ``LM``: its rank and world size are the joined process group's (0 of 1 without
    one), and the collectives lm-eval asks for run over that group."""

    _rank: int
    _world_size: int

    def join_ranks(self, device: torch.device) -> None:
        """Take this process's rank in the joined process group; under a torchrun of several processes with no
        group joined yet (lm-eval called from a script), join it first, on ``device``."""
        if launched_world() > 1 and not dist.is_initialized():
            init_distributed(device, RANK_WAIT_S)
        d = current_dist()
        self._rank, self._world_size = d.rank, d.world_size
        if d.world_size > 1:
            self.accelerator = _Collectives(self)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along the first dimension in rank order (a 0-d tensor counts as
        one element), as ``accelerate``'s ``gather``."""
        if self._world_size == 1:
            return tensor
        flat = tensor.reshape(-1, *tensor.shape[1:]) if tensor.dim() else tensor.reshape(1)
        parts = [torch.empty_like(flat) for _ in range(self._world_size)]
        dist.all_gather(parts, flat.contiguous())
        return torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank ``dst``, None on the others."""
        if self._world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            dist.barrier()
