"""What a checkpoint folder must hold, and the checks every file of it passes before anything is loaded.

A checkpoint is written once and trusted never: its files may be truncated by a full disk, flipped by bad
storage, or edited by hand (with a manifest rewritten to match). So nothing in a checkpoint reaches
``torch`` unchecked: :func:`verify_checkpoint` compares every file with ``manifest.json`` (size and sha256)
and :func:`check_checkpoint` also checks the *schema* of each file — JSON types and required keys of
``state.json``, the tensor names, dtypes and shapes of the safetensors files, and that the optimizer
tensors are the ones ``state.json`` says were written. Both layouts (:mod:`hybridnorm.train.checkpoint.layout`)
pass the same checks; a sharded one as the whole tensors its pieces tile. Any failure is a
:class:`CheckpointError` (a ``ConfigError``: one ``error:`` line on the command line) naming the exact file
at fault; no other exception type escapes and nothing on disk is changed.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import torch

from hybridnorm import plain_data
from hybridnorm.train.checkpoint.counters import check_data
from hybridnorm.train.checkpoint.layout import (
    FILES,
    FORMAT_VERSION,
    MANIFEST,
    RUN_FILES,
    CheckpointError,
    check_format_version,
    index_pieces,
    is_int,
    layout_files,
    malformed,
    shard_ranks,
    tensor_header,
)

__all__ = ["FILES", "MANIFEST", "CheckpointError", "check_checkpoint", "checked_run_file",
           "checked_tokenizer_file", "list_checkpoints",
           "read_state", "sha256_of", "verify_checkpoint"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_OPT_KEY = re.compile(r"^state\.([0-9]+)\.([A-Za-z_][A-Za-z0-9_]*)$")
_CUDA_KEY = re.compile(r"^cuda\.[0-9]+$")
# param-group fields of torch's Adam/AdamW: a wrong type here would not fail at load but at the next step
_GROUP_NUMBERS = ("lr", "eps", "weight_decay", "initial_lr")
_GROUP_FLAGS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay")


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """Completed-looking checkpoint folders ``step_<N>``, oldest first (temporary and set-aside ones are not)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_json(path: Path) -> Any:
    """The JSON value of ``path``; unreadable bytes, bad UTF-8, bad JSON or absurd nesting name the file."""
    try:
        return plain_data.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError and NestingError are ValueErrors
        raise CheckpointError(f"checkpoint file {path} is corrupt: {plain_data.describe_error(e)}"[:400]) from None
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {e.strerror or e}") from None


def recorded_files(manifest: dict[str, Any], where: Path) -> tuple[str, ...]:
    """The files a checkpoint with this manifest holds: those of its layout
    (:func:`~hybridnorm.train.checkpoint.layout.layout_files`), then the copies of the run's files it lists."""
    return (*layout_files(manifest, where), *(n for n in RUN_FILES if n in manifest))


def read_manifest(ckpt: Path) -> dict[str, dict[str, Any]]:
    """``manifest.json``: for each file the checkpoint holds (:func:`recorded_files`),
    ``{"bytes": int >= 0, "sha256": 64 hex digits}``."""
    check_format_version(ckpt)  # first: a newer format is refused as such, not misread as a corrupt one
    path = ckpt / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: {path} is missing")
    manifest = read_json(path)
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint file {path} is malformed: expected a JSON object, got "
                              f"{type(manifest).__name__}")
    for name in recorded_files(manifest, path):
        entry = manifest.get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint file {path} is malformed: no entry for {name}")
        if not (isinstance(entry, dict) and is_int(entry.get("bytes")) and entry["bytes"] >= 0
                and isinstance(entry.get("sha256"), str) and _SHA256.match(entry["sha256"])):
            raise CheckpointError(f"checkpoint file {path} is malformed: the entry for {name} must be "
                                  f'{{"bytes": <int >= 0>, "sha256": <64 hex digits>}}, got {entry!r}'[:400])
    return manifest


def verify_checkpoint(path: str | Path) -> tuple[str, ...]:
    """Raise :class:`CheckpointError` naming the first missing, truncated or corrupt file; else return the
    names of the files checked."""
    ckpt = Path(path)
    manifest = read_manifest(ckpt)
    files = recorded_files(manifest, ckpt / MANIFEST)
    for name in RUN_FILES:
        _check_recorded(ckpt, manifest, name)
    for name in files:
        _check_file(ckpt, name, manifest[name])
    return files


