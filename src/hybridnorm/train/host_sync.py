"""When the trainer reads a step's loss and gradient norm back to the host: every step, or at check steps.

The loss and the pre-clip gradient norm of every step feed the non-finite guard, the spike detector and the
log. Reading them (``.item()``) makes the host wait until the device has finished the step, which on a GPU
leaves it idle while the host prepares the next one. ``TrainConfig.host_sync`` picks one of two twins:

``"step"`` — the plain path, and the default on CPU (where a read costs nothing) and whenever
``diagnostics.skip_spikes`` is on (it must decide before each update): each step's values are read before
its update, so a non-finite step stops the run before stepping and a spiking one can be skipped.

``"log"`` — the default on CUDA: no host synchronisation inside a step. The values stay device tensors
until the next *check step* (a log, eval, checkpoint, diagnostics-collection or stopping step, and the
last), where all pending ones are read in one copy and fed, in order, to the same guards. The non-finite
guard cannot wait that long to hold the update back, so it acts on the device: a flag, set by a non-finite
loss or norm and kept set, is fused AdamW's ``found_inf`` input (as under ``GradScaler``): the kernel skips
the update and takes back its step count. From the first bad step on, weights and optimizer state stay
as they were before it; the next check finds it and stops the run with the report the plain path writes
(that step's gradients recomputed from its kept micro-batches on those unchanged weights), and no
checkpoint is written in between, since saving is a check step. Chosen over "check at the next log step and
roll back to the last checkpoint" because it needs no reload, loses no good steps, and leaves exactly the
state, files and ``divergence.json`` of the plain path; the cost is at most ``log_interval - 1`` wasted
steps after a divergence and AdamW's fused implementation (the only one with ``found_inf``).

Both twins log the same values: ``tests/train/test_host_sync.py`` runs ``"log"`` on CPU against
``"step"`` (same fused optimizer), for a clean run and a diverging one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hybridnorm.train.step import StepGradients


def deferred(host_sync: str, device: torch.device, skip_spikes: bool) -> bool:
    """Whether ``host_sync`` (``auto``, ``step`` or ``log``) resolves to reading at check steps only."""
    if host_sync == "auto":
        return device.type == "cuda" and not skip_spikes
    return host_sync == "log"


@dataclass
class StepRecord:
    """One optimizer step's loss and gradient norm: device tensors until read, then floats."""

    step: int                   # 1-based
    loss_t: Tensor              # () mean loss over the micro-batches and ranks
    grad_norm_t: Tensor         # () total gradient norm before clipping
    grads: StepGradients        # its micro-batches, for the divergence report's re-run
    loss: float = math.nan      # set by PendingSteps.read
    grad_norm: float = math.nan
    skip: bool = False          # set by the trainer: a spike whose update is dropped

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


@dataclass
class PendingSteps:
    """The steps not yet read back, and (deferred) the device-side non-finite flag that gates AdamW."""

    deferred: bool
    pending: list[StepRecord] = field(default_factory=list)
    found_inf: Tensor | None = None  # () float32 on the device, 1 once any recorded step was non-finite

    def attach(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        """Deferred: gate ``optimizer`` (fused AdamW) by the flag. The plain path leaves it untouched."""
        if not self.deferred:
            return
        if not optimizer.defaults.get("fused"):
            raise ValueError("host_sync='log' needs fused AdamW: only it skips an update on a device-side flag")
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        optimizer.found_inf = self.found_inf  # read by AdamW.step (the attribute GradScaler sets)

    def record(self, step: int, loss: Tensor, grad_norm: Tensor, grads: StepGradients) -> StepRecord:
        """Remember this step's values; deferred, also raise the flag if one is not finite (on the device:
        no host synchronisation), which holds back this update and every later one."""
        rec = StepRecord(step, loss.detach(), grad_norm.detach(), grads)
        self.pending.append(rec)
        if self.found_inf is not None:
            nonfinite = ~(torch.isfinite(rec.loss_t) & torch.isfinite(rec.grad_norm_t))
            self.found_inf.logical_or_(nonfinite)  # in place: the optimizer holds this tensor
        return rec

    def read(self) -> list[StepRecord]:
        """The pending records with their values filled in, oldest first, read in ONE device-to-host copy;
        clears the pending list."""
        records, self.pending = self.pending, []
        if records:
            # the wider dtype of the two: a float32 value is read exactly as its own .item() would read it
            dtype = torch.promote_types(records[0].loss_t.dtype, records[0].grad_norm_t.dtype)
            pairs = torch.stack([torch.stack((r.loss_t.to(dtype), r.grad_norm_t.to(dtype))) for r in records])
            for rec, (loss, norm) in zip(records, pairs.cpu().tolist(), strict=True):
                rec.loss, rec.grad_norm = loss, norm
        return records
