"""One optimizer step's arithmetic and the evaluation pass, split from the loop (torchtitan's ``train_step``).

:func:`forward_backward` runs the ``grad_accum`` micro-batches of a step (bf16 autocast if asked; DDP
all-reduces only on the last) and leaves the summed gradients in ``.grad``; :func:`clip_gradients` returns
the total norm before clipping; the loop in ``trainer.py`` decides, from that loss and norm, whether the
update is applied (non-finite guard, spike guard) and owns logging, evaluation, checkpoints and stopping.
Nothing in a step reads a tensor back to the host (:func:`evaluate` does, once per batch), and on CUDA the
batches go up through pinned memory without waiting (:func:`to_device`), so the host can queue the next
kernels while the GPU works; when the loop reads the loss is ``hybridnorm.train.host_sync``'s business.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from hybridnorm.data import val_batches
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.distributed import Dist, all_reduce_max


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for ``precision="bf16"``; fp32 runs as written."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A batch tensor on ``device``. CPU -> CUDA goes through pinned (page-locked) memory as a non-blocking
    copy: the host does not wait for it, and the caching host allocator keeps the pinned buffer until the
    copy is done. Elsewhere a plain ``.to``."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class StepGradients:
    """What one forward/backward over a step's micro-batches leaves besides the gradients."""

    loss: Tensor                              # () mean LM loss over the micro-batches (this rank)
    aux: dict[str, Tensor]                    # () MoE auxiliary losses, mean over the micro-batches ({} if dense)
    micro_batches: list[tuple[Tensor, Tensor]]  # kept for the divergence report's re-run


def training_loss(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """``lm_loss`` of the model's logits for x against y, and the MoE losses ({} if dense). The model computes
    it (``targets=``), so that the fast kernels fuse the LM head with the loss (no logits tensor)."""
    return model(x, targets=y, return_aux=True)


def forward_backward(step_model: nn.Module, batches: Iterator[tuple[Tensor, Tensor]], cfg: TrainConfig,
                     device: torch.device, d: Dist) -> StepGradients:
    """Accumulate the gradients of ``cfg.grad_accum`` micro-batches of ``batches`` into ``.grad``."""
    loss_sum = torch.zeros((), device=device)
    micro_batches: list[tuple[Tensor, Tensor]] = []
    aux_sum: dict[str, Tensor] = {}
    for micro in range(cfg.grad_accum):
        x, y = (to_device(t, device) for t in next(batches))  # (B, T) each
        micro_batches.append((x, y))
        last = micro == cfg.grad_accum - 1
        sync = contextlib.nullcontext() if not d.enabled or last else step_model.no_sync()  # one all-reduce/step
        with sync, autocast(cfg.precision, device):
            loss, aux = training_loss(step_model, x, y)
            total = loss + aux["aux_loss"] if aux else loss
            (total / cfg.grad_accum).backward()
        loss_sum += loss.detach()
        for name, value in aux.items():
            aux_sum[name] = aux_sum.get(name, 0.0) + value.detach()
    # logged as the loss is, the step's mean: the last micro-batch's alone made the logged router losses depend on
    # how the global batch is split (W processes logged the mean of W micro-batches, one process with W micro-batches
    # its last one), though the step's gradients do not
    return StepGradients(loss_sum / cfg.grad_accum, {k: v / cfg.grad_accum for k, v in aux_sum.items()},
                         micro_batches)


def clip_gradients(model: nn.Module, max_norm: float) -> Tensor:
    """Clip the total gradient norm to ``max_norm`` (0: no clipping); returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    # FSDP: the norm of DTensor gradients comes back as a replicated DTensor (all-reduced over the shards);
    # its plain value is the same on every rank and is what the loop reads
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


@torch.no_grad()
def evaluate(model: nn.Module, tokens, cfg: TrainConfig, device: torch.device, d: Dist) -> tuple[float, int]:
    """Mean next-token loss over the first ``eval_batches`` global batches of validation windows
    (``eval_batches`` × ``global_batch`` windows: each rank scores ``eval_batches`` × ``grad_accum`` of its
    ``batch_size``), so every split of one global batch scores the same windows: W ranks with batch B and
    G micro-batches per step, one process with batch W·B·G, one with batch B and W·G micro-batches (a run
    resumed on another number of processes keeps measuring what it measured); and the number of tokens
    scored (fewer than asked when validation is short)."""
    was_training = model.training
    model.eval()
    # eval runs eager: under --compile a no-grad pass would need a second graph per block structure (dynamo
    # guards on grad mode), which costs more compile time than a few eval batches save
    with torch.compiler.set_stance("force_eager"):
        total = _eval_sums(model, tokens, cfg, device, d)
    model.train(was_training)
    return (float(total[0] / total[1]) if total[1] > 0 else float("nan")), int(total[1])


def _eval_sums(model: nn.Module, tokens, cfg: TrainConfig, device: torch.device, d: Dist) -> Tensor:
    """(sum of token losses, tokens scored) over every rank's validation windows, float64.

    Every rank runs the same collectives in the same order whatever its share of the split: the most
    batches any rank has (one all-reduce), then that many forwards (under FSDP each all-gathers the
    weights with every rank; a rank with fewer batches pads with unscored one-token forwards), then the
    sums (one all-reduce). Reducing the sums before the padding forwards deadlocked an uneven split."""
    total = torch.zeros(2, dtype=torch.float64)
    # val_batches counts batches of batch_size over all ranks (the trainer's cfg holds the derived global batch)
    n_batches = cfg.eval_windows // cfg.batch_size
    mine = list(val_batches(tokens, cfg.batch_size, cfg.seq_len, n_batches, d.rank, d.world_size))
    n_run = int(all_reduce_max(torch.tensor(float(len(mine))), d).item())
    for i in range(n_run):
        with autocast(cfg.precision, device):
            if i < len(mine):
                x, y = mine[i]
                loss = model(x.to(device), targets=y.to(device))  # lm_loss of the logits
                total += torch.tensor([loss.item() * y.numel(), y.numel()], dtype=torch.float64)
            else:
                model(torch.zeros(1, 1, dtype=torch.long, device=device))
    if d.enabled:
        torch.distributed.all_reduce(total)
    return total
