"""The two layouts of a checkpoint folder, and how the pieces of a sharded one must fit together.

**Unsharded** (one process or DDP: rank 0 holds every tensor whole)::

    model.safetensors  optimizer.safetensors  rng.safetensors  state.json  manifest.json

**Sharded** (FSDP: each rank holds a slice of every weight and of its optimizer state, and writes it)::

    model-r00000.safetensors  optimizer-r00000.safetensors     rank 0's pieces (and every unsharded tensor)
    model-r00001.safetensors  optimizer-r00001.safetensors     rank 1's pieces, ...
    rng.safetensors  state.json  manifest.json                  as above; state.json adds "shards"

Either layout also holds copies of the run's ``config.yaml`` and ``tokenizer.json`` (and the
``tokenizer_config.json`` naming a declared end-of-text token, where the tokenizer has one) as they were when it was
written (:data:`RUN_FILES`, hashed in the manifest like the rest): a checkpoint folder copied out of its run
still opens, and a run's ``config.yaml`` rewritten later (a resume with new settings, a hand edit) does not
change what an older checkpoint is read as. Checkpoints written before these copies existed have none; they
are read with the run folder's files (:func:`~hybridnorm.train.checkpoint.format.checked_run_file`).

A piece is stored under the key ``<tensor name>@<offset>``: ``blocks.0.attn.w_o.weight@128,0`` holds the
rows from 128 of that weight, its shape is the stored tensor's (``state.3.step@`` is a whole 0-d tensor).
So each file says by itself what it holds, and the global shapes are recorded in ``state.json``
(``shards.model`` for weights, ``optimizer.tensors`` for optimizer state). :func:`index_pieces` checks that the
pieces of every tensor lie inside it, share one dtype and cover it exactly once (total volume = the tensor's,
no two overlap) — a lost or duplicated piece is a corrupt checkpoint, never a silently zeroed weight.
Any slice of any tensor can then be read back from either layout, so a checkpoint written by N processes
loads into M (:mod:`hybridnorm.train.checkpoint.shards`).

Every file is safetensors or JSON: nothing here (or anywhere in loading) unpickles.

``state.json`` records the **format version** of the whole folder (``"format"``, :data:`FORMAT_VERSION`), and
:func:`check_format_version` reads it before anything else of a checkpoint is checked: a later hybridnorm may
lay a checkpoint out otherwise, and its checkpoint must then be refused as *newer* (one error, upgrade
hybridnorm, nothing moved) and never taken for a corrupt one of ours, which resume would set aside.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from hybridnorm import plain_data
from hybridnorm.errors import ConfigError

FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")
COMMON = ("rng.safetensors", "state.json")  # in both layouts
MANIFEST = "manifest.json"
# the run's files, copied in; optional (older checkpoints lack them; tokenizer_config.json only a tokenizer
# whose end-of-text token its folder declared writes: hybridnorm.data.tokenizer.EOS_FILE; chat_templates.json
# only a run imported from a folder with chat templates has: hybridnorm.data.chat_templates;
# generation_defaults.json, one imported from a folder whose generation_config.json chooses how to decode:
# hybridnorm.nn.sampling_defaults)
RUN_FILES = ("config.yaml", "tokenizer.json", "tokenizer_config.json", "chat_templates.json",
             "generation_defaults.json")
KINDS = ("model", "optimizer")
SHARD_FILE = re.compile(r"^(model|optimizer)-r([0-9]{5})\.safetensors$")
_OFFSET = re.compile(r"^(?:[0-9]+(?:,[0-9]+)*)?$")
# The version of this layout that the code writes and the newest it reads. 1: every checkpoint written before
# the version was recorded (no "format" in state.json: it is read as 1, and reads exactly as it always did);
# 2: the same files, with "format" recorded. Raise it with any change an older reader would misread.
FORMAT_VERSION = 2


class CheckpointError(ConfigError):
    """A checkpoint is missing, truncated, corrupt or malformed; the message names the file."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.splitlines()))  # the CLI prints it as ONE error: line


def is_int(v: object) -> bool:
    """A JSON integer: ``true`` is not a count."""
    return isinstance(v, int) and not isinstance(v, bool)


def malformed(path: Path, what: str) -> CheckpointError:
    """The error for a ``state.json`` whose content breaks its schema (a corrupt checkpoint: set aside)."""
    return CheckpointError(f"checkpoint file {path} is malformed: {what}"[:500])


class NewerFormatError(CheckpointError):
    """A checkpoint written in a newer format than this code reads. Not corrupt: it is never set aside (retention
    re-raises it), only refused."""


def check_format_version(ckpt: Path) -> None:
    """Raise :class:`NewerFormatError` if ``ckpt``'s ``state.json`` records a format newer than
    :data:`FORMAT_VERSION`. Only that: a missing or unreadable file, or a version of the wrong type, is left to
    the schema checks, which name it (``format.read_state``). Read before the manifest and the hashes are
    checked, as a newer format may change those too."""
    path = ckpt / "state.json"
    try:
        body = plain_data.loads(path.read_bytes())
    except (OSError, ValueError):  # ValueError: bad JSON, bad UTF-8, absurd nesting
        return
    found = body.get("format") if isinstance(body, dict) else None
    if is_int(found) and found > FORMAT_VERSION:
        raise NewerFormatError(f"checkpoint {ckpt}: checkpoint format {short_int(found)} (in {path}) is newer than "
                               f"this hybridnorm reads ({FORMAT_VERSION}); upgrade hybridnorm to read it")


