"""Per-block training wrappers: activation checkpointing and regional ``torch.compile``.

Both act on each :class:`~hybridnorm.nn.block.Block` of a :class:`~hybridnorm.nn.model.TransformerLM` in
place (torchtitan's ``apply_ac`` / ``apply_compile``) and leave its parameter names, state dict and
checkpoint files exactly as they are: no wrapper module is inserted.

**Activation checkpointing** (:func:`checkpoint_blocks`): the model runs each block under
``torch.utils.checkpoint`` (non-reentrant) while gradients are on, so only the block inputs are kept and
the rest is recomputed in backward. The recompute calls the block module again, so its forward hooks fire
twice per micro-batch (forward and backward): hooks must count a module once per micro-batch, as
:class:`hybridnorm.diagnostics.Diagnostics` does (``tests/nn/test_regional.py`` checks that its metrics are
unchanged). A MoE block's ``aux_losses`` and ``expert_counts`` are overwritten by the recompute with equal
values; the trainer reads the ones returned by the forward.

**Regional compilation** (:func:`compile_blocks`): ``block.compile()`` on every block instead of compiling
the whole model. All blocks share one code object, so dynamo compiles it once and reuses the graph for
every block whose structure is the same; a structurally different block (HybridNorm*'s first) adds one
graph. What makes that hold is in the model code: ``Block`` passes the sublayer module and its arguments
(no per-call closure, whose code object dynamo would guard), the KV-cache layer index is read only when a
cache is given (a per-layer int attribute is a static guard), and the hand-written kernels step aside
while compiling (:func:`hybridnorm.nn.kernels.active`: inductor fuses the plain math, and their ``out=``
writes would break the graph). ``tests/nn/test_regional.py`` counts graphs, recompiles and graph breaks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def checkpoint_blocks(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Recompute each block's activations in backward instead of storing them (see the module docstring);
    returns ``model``. Costs about one extra forward of the blocks per step."""
    model.activation_checkpointing = enabled
    return model


def compile_blocks(model: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """``torch.compile`` each block in place (``compile_kwargs`` go to it, e.g. ``backend="aot_eager"``);
    returns ``model``. The embedding, final norm, head and loss stay eager (the head and loss:
    :func:`compile_head_loss`): one block graph is most of the FLOPs, and compiling it once keeps the compile
    time independent of depth."""
    for block in model.blocks:
        block.compile(**compile_kwargs)
    return model


def compile_head_loss(model: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """``torch.compile`` the LM head + loss (``TransformerLM._loss``) in place, as an instance attribute (the
    parameters, their names and the state dict are untouched); returns ``model``.

    While compiling, the hand-written fused head + cross-entropy steps aside (:func:`hybridnorm.nn.kernels.active`)
    and dynamo traces the plain line, ``F.linear`` then ``F.cross_entropy`` on an fp32 view: inductor fuses the
    fp32 log-softmax and its gradient into a few kernels and keeps only the logits in the compute dtype for
    the backward (2 bytes per logit in bf16; ``hybridnorm plan --loss compiled``). On an H200 (550M, 100k
    vocabulary, bf16, 25 x 4096 tokens) that step ran at 122.7k tokens/s against 107.4k with the eager fused
    kernel, whose chunk loop launches several unfused passes over the fp32 logits (benchmarks/README.md);
    the fused kernel keeps nothing per logit, so it stays the choice where memory is short or without a GPU.
    One more graph; evaluation runs it eagerly like the blocks (train/step.py)."""
    model._loss = torch.compile(model._loss, **compile_kwargs)
    return model


def compile_counts() -> dict[str, int]:
    """This process's ``torch.compile`` totals so far: frames compiled (one per block structure, plus one
    per recompile), graphs, and graph breaks. The trainer logs them with each metrics line, so a recompile
    every step or a graph break shows in ``metrics.jsonl`` instead of only as a slow step."""
    from torch._dynamo.utils import counters

    return {"compile/frames": int(counters["frames"]["ok"]), "compile/graphs": int(counters["stats"]["unique_graphs"]),
            "compile/graph_breaks": int(sum(counters["graph_break"].values()))}
