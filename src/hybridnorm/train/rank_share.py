"""Items scored over torchrun's ranks: ``hybridnorm eval``'s own evaluations (``--mc``, ``--text``, the
validation loss), which the loading and eval layers above run.

Rank r of W scores items r, r + W, r + 2W, ... (multiple-choice questions, documents, validation batches), and
every rank gets every item's scores back, in the order one process holds them: what is summed or counted
afterwards (accuracy, perplexity, the loss) is then summed in one process's order over the same per-item values.
An item's value can differ from one process's in its last bits only where its batch holds other rows (a
matrix product of another shape); a validation batch is the same batch on any rank, so the loss is bitwise the
one-process loss wherever the kernels are deterministic.

Scores travel as float64 tensors (a Python float round-trips exactly) over the gloo group that ``eval``
joins under torchrun, never as pickles. A rank with no items (more ranks than items) still joins the two
gathers; a rank that fails leaves, and the others' gather fails with it (:func:`~hybridnorm.train.distributed.
collective_error`), as with lm-eval's own collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from hybridnorm.train.distributed import Dist

T = TypeVar("T")
Row = tuple[float, ...]


def share(n: int, d: Dist) -> range:
    """The indices of ``n`` items this rank scores: ``d.rank``, ``d.rank + W``, ..."""
    return range(d.rank, n, d.world_size)


def gather_rows(mine: Sequence[Sequence[float]], n: int, d: Dist) -> list[Row]:
    """Every item's row of scores, in item order, on every rank, from this rank's rows of :func:`share`'s
    items (rows may differ in length, and so may ranks' numbers of rows)."""
    rows = [tuple(float(v) for v in r) for r in mine]
    if len(rows) != len(share(n, d)):
        raise ValueError(f"rank {d.rank} of {d.world_size} has {len(rows)} rows for {len(share(n, d))} items")
    if d.world_size == 1:
        return rows
    most = -(-n // d.world_size)  # rows on the ranks with the most; the others pad with -1
    lengths = torch.full((max(most, 1),), -1, dtype=torch.int64)
    lengths[:len(rows)] = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    every_lengths = [torch.empty_like(lengths) for _ in range(d.world_size)]
    dist.all_gather(every_lengths, lengths)
    row_lengths = [[int(x) for x in ls if x >= 0] for ls in every_lengths]
    width = max(1, *(sum(ls) for ls in row_lengths))  # every rank computes the same width from the same lengths
    flat = torch.zeros(width, dtype=torch.float64)
    values = [v for r in rows for v in r]
    flat[:len(values)] = torch.tensor(values, dtype=torch.float64)
    every_flat = [torch.empty_like(flat) for _ in range(d.world_size)]
    dist.all_gather(every_flat, flat)
    by_rank = [_split(f.tolist(), ls) for f, ls in zip(every_flat, row_lengths, strict=True)]
    return [by_rank[i % d.world_size][i // d.world_size] for i in range(n)]


def _split(values: list[float], lengths: list[int]) -> list[Row]:
    out, at = [], 0
    for k in lengths:
        out.append(tuple(values[at:at + k]))
        at += k
    return out


def scored_on_ranks(score: Callable[[list[T]], Sequence[Sequence[float]]], items: Sequence[T], d: Dist,
                    ) -> list[Row]:
    """``score`` (items -> one row per item) of every item, each rank scoring only its :func:`share`."""
    return gather_rows(score([items[i] for i in share(len(items), d)]), len(items), d)
