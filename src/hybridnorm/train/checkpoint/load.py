"""Reading a checkpoint back into a model and its optimizer — whatever layout wrote it, whatever this run's is.

Everything is checked (:func:`~hybridnorm.train.checkpoint.format.check_checkpoint`: hashes and the schema of
every file) and read before anything is changed, so a refused checkpoint leaves model and optimizer as they
were. Weights and optimizer state are read slice by slice (:class:`~hybridnorm.train.checkpoint.shards.
TensorReader`): each live tensor gets exactly its part — all of it in one process, its ``DTensor`` shard
under FSDP — from whichever stored pieces hold it. That is resharding: a checkpoint of 2 FSDP ranks resumes
in 1 process (or generate/eval/export opens it), one of 1 process resumes on 2 FSDP ranks, and N on M.
Only safetensors and JSON are read; nothing is unpickled.

A bad checkpoint meets one of two outcomes, decided by which check finds the fault — the rule every new
check follows, so that alike problems of weights, optimizer state and counters end alike:

- **corrupt** (set aside): whatever :func:`check_checkpoint` finds. It reads the checkpoint alone, JSON and
  safetensors headers (and the hashes): a file that differs from the manifest, a malformed ``state.json``,
  a counter no run could reach (:mod:`.counters`), a tensor missing or shaped unlike the weight it belongs
  to. Such a checkpoint is wrong whoever reads it, so resume moves it into ``corrupt/`` (never deleting it)
  and takes the newest good one before it (:mod:`.retention`).
- **refused** (one error, nothing moved): whatever only loading finds, here — the tensors against the run that
  loads them (this model's names, shapes and dtypes, this optimizer's) and their values (finite; AdamW's step
  count a whole number within the checkpoint's step), read from the tensor data. A misfit may be the reading
  run's fault (another config), and the values are too costly to read at every save's retention check; so
  the run stops with the file named, and the person decides.

Weights and optimizer state are held alike: a float16 moment is refused as a float16 weight is, a NaN moment
as a NaN weight. A checkpoint of a newer format than this code reads is neither: refused as newer
(:class:`~hybridnorm.train.checkpoint.layout.NewerFormatError`), never set aside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from hybridnorm.errors import ConfigError
from hybridnorm.train.checkpoint.counters import check_optimizer_step
from hybridnorm.train.checkpoint.format import CheckpointError, check_checkpoint
from hybridnorm.train.checkpoint.layout import ShardedTensor
from hybridnorm.train.checkpoint.shards import TensorReader, like, local_box
from hybridnorm.train.tensor_check import DTYPE_NAMES, check_finite, check_header_dtypes


@dataclass
class TrainState:
    """Everything beyond weights and optimizer tensors that an exact resume needs."""

    step: int = 0
    tokens: int = 0
    data: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def _shards(body: dict[str, Any]) -> tuple[list[int], dict[str, list[int]] | None]:
    """The writing ranks of a sharded checkpoint and its weight shapes; ``([], None)`` when unsharded."""
    shards = body.get("shards") or {}
    return shards.get("ranks", []), shards.get("model")


def _file_label(ckpt: Path, kind: str, ranks: list[int]) -> str:
    return f"{ckpt}/{kind}-r*.safetensors" if ranks else str(ckpt / f"{kind}.safetensors")


def _weights_for(ckpt: Path, model: nn.Module, body: dict[str, Any]) -> dict[str, torch.Tensor]:
    """This process's part of every weight of ``ckpt``, as ``model.load_state_dict`` takes it; refused (naming
    the file) unless every name and global shape fits ``model``."""
    ranks, shapes = _shards(body)
    f = _file_label(ckpt, "model", ranks)
    expected = model.state_dict()
    dtype = next(iter(expected.values())).dtype
    try:  # a header is the file's own claim: it must say the model's dtype (fp32 master weights), not I32...
        check_header_dtypes(sorted(ckpt.glob("model*.safetensors")), DTYPE_NAMES.get(dtype))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    with TensorReader(ckpt, "model", ranks, shapes) as reader:
        if set(reader.index) != set(expected):
            missing, extra = sorted(set(expected) - set(reader.index)), sorted(set(reader.index) - set(expected))
            raise CheckpointError(f"checkpoint file {f} does not fit this model: missing {missing[:5]}, "
                                  f"unexpected {extra[:5]}")
        for k, v in expected.items():
            if reader.shape(k) != tuple(v.shape):
                raise CheckpointError(f"checkpoint file {f}: {k} has shape {reader.shape(k)}, "
                                      f"the model expects {tuple(v.shape)} (vocab or size mismatch?)")
        local = {k: reader.read(k, *local_box(v)) for k, v in expected.items()}  # this process's parts
    try:  # ...and hold finite values: a NaN or inf weight poisons every output
        check_finite(local.items(), f)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    return {k: like(local[k], v) for k, v in expected.items()}


def _step_dtypes() -> tuple[str, ...]:
    """The dtypes torch's AdamW keeps its step count in: float32 (always when fused), or float64 where that is
    torch's default dtype."""
    return ("F32", "F64") if torch.get_default_dtype() == torch.float64 else ("F32",)


