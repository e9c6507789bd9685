"""Deterministic, resumable batches of token windows, identical whether the global batch runs in one
process or is split over DDP ranks.

An epoch is a seeded permutation of the ``(N-1)//T`` non-overlapping windows of ``T+1`` tokens, shifted
by a seeded offset (so window boundaries move between epochs). Optimizer step ``s`` takes the ``s``-th run
of ``global_batch = batch_size*world_size*grad_accum`` windows from that permutation; its micro-batch ``m``
is the ``m``-th block of ``batch_size*world_size`` of them, and rank ``r`` gets that block's ``r``-th
``batch_size``. So the windows of a step — and the epochs — depend on the global batch only, not on how it
is split into processes and accumulation: a run resumes under any split of the same global batch.
Everything is a pure function of ``(seed, epoch, step)``: no hidden RNG state, so ``state_dict()`` is two
integers and a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from hybridnorm.errors import ConfigError


def _check(tokens: np.ndarray, batch_size: int, seq_len: int, what: str = "the data") -> None:
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer")
    if len(tokens) < seq_len + 1:
        raise ConfigError(f"{what} has {len(tokens)} tokens, fewer than one window of seq_len+1="
                          f"{seq_len + 1}; use more data or a shorter seq_len")


def _to_batch(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.from_numpy(np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class TokenBatches:
    """An endless iterator of ``(inputs, targets)``, int64 tensors of shape ``(batch_size, seq_len)``;
    ``targets`` is ``inputs`` shifted left by one token. ``batch_size`` is per rank and micro-batch; each
    optimizer step is ``grad_accum`` consecutive items."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, grad_accum: int = 1, what: str = "the data") -> None:
        # what: how errors name the tokens (the trainer's "the train split of data.source='x'")
        _check(tokens, batch_size, seq_len, what)
        if not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"seed={seed!r} must be a non-negative integer")
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int)
                and 0 <= rank < world_size):
            raise ConfigError(f"rank={rank!r}, world_size={world_size!r}: need 0 <= rank < world_size")
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
            raise ConfigError(f"grad_accum={grad_accum!r} must be a positive integer")
        self.rank, self.world_size, self.grad_accum = rank, world_size, grad_accum
        self.global_batch, self.n_tokens = batch_size * world_size * grad_accum, len(tokens)
        self.n_windows = (len(tokens) - 1) // seq_len
        self.slack = (len(tokens) - 1) - self.n_windows * seq_len  # room for the per-epoch offset
        self.steps_per_epoch = self.n_windows // self.global_batch
        if self.steps_per_epoch == 0:
            raise ConfigError(f"{what} has {len(tokens)} tokens = {self.n_windows} windows of "
                              f"seq_len={seq_len}, fewer than one global batch of {batch_size}x{world_size}"
                              + (f"x{grad_accum}" if grad_accum > 1 else "")
                              + "; use more data, a shorter seq_len or a smaller batch")
        self.epoch, self.step, self.micro = 0, 0, 0
        self._plan: tuple[int, np.ndarray, int] | None = None  # (epoch, permutation, offset)

    def _epoch_plan(self, epoch: int) -> tuple[np.ndarray, int]:
        if self._plan is None or self._plan[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._plan = (epoch, rng.permutation(self.n_windows), int(rng.integers(0, self.slack + 1)))
        return self._plan[1], self._plan[2]

    def batch_at(self, epoch: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batch ``micro`` of ``(epoch, step)``, without moving the iterator."""
        if not 0 <= step < self.steps_per_epoch:
            raise ConfigError(f"step={step} is outside the epoch's {self.steps_per_epoch} steps")
        perm, offset = self._epoch_plan(epoch)
        lo = step * self.global_batch + (micro * self.world_size + self.rank) * self.batch_size
        return _to_batch(self.tokens, offset + perm[lo:lo + self.batch_size] * self.seq_len, self.seq_len)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.epoch, self.step, self.micro)
        self.micro += 1
        if self.micro < self.grad_accum:
            return batch
        self.step, self.micro = self.step + 1, 0
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        return batch

    @property
    def tokens_per_step(self) -> int:
        """Tokens predicted per optimizer step over all ranks."""
        return self.global_batch * self.seq_len

    def state_dict(self) -> dict[str, int]:
        """The position at an optimizer-step boundary (where checkpoints are taken)."""
        if self.micro:
            raise RuntimeError(f"data state asked {self.micro} micro-batches into a step of {self.grad_accum}")
        # per_step=1 marks global_batch and step as counted per optimizer step; a state without it is from
        # before grad_accum was part of the order (counted per micro-batch; hybridnorm.train.batch_split)
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "n_tokens": self.n_tokens, "per_step": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume where ``state`` left off; the split (world size x batch size x accumulation) may change
        if the global batch does not."""
        for key in ("seed", "seq_len", "global_batch", "n_tokens"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(f"cannot resume the data order: the checkpoint has {key}={state[key]}, "
                                  f"this run {getattr(self, key)}")
        epoch, step = int(state["epoch"]), int(state["step"])
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise ConfigError(f"cannot resume the data order at epoch={epoch}, step={step}")
        self.epoch, self.step, self.micro = epoch, step, 0


def val_batch_count(tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None) -> int:
    """How many (global) batches :func:`val_batches` yields over all ranks."""
    _check(tokens, batch_size, seq_len)
    n_batches = -(-((len(tokens) - 1) // seq_len) // batch_size)
    return n_batches if max_batches is None else min(n_batches, max_batches)


def val_batches(tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None,
                rank: int = 0, world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Sequential non-overlapping windows from the start of ``tokens``: the same batches every call. The
    last batch may be smaller (average the loss over tokens). With DDP, rank ``r`` takes global batches
    ``r, r+W, ...``; ``max_batches`` counts global batches."""
    n_windows = (len(tokens) - 1) // seq_len
    for b in range(rank, val_batch_count(tokens, batch_size, seq_len, max_batches), world_size):
        starts = np.arange(b * batch_size, min((b + 1) * batch_size, n_windows)) * seq_len
        yield _to_batch(tokens, starts, seq_len)