def short_int(n: int) -> str:
    """``n`` for a message: whole, or its first digits and length when too long to be worth printing."""
    text = str(n)
    return text if len(text) <= 20 else f"{text[:20]}... ({len(text)} digits)"


def shard_file(kind: str, rank: int) -> str:
    """``model-r00001.safetensors``: the pieces of ``kind`` (model | optimizer) that ``rank`` wrote."""
    return f"{kind}-r{rank:05d}.safetensors"


def piece_key(name: str, offset: tuple[int, ...]) -> str:
    return f"{name}@{','.join(map(str, offset))}"


def split_piece_key(key: str) -> tuple[str, tuple[int, ...]] | None:
    """``("w", (128, 0))`` for ``"w@128,0"``; None if ``key`` is not a piece key."""
    name, sep, offset = key.rpartition("@")
    if not sep or not name or not _OFFSET.match(offset):
        return None
    return name, tuple(int(o) for o in offset.split(",")) if offset else ()


def layout_files(manifest: dict[str, Any], where: Path) -> tuple[str, ...]:
    """The files a checkpoint with this manifest must hold: :data:`FILES`, or (sharded) the two
    :data:`COMMON` files and a model and an optimizer file for each writing rank, rank 0 among them."""
    if "model.safetensors" in manifest or not any(SHARD_FILE.match(n) for n in manifest):
        return FILES  # the unsharded layout; read_manifest names whichever of its entries is missing
    ranks = shard_ranks(manifest)
    if not ranks or ranks[0] != 0:
        raise CheckpointError(f"checkpoint file {where} is malformed: a sharded checkpoint needs the files of rank 0")
    return (*(shard_file(k, r) for r in ranks for k in KINDS), *COMMON)


def shard_ranks(names: Any) -> list[int]:
    """The ranks whose model AND optimizer files are among ``names`` (a rank with only one of them has none)."""
    found: dict[int, set[str]] = {}
    for n in names:
        if m := SHARD_FILE.match(n):
            found.setdefault(int(m.group(2)), set()).add(m.group(1))
    return sorted(r for r, kinds in found.items() if kinds == set(KINDS))


def tensor_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name → (dtype, shape) of a safetensors file, read from its header alone (no tensor data)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for key in f.keys():
                sl = f.get_slice(key)
                out[key] = (sl.get_dtype(), tuple(sl.get_shape()))
            return out
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read as safetensors: {e}"[:400]) from None


@dataclass(frozen=True)
class Piece:
    """One stored slice: ``file`` (a name in the checkpoint) holds it under ``key``; it starts at ``offset``
    of its tensor and has ``shape``."""

    file: str
    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass
class ShardedTensor:
    """A tensor of a sharded checkpoint: its dtype (safetensors' name), global shape and pieces."""

    dtype: str
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)


def _overlap(a: Piece, b: Piece) -> bool:
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a.offset, a.shape, b.offset, b.shape,
                                                                       strict=True))


def index_pieces(ckpt: Path, kind: str, ranks: list[int], shapes: dict[str, list[int]], recorded_in: Path,
                 ) -> dict[str, ShardedTensor]:
    """The tensors of ``kind`` in the sharded checkpoint ``ckpt``, from the headers of the files of ``ranks``;
    ``shapes`` (recorded in ``recorded_in``) gives each tensor's global shape. Raises :class:`CheckpointError`
    naming the file at fault unless every piece fits its tensor and the pieces tile every tensor exactly."""
    tensors: dict[str, ShardedTensor] = {}
    for rank in ranks:
        name_of_file = shard_file(kind, rank)
        path = ckpt / name_of_file
        for key, (dtype, shape) in tensor_header(path).items():
            parsed = split_piece_key(key)
            if parsed is None or parsed[0] not in shapes:
                raise CheckpointError(f"checkpoint file {path} is malformed: {key!r} is not '<name>@<offset>' of "
                                      f"a tensor {recorded_in} records")
            name, offset = parsed
            full = tuple(shapes[name])
            if not (len(offset) == len(shape) == len(full)
                    and all(o + s <= n for o, s, n in zip(offset, shape, full, strict=True))):
                raise CheckpointError(f"checkpoint file {path} is malformed: piece {key!r} of shape {list(shape)} "
                                      f"does not lie inside {name} of shape {list(full)} ({recorded_in})")
            t = tensors.setdefault(name, ShardedTensor(dtype, full))
            if dtype != t.dtype:
                raise CheckpointError(f"checkpoint file {path} is malformed: piece {key!r} is {dtype}, other "
                                      f"pieces of {name} are {t.dtype}")
            t.pieces.append(Piece(name_of_file, key, offset, shape))
    for name, full in shapes.items():
        t = tensors.get(name)
        files = f"{ckpt}/{kind}-r*.safetensors"
        if t is None:
            raise CheckpointError(f"checkpoint files {files} hold no piece of {name}, which {recorded_in} records")
        solid = [p for p in t.pieces if math.prod(p.shape)]
        if sum(math.prod(p.shape) for p in solid) != math.prod(full) or any(
                _overlap(a, b) for i, a in enumerate(solid) for b in solid[i + 1:]):
            raise CheckpointError(f"checkpoint files {files} do not cover {name} of shape {list(full)} exactly "
                                  f"once (a piece is missing or stored twice)")
    return tensors
