"""AdamW with explicit weight-decay groups, and the warmup + cosine learning-rate schedule.

The paper's recipe: AdamW β = (0.9, 0.95), eps 1e-8, weight decay 0.1, clip 1.0, linear warmup then
cosine to 10% of the peak. Its reference runs also decayed norm gains (not stated in the paper), so
``decay_norms`` defaults to True. Embeddings are NOT decayed by default: the authors' dense config sets
``decay_embeddings: false``, which is also OLMo's default (with tied embeddings the LM head is the same
tensor, so it is not decayed either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hybridnorm.config_base import Config, bounded
from hybridnorm.errors import ConfigError
from hybridnorm.nn.norms import Norm


@dataclass
class OptimConfig(Config):
    SECTION: ClassVar[str] = "optim"
    lr: float = bounded(3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = bounded(1e-8, ge=0)
    weight_decay: float = bounded(0.1, ge=0)
    decay_norms: bool = True
    decay_embeddings: bool = False
    grad_clip: float = bounded(1.0, ge=0)            # 0 disables clipping
    warmup_steps: int = bounded(2000, ge=0)
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)  # cosine decays to lr * min_lr_ratio

    def check(self) -> None:
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas={list(self.betas)} must be two numbers in [0, 1)")


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Two groups, decay and no-decay; norm gains and embeddings go where the config says."""
    norm_params = {id(p) for m in model.modules() if isinstance(m, Norm) for p in m.parameters()}
    embed_params = {id(p) for name, p in model.named_parameters() if name.split(".")[-2] in ("embed",)}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in norm_params:
            (decay if cfg.decay_norms else no_decay).append(p)
        elif id(p) in embed_params:
            (decay if cfg.decay_embeddings else no_decay).append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def check_trainable(cfg: OptimConfig, where: str = "") -> None:
    """Refuse what the config reads but AdamW cannot train with: eps=0. Refused here, not by the field's bounds:
    a run folder that records it still opens for eval. ``where`` follows the field's name (a grid point)."""
    if cfg.eps == 0:
        raise ConfigError(f"optim.eps=0{where} must be > 0 (default 1e-8): AdamW's step m/(sqrt(v) + eps) is 0/0 = "
                          "NaN for every element whose gradient has been 0 so far (an untied embedding row of a "
                          "token not seen yet, an expert no token reached)")


def build_optimizer(model: nn.Module, cfg: OptimConfig, *, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`. ``fused``: True = torch's fused implementation (one kernel per
    step on CUDA, one vectorised pass per tensor on CPU, and the only AdamW that skips an update on a
    device-side ``found_inf`` flag, see ``hybridnorm.train.host_sync``); False = the foreach one; None = the
    fastest for the parameters (:func:`fused_supported`). Same math, other rounding (tests pin ~1e-7)."""
    cfg.validate()
    check_trainable(cfg)
    if fused is None:
        fused = fused_supported(model)
    impl = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **impl)


def fused_supported(model: nn.Module) -> bool:
    """Whether the fused AdamW takes every parameter: floating tensors on CPU or CUDA, and on CPU no
    DTensor (sharded FSDP parameters there stay on foreach). On CPU the fused step measured 2-8 % faster
    per training step than foreach (benchmarks/README.md), on CUDA it is the recommended one."""
    for p in model.parameters():
        if not p.is_floating_point() or p.device.type not in ("cpu", "cuda"):
            return False
        if p.device.type == "cpu" and isinstance(p, DTensor):
            return False
    return True


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """``"fused"`` or ``"foreach"``: which implementation ``optimizer`` runs (for the run's log)."""
    group = optimizer.param_groups[0]
    return "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """LR for optimizer step ``step`` (0-based): linear warmup, then cosine to ``min_lr_ratio``·lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def unreached_peak(cfg: OptimConfig, max_steps: int) -> float | None:
    """The highest learning rate a run of ``max_steps`` reaches when its warmup is longer than the run (the
    rate then rises the whole run and ``cfg.lr`` is never reached), else None."""
    if cfg.warmup_steps <= max_steps or max_steps < 1:
        return None
    return lr_at(max_steps - 1, cfg, max_steps)


def short_warmup_note(cfg: OptimConfig, max_steps: int) -> str | None:
    """The run log's warning for :func:`unreached_peak`: a reader of the lr line would not guess it."""
    if (peak := unreached_peak(cfg, max_steps)) is None:
        return None
    return (f"optim.warmup_steps={cfg.warmup_steps} > max_steps={max_steps}: the learning rate rises the "
            f"whole run, to {peak:.3g} at the last step; optim.lr={cfg.lr:g} is never reached")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
