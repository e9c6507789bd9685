"""The global batch is a run's invariant; its split into processes × batch size × accumulation is not.

A run's data order (``hybridnorm.data.loader``), its LR schedule and its tokens per step depend on the
global batch only: sequences per optimizer step over every process. How those sequences are split —
``world_size`` processes × ``batch_size`` per micro-batch × ``grad_accum`` micro-batches — decides only
memory and speed. So a run started on 2 processes resumes on 1 (or 1 on 2, 8 on 4) by keeping the global
batch and changing the split, and a run can be started from ``--global_batch`` alone, as OLMo-core and
torchtitan configs do. :func:`split_global_batch` picks the split; only a global batch that the processes
cannot share evenly is refused, with the process counts that would work.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridnorm.errors import ConfigError


@dataclass(frozen=True)
class BatchSplit:
    global_batch: int  # sequences per optimizer step, all processes together
    batch_size: int    # sequences per process per micro-batch
    grad_accum: int    # micro-batches per optimizer step
    changed: bool      # the split differs from the batch_size x grad_accum that was asked

    def describe(self, world_size: int) -> str:
        return (f"global batch {self.global_batch} sequences per step = {world_size} process(es) x batch_size="
                f"{self.batch_size} x grad_accum={self.grad_accum}")


def _divisors(n: int, limit: int = 12) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0][:limit]


def split_global_batch(global_batch: int, world_size: int, batch_size: int, grad_accum: int,
                       why: str) -> BatchSplit:
    """The split of ``global_batch`` over ``world_size`` processes closest to the ``batch_size`` ×
    ``grad_accum`` asked: kept if it multiplies to the global batch; else the asked batch size with the
    accumulation that reaches it; else the largest batch size below the one asked that divides the
    per-process share (never a larger micro-batch than asked: that is what memory was planned for).
    ``why`` says where the global batch comes from, for the error when no split exists."""
    if global_batch % world_size:
        counts = _divisors(global_batch, limit=global_batch)
        works = ", ".join(map(str, counts[:12])) + (", ..." if len(counts) > 12 else "")
        raise ConfigError(f"{why}: global batch {global_batch} sequences cannot be split evenly over "
                          f"{world_size} processes; it can over {works} "
                          f"processes (torchrun --nproc_per_node), or start a new run with a --global_batch "
                          f"that is a multiple of {world_size}")
    share = global_batch // world_size
    if batch_size * grad_accum == share:
        return BatchSplit(global_batch, batch_size, grad_accum, changed=False)
    size = max(b for b in _divisors(share, limit=share) if b <= batch_size)
    return BatchSplit(global_batch, size, share // size, changed=True)


def resolve_split(asked_global: int, checkpoint_global: int | None, world_size: int, batch_size: int,
                  grad_accum: int) -> BatchSplit:
    """The split of this run: the checkpoint's global batch on resume (``asked_global`` must agree if
    given), else ``asked_global`` (``--global_batch``), else ``world_size × batch_size × grad_accum``."""
    if checkpoint_global is not None:
        if asked_global and asked_global != checkpoint_global:
            raise ConfigError(f"global_batch={asked_global}, but the run being resumed has global batch "
                              f"{checkpoint_global} (its data order and LR schedule depend on it): leave "
                              f"global_batch out or set it to {checkpoint_global}")
        return split_global_batch(checkpoint_global, world_size, batch_size, grad_accum,
                                  "the checkpoint being resumed")
    if asked_global:
        return split_global_batch(asked_global, world_size, batch_size, grad_accum, f"global_batch={asked_global}")
    return BatchSplit(world_size * batch_size * grad_accum, batch_size, grad_accum, changed=False)


def per_step_state(data: dict[str, int], grad_accum: int) -> dict[str, int]:
    """A checkpoint's data position counted per optimizer step. States written before the global batch
    became the invariant (no ``per_step`` key) counted micro-batches: their ``global_batch`` was one
    micro-batch over all processes and ``step`` a micro-batch count; with the run's ``grad_accum`` (as
    asked again) that is ``grad_accum`` times fewer, larger steps. Exact within the first epoch (later
    epochs ended at other places before)."""
    if not data or data.get("per_step") or grad_accum == 1:  # with no accumulation both counts agree
        return data
    if data["step"] % grad_accum:
        raise ConfigError(f"the checkpoint's data position (micro-batch {data['step']}) is not at a step of "
                          f"grad_accum={grad_accum}: resume with the grad_accum the run was trained with")
    return {**data, "global_batch": data["global_batch"] * grad_accum, "step": data["step"] // grad_accum,
            "per_step": 1}
