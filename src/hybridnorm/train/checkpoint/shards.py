"""Between live tensors — whole, or ``DTensor`` shards under FSDP — and the pieces a checkpoint stores.

Saving: each process writes the pieces it holds (:func:`local_pieces`): the local shard of every ``DTensor``
under the key ``<name>@<offset>`` (:mod:`hybridnorm.train.checkpoint.layout`), once per shard (of replicas
of a shard under HSDP only the first writes it), and rank 0 also every whole tensor.

Loading: :class:`TensorReader` reads any slice of any tensor of a checkpoint, from either layout, opening
only the pieces that overlap it (``safe_open`` slices, never a whole file); :func:`local_box` says which
slice a live tensor is, and :func:`like` wraps what was read as that tensor (a ``DTensor`` with the same
mesh and placements, or the plain tensor). So a checkpoint written by N processes loads into M, unsharded
into sharded and back, for the weights and the optimizer state alike.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from hybridnorm.train.checkpoint.layout import (
    CheckpointError,
    Piece,
    ShardedTensor,
    index_pieces,
    piece_key,
    tensor_header,
)

# safetensors' dtype names
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s weights are ``DTensor`` shards (FSDP): its checkpoints are then written by every rank."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def local_box(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) of the part of the global tensor ``t`` this process holds: all of a plain tensor."""
    if isinstance(t, DTensor):
        # the chunk DCP itself would save for this rank: offsets and sizes in the global tensor
        chunk = t.__create_chunk_list__()[0]
        return tuple(chunk.offsets), tuple(chunk.sizes)
    return (0,) * t.dim(), tuple(t.shape)


def _first_replica(t: DTensor) -> bool:
    """Whether this rank holds the first copy of its shard: coordinate 0 on every mesh dim ``t`` is replicated
    over (HSDP's replica groups hold the same shards; one copy is enough)."""
    coord = t.device_mesh.get_coordinate()
    return coord is not None and all(c == 0 for c, p in zip(coord, t.placements, strict=True) if not p.is_shard())


def local_pieces(tensors: dict[str, Tensor], rank: int) -> dict[str, Tensor]:
    """The pieces of ``tensors`` this ``rank`` writes, keyed ``<name>@<offset>``, on the CPU and contiguous."""
    out = {}
    for name, t in tensors.items():
        if isinstance(t, DTensor):
            if _first_replica(t):
                out[piece_key(name, local_box(t)[0])] = t.to_local().detach().contiguous().cpu()
        elif rank == 0:
            out[piece_key(name, (0,) * t.dim())] = t.detach().contiguous().cpu()
    return out


def like(data: Tensor, target: Tensor) -> Tensor:
    """``data`` (this process's slice of ``target``'s global tensor, as :func:`local_box` gives it) as a tensor
    that loads into ``target``: a ``DTensor`` on ``target``'s mesh with its placements, else ``data`` itself."""
    if isinstance(target, DTensor):
        return DTensor.from_local(data.to(target.device), target.device_mesh, target.placements, run_check=False,
                                  shape=target.shape, stride=target.stride())
    return data


def _whole(ckpt: Path, kind: str) -> dict[str, ShardedTensor]:
    """An unsharded file as one piece per tensor, so both layouts are read by the same code."""
    name = f"{kind}.safetensors"
    return {k: ShardedTensor(dtype, shape, [Piece(name, k, (0,) * len(shape), shape)])
            for k, (dtype, shape) in tensor_header(ckpt / name).items()}


class TensorReader:
    """The tensors of one kind (``model`` | ``optimizer``) of a checked checkpoint, any slice of each. Use as a
    context manager: the files it opened are closed on exit."""

    def __init__(self, ckpt: Path, kind: str, ranks: list[int], shapes: dict[str, list[int]] | None) -> None:
        """``ranks``: the writing ranks of a sharded checkpoint (``[]``: unsharded); ``shapes``: its recorded
        global shapes of this kind (``state.json``)."""
        self.ckpt = ckpt
        self.index = (index_pieces(ckpt, kind, ranks, shapes or {}, ckpt / "state.json") if ranks
                      else _whole(ckpt, kind))
        self._stack = contextlib.ExitStack()
        self._open: dict[str, object] = {}

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.index[name].shape

    def _file(self, name: str):  # a safetensors handle, opened once
        if name not in self._open:
            self._open[name] = self._stack.enter_context(safe_open(str(self.ckpt / name), framework="pt"))
        return self._open[name]

    def read(self, name: str, offset: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None,
             ) -> Tensor:
        """The slice of ``name`` starting at ``offset`` with ``shape`` (default: the whole tensor), assembled
        from the stored pieces that overlap it (the checks guarantee they cover it)."""
        t = self.index[name]
        offset = (0,) * len(t.shape) if offset is None else offset
        shape = t.shape if shape is None else shape
        if t.dtype not in _DTYPES:
            raise CheckpointError(f"checkpoint {self.ckpt}: {name} has the unsupported dtype {t.dtype}")
        out = torch.empty(shape, dtype=_DTYPES[t.dtype])
        for p in t.pieces:
            lo = [max(a, b) for a, b in zip(offset, p.offset, strict=True)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offset, shape, p.offset, p.shape, strict=True)]
            if any(low >= high for low, high in zip(lo, hi, strict=True)) or not math.prod(p.shape):
                continue  # no overlap (a 0-d piece has none of these dims and always overlaps)
            src = tuple(slice(low - b, high - b) for low, high, b in zip(lo, hi, p.offset, strict=True))
            dst = tuple(slice(low - a, high - a) for low, high, a in zip(lo, hi, offset, strict=True))
            try:
                out[dst] = self._file(p.file).get_slice(p.key)[src]
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"checkpoint file {self.ckpt / p.file} cannot be read: {e}"[:400]) from None
        return out