def checked_run_file(ckpt: Path, name: str) -> Path:
    """The ``name`` (one of :data:`RUN_FILES`) that checkpoint ``ckpt`` was written with: its own copy if its
    manifest records one — checked first (size and sha256: the few bytes read before the weights are
    verified are verified too; a recorded copy that is gone is an error, never a silent fall-back) — else,
    for a checkpoint written without copies, the run folder's (``<run>/checkpoints/step_N`` -> ``<run>/name``)."""
    manifest = read_manifest(ckpt)
    if name in manifest:
        _check_file(ckpt, name, manifest[name])
        return ckpt / name
    _check_recorded(ckpt, manifest, name)
    return ckpt.parent.parent / name


def checked_tokenizer_file(ckpt: Path) -> Path:
    """:func:`checked_run_file` for ``tokenizer.json``, with the ``tokenizer_config.json`` that the tokenizer
    reads beside it (one whose end-of-text token its folder declared) checked the same way first."""
    checked_run_file(ckpt, "tokenizer_config.json")
    return checked_run_file(ckpt, "tokenizer.json")


def checked_own_run_file(ckpt: Path, name: str) -> Path | None:
    """``ckpt``'s own copy of ``name`` (one of :data:`RUN_FILES`), checked as :func:`checked_run_file` checks
    it, or None where its manifest records none: for a file added to the run files later than the others (a
    run's chat templates), whose absence from a checkpoint means the run has none, so there is no run-folder
    file to fall back on."""
    manifest = read_manifest(ckpt)
    if name in manifest:
        _check_file(ckpt, name, manifest[name])
        return ckpt / name
    _check_recorded(ckpt, manifest, name)
    return None


def _check_recorded(ckpt: Path, manifest: dict[str, Any], name: str) -> None:
    """A copy of a run file the manifest does not vouch for would be read in place of the run's."""
    if name not in manifest and (ckpt / name).exists():
        raise CheckpointError(f"checkpoint file {ckpt / name} is not recorded in {ckpt / MANIFEST}: it was not "
                              "written with this checkpoint (move it out to read the checkpoint with its run "
                              "folder's file)")


def _check_file(ckpt: Path, name: str, want: dict[str, Any]) -> None:
    f = ckpt / name
    if not f.is_file():
        raise CheckpointError(f"checkpoint file {f} is missing")
    try:
        size, digest = f.stat().st_size, sha256_of(f)
    except OSError as e:  # unreadable (permissions, I/O error) is as unusable as corrupt
        raise CheckpointError(f"checkpoint file {f} cannot be read: {e.strerror or e}") from None
    if size != want["bytes"]:
        raise CheckpointError(f"checkpoint file {f} is truncated or corrupt ({size} bytes, "
                              f"{ckpt / MANIFEST} records {want['bytes']})")
    if digest != want["sha256"]:
        raise CheckpointError(f"checkpoint file {f} is corrupt (sha256 differs from {ckpt / MANIFEST})")


def _check_extra(path: Path, extra: object) -> None:
    if not isinstance(extra, dict):
        raise malformed(path, f"'extra' must be an object, got {type(extra).__name__}")
    spikes = extra.get("spike_detector", {})
    if not (isinstance(spikes, dict) and all(isinstance(v, list) and all(_is_number(x) for x in v)
                                             for v in spikes.values())):
        raise malformed(path, "'extra.spike_detector' must map metric names to lists of numbers")
    if not isinstance(extra.get("data_sha256", ""), str):  # the trainer's; a resume compares its data with it
        raise malformed(path, "'extra.data_sha256' must be a string (the sha256 of the data files)")


def _check_group(path: Path, i: int, group: object) -> list[int]:
    if not isinstance(group, dict):
        raise malformed(path, f"optimizer.param_groups[{i}] must be an object, got {type(group).__name__}")
    params = group.get("params")
    if not (isinstance(params, list) and params and all(is_int(p) and p >= 0 for p in params)):
        raise malformed(path, f"optimizer.param_groups[{i}].params must be a non-empty list of indices")
    for key, value in group.items():
        if key in _GROUP_NUMBERS and not _is_number(value):
            raise malformed(path, f"optimizer.param_groups[{i}].{key} must be a number, got {value!r}")
        if key in _GROUP_FLAGS and not (value is None or isinstance(value, bool)):
            raise malformed(path, f"optimizer.param_groups[{i}].{key} must be true, false or null, got {value!r}")
        if key == "betas" and not (isinstance(value, list) and len(value) == 2 and all(map(_is_number, value))):
            raise malformed(path, f"optimizer.param_groups[{i}].betas must be two numbers, got {value!r}")
        if key != "params" and isinstance(value, dict):
            raise malformed(path, f"optimizer.param_groups[{i}].{key} must not be an object")
    return params


