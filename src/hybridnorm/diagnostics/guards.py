"""Guards: a loss / grad-norm spike detector, and the post-mortem of a non-finite step.

Spikes. :class:`SpikeDetector` keeps the last ``window`` finite losses and (pre-clip) grad norms and flags
a value more than ``zscore`` standard deviations ABOVE its window's mean (a drop is never a spike), once
the window holds at least 10 values. Every finite value enters the window, a flagged one too: a lasting
level shift then stops firing after a few steps instead of freezing training under ``skip_spikes``. The
window is part of the checkpoint (``state_dict``) so a resumed run flags exactly the same steps.

Non-finite steps. :func:`first_nonfinite_module` re-runs the forward of the offending micro-batches once
with a hook on every module and names the first module, in execution order, whose output is not finite
(children finish before their parents, so this is the innermost culprit). The hooks also make the
attention run its Q/K/V norms as modules (its fused fast kernel steps aside while they are hooked), so a
norm inside the attention is named too. :func:`divergence_report` adds the first non-finite parameter and
gradient, the recent losses and the last collected diagnostics.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hybridnorm.diagnostics.config import MIN_SPIKE_HISTORY
from hybridnorm.diagnostics.groups import strip_wrappers


@dataclass(frozen=True)
class SpikeEvent:
    metric: str       # "loss" or "grad_norm"
    value: float
    mean: float       # of the window before this value
    std: float
    zscore: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SpikeDetector:
    """Rolling z-score of the loss and the grad norm; ``zscore=0`` turns the scoring off (check returns
    None) but the window still fills: it is also the divergence report's list of recent losses."""

    METRICS = ("loss", "grad_norm")

    def __init__(self, window: int = 50, zscore: float = 6.0) -> None:
        self.window, self.zscore = window, zscore
        self.history: dict[str, deque[float]] = {m: deque(maxlen=window) for m in self.METRICS}

    def check(self, loss: float, grad_norm: float) -> SpikeEvent | None:
        """Score both values against their windows, then add them; returns the stronger spike or None.
        Non-finite values are ignored (the trainer's non-finite guard handles them)."""
        events = [e for m, v in zip(self.METRICS, (loss, grad_norm), strict=True)
                  if self.zscore > 0 and (e := self._score(m, v))]
        for m, v in zip(self.METRICS, (loss, grad_norm), strict=True):
            if math.isfinite(v):
                self.history[m].append(float(v))
        return max(events, key=lambda e: e.zscore, default=None)

    def _score(self, metric: str, value: float) -> SpikeEvent | None:
        hist = self.history[metric]
        if len(hist) < MIN_SPIKE_HISTORY or not math.isfinite(value):
            return None
        mean = math.fsum(hist) / len(hist)
        std = math.sqrt(math.fsum((h - mean) ** 2 for h in hist) / len(hist))
        # a floor relative to the mean: a perfectly flat window would otherwise flag any rounding jitter
        z = (value - mean) / max(std, 1e-6 * abs(mean), 1e-12)
        return SpikeEvent(metric, float(value), mean, std, z) if z > self.zscore else None

    def state_dict(self) -> dict[str, list[float]]:
        return {m: list(h) for m, h in self.history.items()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        for m in self.METRICS:
            self.history[m] = deque((float(v) for v in state.get(m, [])), maxlen=self.window)


def _nonfinite(out: Any) -> bool:
    tensors = out if isinstance(out, (tuple, list)) else (out,)
    return any(isinstance(t, Tensor) and t.is_floating_point() and not torch.isfinite(t).all() for t in tensors)


@torch.no_grad()
def first_nonfinite_module(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]],
                           loss_fn: Callable[[Tensor, Tensor], Tensor]) -> str | None:
    """Re-run ``loss_fn(x, y)`` (which must call ``model``) on each micro-batch with a forward hook on every
    module; the name of the first module whose output is not finite, ``"loss"`` if every module output is
    finite but the loss is not, or None if the re-run is finite throughout."""
    first: list[str] = []

    def hook_for(name: str):
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if not first and _nonfinite(out):
                first.append(name)
        return hook

    handles = [m.register_forward_hook(hook_for(strip_wrappers(n) or "model")) for n, m in model.named_modules()]
    try:
        for x, y in batches:
            loss = loss_fn(x, y)
            if first:
                return first[0]
            if not torch.isfinite(loss).all():
                return "loss"
    finally:
        for h in handles:
            h.remove()
    return None


def first_nonfinite_param(model: nn.Module, grad: bool) -> str | None:
    """Name of the first parameter whose gradient (``grad=True``) or value is not finite."""
    for name, p in model.named_parameters():
        t = p.grad if grad else p
        if t is not None and not torch.isfinite(t).all():
            return strip_wrappers(name)
    return None


def has_nonfinite_weight(model: nn.Module) -> bool:
    """Whether any parameter (this rank's own shard of a sharded one) holds a non-finite value; one host sync."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    flags = [torch.isfinite(t).all() for t in local if t.numel()]
    return bool(not torch.stack(flags).all()) if flags else False


def divergence_report(*, step: int, loss: float, grad_norm: float, model: nn.Module,
                      batches: Iterable[tuple[Tensor, Tensor]], loss_fn: Callable[[Tensor, Tensor], Tensor],
                      recent_losses: list[float], last_diagnostics: dict[str, Any] | None,
                      last_checkpoint: str | None) -> dict[str, Any]:
    """The contents of ``divergence.json`` for a step whose loss or grad norm is not finite.

    ``step`` is the 1-based number of the failed step (as in metrics.jsonl); ``first_nonfinite`` is the
    module found by the re-run, else the first parameter with a non-finite gradient, else the first
    non-finite parameter (``first_nonfinite_from`` says which search found it)."""
    grads = first_nonfinite_param(model, grad=True)  # before the re-run: it does not touch .grad anyway
    params = first_nonfinite_param(model, grad=False)
    module = first_nonfinite_module(model, batches, loss_fn)
    found = next(((src, name) for src, name in (("forward", module), ("grad", grads), ("param", params))
                  if name is not None), (None, None))
    return {"step": step, "completed_steps": step - 1, "loss": loss, "grad_norm": grad_norm,
            "first_nonfinite": found[1], "first_nonfinite_from": found[0],
            "first_nonfinite_module": module, "first_nonfinite_grad": grads, "first_nonfinite_param": params,
            "recent_losses": recent_losses, "last_diagnostics": last_diagnostics,
            "last_checkpoint": last_checkpoint}