def _check_dtype(ckpt: Path, t: ShardedTensor, key: str, want: tuple[str, ...]) -> None:
    """An optimizer tensor's header dtype, as :func:`check_header_dtypes` checks a weight's: a float16 moment
    read into fp32 state would lose what it held below float16's precision, silently."""
    if want and t.dtype not in want:
        raise CheckpointError(f"checkpoint file {ckpt / t.pieces[0].file}: tensor {key!r} is stored as {t.dtype}, "
                              f"but the optimizer state of this run is {' or '.join(want)}")


def _optimizer_state(ckpt: Path, opt: torch.optim.Optimizer, body: dict[str, Any], model: nn.Module,
                     ) -> dict[str, Any]:
    """An ``opt.load_state_dict`` argument from ``ckpt``, refused unless its groups and tensor shapes and dtypes
    fit ``opt`` (torch would accept a misfit here and fail, or worse not fail, at the next step), its values are
    finite and its step counts possible. Each state tensor is read as its parameter's part (a ``DTensor`` shard
    of it under FSDP). The groups keep ``opt``'s own settings, all but the learning rate."""
    meta, (ranks, _) = body["optimizer"], _shards(body)
    f, sj = _file_label(ckpt, "optimizer", ranks), ckpt / "state.json"
    saved, live = meta["param_groups"], opt.param_groups
    param_of = _params_by_name(meta, opt, model)
    if param_of is None:  # a checkpoint that records no names: its groups must fit position by position
        sizes = [len(g["params"]) for g in saved], [len(g["params"]) for g in live]
        if sizes[0] != sizes[1]:
            raise CheckpointError(f"checkpoint files {sj} and {f} do not fit this optimizer: parameter groups of "
                                  f"sizes {sizes[0]}, this model's are {sizes[1]} (optim.decay_norms or "
                                  f"optim.decay_embeddings changed? this checkpoint records no parameter names "
                                  f"to regroup its state by)")
        param_of = {i: p for g, lg in zip(saved, live, strict=True) for i, p in zip(g["params"], lg["params"],
                                                                                     strict=True)}
    state: dict[int, dict[str, Any]] = {}
    read: list[tuple[str, torch.Tensor]] = []  # this process's part of each tensor, checked before it is used
    with TensorReader(ckpt, "optimizer", ranks, meta.get("tensors")) as reader:
        for key in reader.index:
            _, idx, name = key.split(".", 2)
            p, shape = param_of[int(idx)], reader.shape(key)
            if (shape or name != "step") and shape != tuple(p.shape):  # only AdamW's step count is 0-d
                raise CheckpointError(f"checkpoint file {f}: {key} has shape {shape} but its parameter "
                                      f"(per {sj}) has {tuple(p.shape)}")
            # the dtype the trainer saves: its parameter's (fp32 master weights), or the step count's float
            want = (DTYPE_NAMES[p.dtype],) if p.dtype in DTYPE_NAMES else ()
            _check_dtype(ckpt, reader.index[key], key, _step_dtypes() if name == "step" and not shape else want)
            # a 0-d entry (AdamW's step count) is one whole tensor; the others are shaped (and sharded) like p
            t = reader.read(key, *local_box(p)) if shape else reader.read(key)
            read.append((key, t))
            state.setdefault(int(idx), {})[name] = like(t, p) if shape else t
    try:  # as a weight's: a NaN or inf moment poisons every later update of its parameter
        check_finite(read, f)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    for key, t in read:
        if key.endswith(".step") and not t.dim():
            check_optimizer_step(f, key, t, body["step"], sj)
    for key, value in meta["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    # the settings are this run's (its config's weight decay, betas and eps, the AdamW implementation it chose),
    # the state the checkpoint's: torch's load_state_dict would take the saved groups whole, so a resume with
    # --optim.weight_decay=... logged the change and trained on with the old value, and a foreach checkpoint
    # resumed with host_sync=log stepped foreach, which refuses fused AdamW's found_inf. Only the learning rate
    # is kept (the schedule's value at the checkpoint; the trainer sets its own before every step)
    # torch pairs the groups' index lists with the live groups' parameters by position: each live parameter is
    # listed under the saved index of its state, so a parameter that changed group (optim.decay_norms or
    # optim.decay_embeddings changed on resume) keeps its moments
    index_of = {id(p): i for i, p in param_of.items()}
    lr = saved[0].get("lr")  # one schedule for every group
    groups = [{**{k: v for k, v in lg.items() if k != "params"}, "lr": lg["lr"] if lr is None else lr,
               "params": [index_of[id(p)] for p in lg["params"]]} for lg in live]
    return {"state": state, "param_groups": groups}


def _params_by_name(meta: dict[str, Any], opt: torch.optim.Optimizer, model: nn.Module,
                    ) -> dict[int, torch.Tensor] | None:
    """Each saved parameter index's live parameter, paired by the weight names the checkpoint records; None
    where it records none (older checkpoints) or its names are not exactly the optimizer's parameters."""
    names = meta.get("param_names")
    saved_ids = [i for g in meta["param_groups"] for i in g["params"]]
    if not names or sorted(names) != sorted(str(i) for i in saved_ids):
        return None
    by_name = dict(model.named_parameters())
    live = {id(p) for g in opt.param_groups for p in g["params"]}
    param_of = {i: by_name.get(names[str(i)]) for i in saved_ids}
    if any(p is None or id(p) not in live for p in param_of.values()) or \
            len({id(p) for p in param_of.values()}) != len(live):
        return None
    return param_of


def _rng_states(ckpt: Path) -> dict[str, torch.Tensor]:
    f = ckpt / "rng.safetensors"
    try:
        rng = load_file(str(f))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"checkpoint file {f} cannot be read: {e}") from None
    try:
        torch.Generator().set_state(rng["torch"])  # a throwaway generator: refuse a bad state before using it
        for key in rng:  # the CUDA ones too, where they will be applied (a wrong length: torch's error, late)
            if key.startswith("cuda.") and torch.cuda.is_available() and int(key[5:]) < torch.cuda.device_count():
                torch.Generator(device=f"cuda:{int(key[5:])}").set_state(rng[key])
    except (RuntimeError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint file {f} holds an invalid RNG state: {e}") from None
    return rng


def load_weights(path: str | Path, model: nn.Module) -> None:
    """Load the weights of a checkpoint folder (every file checked first) into ``model``, whole or sharded."""
    ckpt = Path(path)
    body = check_checkpoint(ckpt)
    model.load_state_dict(_weights_for(ckpt, model, body))


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    ) -> TrainState:
    """Restore weights, optimizer and RNG from a checked checkpoint; return its :class:`TrainState`. Everything
    is read and checked before anything is changed, so a refused checkpoint leaves model and optimizer as
    they were. Every rank of a run calls it (each reads its own part); the RNG state is rank 0's."""
    ckpt = Path(path)
    body = check_checkpoint(ckpt)
    weights = _weights_for(ckpt, model, body)
    opt_state = _optimizer_state(ckpt, optimizer, body, model) if optimizer is not None else None
    rng = _rng_states(ckpt)
    model.load_state_dict(weights)
    if optimizer is not None:
        try:
            optimizer.load_state_dict(opt_state)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint files {ckpt / 'state.json'} and "
                                  f"{_file_label(ckpt, 'optimizer', _shards(body)[0])} "
                                  f"do not load into this optimizer: {e}") from None
    torch.set_rng_state(rng["torch"])
    cuda = [rng[k] for k in sorted((k for k in rng if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    return TrainState(step=body["step"], tokens=body["tokens"], data=body["data"], extra=body["extra"])