def _check_optimizer_meta(path: Path, meta: object) -> None:
    if not isinstance(meta, dict):
        raise malformed(path, f"'optimizer' must be an object, got {type(meta).__name__}")
    groups = meta.get("param_groups")
    if not isinstance(groups, list) or not groups:
        raise malformed(path, "'optimizer.param_groups' must be a non-empty list")
    ids = [p for i, g in enumerate(groups) for p in _check_group(path, i, g)]
    if len(ids) != len(set(ids)):
        raise malformed(path, "a parameter index appears twice in optimizer.param_groups")
    scalars = meta.get("scalars")
    if not isinstance(scalars, dict):
        raise malformed(path, "'optimizer.scalars' must be an object")
    for key, value in scalars.items():
        idx, _, name = key.partition(".")
        key_ok = idx.isascii() and idx.isdigit() and int(idx) in ids and bool(name)
        if not key_ok or not (value is None or isinstance(value, (int, float))):
            raise malformed(path, f"optimizer.scalars holds {key!r}: {value!r}; expected '<param index>.<name>': "
                                   "a number")
    names = meta.get("param_names")  # absent in checkpoints written before it was recorded
    if names is not None and not (isinstance(names, dict) and all(
            k.isascii() and k.isdigit() and int(k) in ids and isinstance(v, str) for k, v in names.items())):
        raise malformed(path, "'optimizer.param_names' must map parameter indices to weight names")
    tensors = meta.get("tensors")  # absent in checkpoints written before it was recorded
    if tensors is not None and not (isinstance(tensors, dict) and all(
            isinstance(s, list) and all(is_int(n) and n >= 0 for n in s) for s in tensors.values())):
        raise malformed(path, "'optimizer.tensors' must map tensor names to shapes (lists of integers)")


def read_state(ckpt: Path) -> dict[str, Any]:
    """``state.json`` with every field of the right type (see :func:`save_checkpoint` for what it holds)."""
    path = ckpt / "state.json"
    body = read_json(path)
    if not isinstance(body, dict):
        raise malformed(path, f"expected a JSON object, got {type(body).__name__}")
    for key, check in (("step", is_int), ("tokens", is_int), ("data", None), ("extra", None), ("optimizer", None)):
        if key not in body:
            raise malformed(path, f"the key {key!r} is missing")
        if check is not None and not (check(body[key]) and body[key] >= 0):
            raise malformed(path, f"{key!r} must be an integer >= 0, got {body[key]!r}")
    version = body.get("format", 1)  # absent: written before the version was recorded, format 1
    if not (is_int(version) and 1 <= version <= FORMAT_VERSION):  # newer: check_format_version refused it
        raise malformed(path, f"'format' must be a format version from 1 to {FORMAT_VERSION}, got {version!r}")
    if (m := _STEP_DIR.match(ckpt.name)) and int(m.group(1)) != body["step"]:
        raise malformed(path, f"'step' is {body['step']} in the checkpoint folder of step {int(m.group(1))}")
    check_data(path, body["data"], body["step"], body["tokens"])
    _check_extra(path, body["extra"])
    _check_optimizer_meta(path, body["optimizer"])
    return body


def check_rng(ckpt: Path) -> None:
    """``rng.safetensors``: the CPU generator state ``torch`` (uint8, this torch's length), CUDA ones optional."""
    path = ckpt / "rng.safetensors"
    header = tensor_header(path)
    want = tuple(torch.get_rng_state().shape)
    if header.get("torch") != ("U8", want):
        raise CheckpointError(f"checkpoint file {path} is malformed: expected a uint8 tensor 'torch' of shape "
                              f"{want}, got {header.get('torch')}")
    for key, (dtype, shape) in header.items():
        if key != "torch" and not (_CUDA_KEY.match(key) and dtype == "U8" and len(shape) == 1):
            raise CheckpointError(f"checkpoint file {path} is malformed: unexpected tensor {key!r}")


Header = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (safetensors dtype, shape)


