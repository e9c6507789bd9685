"""Data parallelism across ``torchrun`` processes: DDP (every rank holds the whole model) or FSDP2
(``fully_shard``: each rank holds 1/N of every weight, gradient and optimizer state), chosen by ``--parallel``.

A process not started by ``torchrun`` ignores ``--parallel``; under ``torchrun`` (one process too: it joins a
group of one, train/distributed.py) the trainer calls, in this order:

1. :func:`shard_model` right after building the model and BEFORE building the optimizer: ``fully_shard``
   replaces every parameter by a sharded ``DTensor`` parameter, and the optimizer must hold those.
   Each transformer block is one FSDP unit (its weights are gathered just before its forward and freed
   after it), the root unit holds the rest (embedding, final norm, head). ``--parallel_replicate=R`` makes
   it HSDP: a 2-D mesh of R replicas × (world / R) shards, weights sharded within a replica group and
   gradients all-reduced across the groups.
2. :func:`data_parallel` around the (maybe compiled) module the step calls: DDP, or for FSDP a thin
   adapter whose ``no_sync()`` turns the gradient reduce-scatter off for all but the last micro-batch of
   a step (``set_requires_gradient_sync``), so grad accumulation communicates once per step.

What does not change under FSDP: the raw ``model`` is what checkpoints, evaluation and clipping use. Its
parameters and ``.grad`` are ``DTensor`` s; ``torch.nn.utils.clip_grad_norm_`` computes the norm of each
local shard, all-reduces it and returns a replicated ``DTensor`` (the same total norm on every rank, ``.item()``
works), and clips each shard by it — so the loop's clipping, guards and logging run unchanged (checked in
``tests/train/test_fsdp.py``: the norms match one process). Checkpoints are written sharded
(:mod:`hybridnorm.train.checkpoint.shards`).

Mixed precision: on CUDA with ``precision=bf16`` the units get ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: weights are gathered in bf16 (half the all-gather bytes, no per-op weight casts) while
the master weights, optimizer state and the gradient reduction stay fp32. The step's bf16 ``autocast`` is
kept on top, on purpose: the policy only decides the dtype of the *parameters*; autocast still decides the
dtype each *op* computes in (the loss and anything on autocast's fp32 list run in fp32, as in a DDP bf16
run), and casting an already-bf16 weight is a no-op, so nothing is cast twice. ``cast_forward_inputs`` is
off so the fp32 RoPE tables reach every block in fp32 (as under DDP) rather than rounded to bf16. On CPU
(gloo) no policy is set: the weights stay fp32 and autocast alone makes bf16 compute, exactly as a DDP CPU
run does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hybridnorm.errors import ConfigError
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.distributed import Dist


def uses_fsdp(cfg: TrainConfig, d: Dist) -> bool:
    """FSDP is on when asked for AND the process is in a group (torchrun, one rank or more)."""
    return d.enabled and cfg.parallel == "fsdp"


def _mesh(cfg: TrainConfig, device: torch.device, d: Dist) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    replicas = cfg.parallel_replicate
    if d.world_size % replicas:
        raise ConfigError(f"parallel_replicate={replicas} does not divide the {d.world_size} processes: HSDP "
                          f"needs replicas x shards = world size")
    if replicas == 1:
        return init_device_mesh(device.type, (d.world_size,), mesh_dim_names=("shard",))
    # HSDP: fully_shard shards over the last mesh dim and replicates over the first
    return init_device_mesh(device.type, (replicas, d.world_size // replicas), mesh_dim_names=("replicate", "shard"))


def _refuse_unsupported(cfg: TrainConfig) -> None:
    if cfg.diagnostics.every > 0:
        # the collector runs on rank 0 only; under FSDP every norm of a sharded weight is a collective that
        # the other ranks would never join (a hang), so it is refused instead
        raise ConfigError(f"diagnostics.every={cfg.diagnostics.every}: per-layer diagnostics are not supported "
                          "with parallel=fsdp; use parallel=ddp or diagnostics.every=0")


def shard_model(model: nn.Module, cfg: TrainConfig, device: torch.device, d: Dist) -> bool:
    """Apply ``fully_shard`` to each block and the root of ``model`` (in place) when FSDP is on; returns
    whether it did. Call it before building the optimizer (see the module docstring)."""
    if not uses_fsdp(cfg, d):
        return False
    _refuse_unsupported(cfg)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _mesh(cfg, device, d)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if device.type == "cuda" and cfg.precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                   cast_forward_inputs=False)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        # the last block's backward starts right after its forward: freeing its weights in between would only
        # cost one more all-gather
        fully_shard(block, reshard_after_forward=i < len(blocks) - 1, **kwargs)
    fully_shard(model, **kwargs)
    return True


class FSDPStep(nn.Module):
    """The module the step calls under FSDP: ``module`` (the sharded model, maybe compiled) with DDP's
    ``no_sync()`` spelled for FSDP2, so the step code is the same for both."""

    def __init__(self, module: nn.Module, root: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._root = [root]  # a list: not registered twice as a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally (no reduce-scatter) inside the block; the next backward
        outside it reduces the accumulated sum once."""
        root = self._root[0]
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)


def data_parallel(step_model: nn.Module, model: nn.Module, cfg: TrainConfig, device: torch.device,
                  d: Dist) -> nn.Module:
    """``step_model`` (``model`` or its compiled form) ready for the step: DDP, FSDP's adapter (``model``
    was sharded by :func:`shard_model`), or itself in a single process."""
    if not d.enabled:
        return step_model
    if uses_fsdp(cfg, d):
        return FSDPStep(step_model, model)
    return DDP(step_model, device_ids=[device.index] if device.type == "cuda" else None,
               find_unused_parameters=model.is_moe)  # an expert may get no tokens
