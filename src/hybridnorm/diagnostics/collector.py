"""The trainer-facing collector: per-layer statistics on collection steps, nothing at all on the others.

    diag = Diagnostics(model, cfg.diagnostics)
    with diag.capture(step):          # step: 1-based number of the step being taken
        ... forward + backward of every micro-batch ...
    diag.after_backward()             # grad norms per layer, BEFORE clip_grad_norm_
    diag.before_update()              # snapshot θ
    optimizer.step()
    diag.after_update()               # ‖Δθ‖ and ‖θ‖ per layer
    metrics = diag.pop_metrics()      # {} unless this was a collection step

Collection steps are step 1 and every ``every``-th step. Off (``every=0``) or between collection steps
every call is a no-op: no hooks are registered, no parameter is copied. On a collection step forward hooks
on the embedding and on each block read the FIRST micro-batch's residual stream and MoE counts, and a
forward pre-hook on each block's attention kernel module (:class:`hybridnorm.nn.attention.SDPA`) reads the
first sequence's q and k as they enter it (the hooks of later micro-batches return at once). The model
knows nothing of any of this: the hooks are ordinary ``nn.Module`` hooks, removed when the step ends.

Metric keys (``<group>`` as in :mod:`hybridnorm.diagnostics.groups`; ``<layer>`` is ``embed``,
``embed_norm`` or ``blocks.i``; ``<block>`` is ``blocks.i``)::

    grad_norm/<group>  update_norm/<group>  weight_norm/<group>
    act_rms/<layer>  act_max_abs/<layer>  act_kurtosis/<layer>  cos_sim/<layer>
    attn_max_logit/<block>  attn_entropy/<block>
    expert_load_max/<block>  expert_load_min/<block>  expert_load_cv/<block>      (MoE)

DDP: nothing here communicates. Gradients are read after backward, when DDP has already averaged them, so
grad norms are global; weights and updates are identical on every rank; activation, attention and expert
statistics are those of the local (rank 0's) micro-batch. The trainer only builds an enabled collector on
rank 0, so the other ranks do no extra work and no rank ever waits for another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from hybridnorm.diagnostics.config import DiagnosticsConfig
from hybridnorm.diagnostics.groups import UpdateTracker, grad_norm_by_layer, weight_norm_by_layer
from hybridnorm.diagnostics.stats import activation_stats, attention_stats, expert_load_stats
from hybridnorm.nn.attention import SDPA


def attention_kernel(block: nn.Module) -> nn.Module | None:
    """The block's attention kernel module (an :class:`~hybridnorm.nn.attention.SDPA`, called with q (B, H, T, D)
    and k, v (B, Hkv, S, D) as its first three arguments), or None when the block has none."""
    return next((m for m in block.modules() if isinstance(m, SDPA)), None)


class Diagnostics:
    """Collects per-layer training statistics every ``cfg.every`` steps (see the module docstring).

    ``forward_probes=False`` (e.g. under torch.compile, where hooks added on some steps would force
    recompiles) keeps only the gradient / update / weight norms. ``enabled=False`` makes every call a no-op
    (the trainer's non-zero ranks). A block without an attention kernel module (see :func:`attention_kernel`)
    has no attention metrics.
    """

    def __init__(self, model: nn.Module, cfg: DiagnosticsConfig, *, enabled: bool = True,
                 forward_probes: bool = True) -> None:
        self.model, self.cfg = model, cfg
        self.enabled = enabled and cfg.enabled
        self.forward_probes = forward_probes
        self.active = False          # this step is a collection step (set by capture, cleared by pop_metrics)
        self.last: dict[str, Any] | None = None   # the last popped metrics and their step (divergence report)
        self._step = 0
        self._pending: dict[str, Tensor | float] = {}
        self._updates = UpdateTracker(model) if self.enabled else None

    def should_collect(self, step: int) -> bool:
        """Whether the (1-based) optimizer step ``step`` is a collection step."""
        return self.enabled and (step == 1 or step % self.cfg.every == 0)

    @contextlib.contextmanager
    def capture(self, step: int) -> Iterator[bool]:
        """Mark ``step`` as collected or not; on a collection step the forward hooks are on inside the block
        and removed on exit. Yields whether this step is collected."""
        self.active = self.should_collect(step)
        if not self.active:
            yield False
            return
        self._step, self._pending = step, {}
        handles = self._install() if self.forward_probes else []
        try:
            yield True
        finally:
            for h in handles:
                h.remove()

    def _blocks(self) -> list[nn.Module]:
        return list(getattr(self.model, "blocks", []))

    def _install(self) -> list[torch.utils.hooks.RemovableHandle]:
        handles = []
        if self.cfg.activations:
            for name in ("embed", "embed_norm"):
                module = getattr(self.model, name, None)
                if module is not None:
                    handles.append(module.register_forward_hook(self._layer_hook(name)))
        for i, block in enumerate(self._blocks()):
            kernel = attention_kernel(block) if self.cfg.attention else None
            if kernel is not None:
                handles.append(kernel.register_forward_pre_hook(self._attention_hook(f"blocks.{i}")))
            handles.append(block.register_forward_hook(self._layer_hook(f"blocks.{i}", block)))
        return handles

    def _attention_hook(self, name: str):
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            q, k = args[0], args[1]  # (B, H, T, D), (B, Hkv, S, D)
            if f"seen/{name}/attn" in self._pending or q.shape[2] != k.shape[2]:  # later micro-batch / cached keys
                return
            self._pending[f"seen/{name}/attn"] = 1.0
            for stat, value in attention_stats(q[:1], k[:1]).items():
                self._pending[f"attn_{stat}/{name}"] = value

        return hook

    def _layer_hook(self, name: str, block: nn.Module | None = None):
        def hook(module: nn.Module, args: Any, out: Tensor | tuple[Tensor, Tensor]) -> None:
            if f"seen/{name}" in self._pending:  # a later micro-batch: the first one is the sample
                return
            self._pending[f"seen/{name}"] = 1.0
            dual = None
            if isinstance(out, tuple):  # a ResiDual block: (its own stream, the second stream)
                out, dual = out
            if self.cfg.activations:
                for stat, value in activation_stats(out).items():
                    key = stat if stat == "cos_sim" else f"act_{stat}"
                    self._pending[f"{key}/{name}"] = value
                if dual is not None:  # the never-normed stream, whose growth is ResiDual's point
                    self._pending[f"dual_act_rms/{name}"] = activation_stats(dual)["rms"]
            counts = getattr(getattr(block, "ffn", None), "expert_counts", None)
            if counts is not None:
                for stat, value in expert_load_stats(counts).items():
                    self._pending[f"expert_load_{stat}/{name}"] = value

        return hook

    def after_backward(self) -> None:
        """Per-layer gradient norms; call after the last backward of the step and BEFORE clipping."""
        if self.active:
            self._put("grad_norm", grad_norm_by_layer(self.model))

    def before_update(self) -> None:
        if self.active:
            self._updates.snapshot()

    def after_update(self) -> None:
        if self.active:
            self._put("update_norm", self._updates.norms())
            self._put("weight_norm", weight_norm_by_layer(self.model))

    def _put(self, prefix: str, values: dict[str, float]) -> None:
        self._pending.update({f"{prefix}/{k}": v for k, v in values.items()})

    def pop_metrics(self) -> dict[str, float]:
        """This step's metrics as flat ``{key: float}`` ({} when not collected), with ONE device-to-host
        transfer for all tensor statistics; ends the step."""
        if not self.active:
            return {}
        self.active = False
        if self._updates is not None:
            self._updates.discard()  # a skipped update: no after_update came
        pending = {k: v for k, v in self._pending.items() if not k.startswith("seen/")}
        self._pending = {}
        tensors = {k: v for k, v in pending.items() if isinstance(v, Tensor)}
        if tensors:
            values = torch.stack([t.float().reshape(()) for t in tensors.values()]).cpu().tolist()
            pending.update(zip(tensors, values, strict=True))
        metrics = {k: float(v) for k, v in pending.items()}
        self.last = {"step": self._step, **metrics}
        return metrics