def check_optimizer_file(ckpt: Path, meta: dict[str, Any], weights: Header, header: Header, path: Path | str,
                         model_path: Path | str) -> None:
    """The optimizer tensors (``header``, read from ``path``) are those ``state.json`` describes: names
    ``state.<i>.<name>`` for parameter indices of its param groups, the same state names for every parameter,
    and (when recorded) exactly the names and shapes written — so an emptied file cannot silently reset
    AdamW — each shaped like the weight (in ``weights``, read from ``model_path``) it belongs to."""
    state_path = ckpt / "state.json"
    for idx, name in (meta.get("param_names") or {}).items():
        if name not in weights:
            raise CheckpointError(f"checkpoint file {model_path} does not hold the weight {name!r} that "
                                  f"{state_path} names for parameter {idx}")
        shape = weights[name][1]
        for key, (_, got) in header.items():
            # every state tensor is shaped like its weight, but for the 0-d step count AdamW keeps
            if key.startswith(f"state.{idx}.") and (got or not key.endswith(".step")) and got != shape:
                raise CheckpointError(f"checkpoint files {model_path} and {path} disagree: {name} has shape "
                                      f"{shape}, its optimizer state {key} {got}")
    ids = {p for g in meta["param_groups"] for p in g["params"]}
    names: dict[int, set[str]] = {}
    for key in header:
        m = _OPT_KEY.match(key)
        if not m or int(m.group(1)) not in ids:
            raise CheckpointError(f"checkpoint file {path} is malformed: tensor {key!r} is not "
                                  f"'state.<param index>.<name>' for a parameter of {state_path}")
        names.setdefault(int(m.group(1)), set()).add(m.group(2))
    if len({frozenset(n) for n in names.values()}) > 1:
        raise CheckpointError(f"checkpoint file {path} is malformed: parameters hold different optimizer "
                              "state tensors (some are missing)")
    recorded = meta.get("tensors")
    if recorded is not None:
        got = {k: list(shape) for k, (_, shape) in header.items()}
        if got != recorded:
            lost = sorted(set(recorded) - set(got))[:3]
            raise CheckpointError(f"checkpoint file {path} does not hold the optimizer state {state_path} "
                                  f"records ({len(got)} of {len(recorded)} tensors" +
                                  (f"; missing {lost}" if lost else "; shapes differ") + ")")


def _check_shards_meta(ckpt: Path, body: dict[str, Any], files: tuple[str, ...]) -> list[int]:
    """``state.json``'s ``shards`` (sharded layout only): the writing ranks, which must be those whose files
    the manifest lists, and each weight's global shape; optimizer shapes must be recorded too."""
    path = ckpt / "state.json"
    ranks = shard_ranks(files)
    shards = body.get("shards")
    if not ranks:
        if shards is not None:
            raise malformed(path, f"'shards' describes a sharded checkpoint, but {ckpt / MANIFEST} lists "
                                   "model.safetensors")
        return []
    if not isinstance(shards, dict):
        raise malformed(path, f"a sharded checkpoint needs 'shards' (an object), got {shards!r}")
    if shards.get("ranks") != ranks:
        raise malformed(path, f"'shards.ranks' is {shards.get('ranks')!r}, but {ckpt / MANIFEST} lists the "
                               f"files of ranks {ranks}")
    model = shards.get("model")
    if not (isinstance(model, dict) and model and all(
            isinstance(s, list) and all(is_int(n) and n >= 0 for n in s) for s in model.values())):
        raise malformed(path, "'shards.model' must map weight names to shapes (lists of integers)")
    if body["optimizer"].get("tensors") is None:
        raise malformed(path, "a sharded checkpoint must record 'optimizer.tensors' (the global shapes)")
    return ranks


def check_checkpoint(path: str | Path) -> dict[str, Any]:
    """Everything short of loading: :func:`verify_checkpoint`, then the schema of every file. Returns the
    checked ``state.json`` body. Raises :class:`CheckpointError` naming the first file at fault."""
    ckpt = Path(path)
    files = verify_checkpoint(ckpt)
    body = read_state(ckpt)
    ranks = _check_shards_meta(ckpt, body, files)
    meta = body["optimizer"]
    if ranks:  # each tensor as the whole its pieces tile
        state_path = ckpt / "state.json"
        model_path, opt_path = f"{ckpt}/model-r*.safetensors", f"{ckpt}/optimizer-r*.safetensors"
        weights = {k: (t.dtype, t.shape) for k, t in
                   index_pieces(ckpt, "model", ranks, body["shards"]["model"], state_path).items()}
        optim = {k: (t.dtype, t.shape) for k, t in
                 index_pieces(ckpt, "optimizer", ranks, meta["tensors"], state_path).items()}
    else:
        model_path, opt_path = ckpt / "model.safetensors", ckpt / "optimizer.safetensors"
        weights, optim = tensor_header(model_path), tensor_header(opt_path)
    check_rng(ckpt)
    check_optimizer_file(ckpt, meta, weights, optim, opt_path, model_path)
    return body
