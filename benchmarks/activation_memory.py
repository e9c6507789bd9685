#!/usr/bin/env python
"""Activation memory with and without activation checkpointing (``--activation_checkpointing=true``).

For one training step of a size preset (default: ``small``, HybridNorm*, batch 16 × seq 256, the default
training job), with and without ``hybridnorm.nn.regional.checkpoint_blocks``:

* ``kept MiB``: what the forward keeps for the backward, counted exactly. Every tensor autograd saves is
  seen by a ``torch.autograd.graph.saved_tensors_hooks`` pack hook (inside a checkpointed block,
  checkpoint's own hooks take precedence and keep nothing); distinct storages are summed once, parameters
  left out (they exist anyway), and with checkpointing the block inputs the checkpoints hold to recompute
  from are added (seen by a forward pre-hook on each block).
* ``peak MiB``: the peak of all live tensor memory on the device during forward + backward, from
  ``torch.distributed._tools.mem_tracker.MemTracker`` (it follows every tensor storage through a dispatch
  mode, on CPU too; slow, so ``--no-peak`` skips it). On CUDA, ``torch.cuda.max_memory_allocated`` is
  printed as well.
* ``step s``: the median training-step time (forward, loss, backward, AdamW), interleaved between the two
  models step by step; checkpointing costs about one more forward of the blocks.

    python benchmarks/activation_memory.py                 # small preset, bf16 autocast and fp32
    python benchmarks/activation_memory.py --size 151m --batch 1 --seq 1024 --dtypes bf16 --no-peak
"""

from __future__ import annotations

import argparse
import statistics

import torch
from compile_step import model_parser, shifted_loss
from train_step import autocast_ctx, make_step, retain_malloc, time_alternating

import hybridnorm as hn
from hybridnorm.nn.regional import checkpoint_blocks

MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = model_parser(__doc__)
    p.add_argument("--dtypes", default="bf16,fp32", help="comma list of fp32, bf16 (bf16 = autocast)")
    p.add_argument("--reps", type=int, default=5, help="timed steps per model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-peak", action="store_true", help="skip the (slow) MemTracker peak")
    return p.parse_args(argv)


def loss_of(model: hn.TransformerLM, ids: torch.Tensor, dtype: str) -> torch.Tensor:
    with autocast_ctx(dtype, ids.device.type):
        return shifted_loss(model, ids, ids[:, 1:])


def kept_bytes(model: hn.TransformerLM, ids: torch.Tensor, dtype: str) -> int:
    """Bytes the forward keeps for the backward (see the module docstring)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    hooks = [b.register_forward_pre_hook(lambda m, args: keep(args[0])) for b in model.blocks] \
        if model.activation_checkpointing else []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model, ids, dtype)
    for h in hooks:
        h.remove()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(kept.values())


def peak_bytes(model: hn.TransformerLM, ids: torch.Tensor, dtype: str) -> tuple[int, int | None]:
    """Peak live tensor bytes of forward + backward (MemTracker) and, on CUDA, the allocator's peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss_of(model, ids, dtype).backward()
    model.zero_grad(set_to_none=True)
    peak = tracker.get_tracker_snapshot("peak")[ids.device]["Total"]  # parameters, gradients and activations
    return peak, (torch.cuda.max_memory_allocated() - base) if cuda else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    malloc = retain_malloc()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = hn.ModelConfig.from_preset(args.size, placement=args.placement)
    torch.manual_seed(0)
    plain = hn.TransformerLM(cfg).to(device)
    ckpt = hn.TransformerLM(cfg).to(device)
    ckpt.load_state_dict(plain.state_dict())
    checkpoint_blocks(ckpt)
    models = {"plain": plain, "checkpointed": ckpt}
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    print(f"torch {torch.__version__}, {args.threads} threads, {device} | {args.size} {args.placement}: "
          f"{plain.num_params() / 1e6:.1f}M params, {cfg.n_layers} blocks, batch {args.batch} x seq {args.seq} | "
          f"malloc {malloc}")
    print(f"{'dtype':<6}{'model':>14}{'kept MiB':>10}{'peak MiB':>10}{'cuda peak':>10}{'step s':>9}")
    for dtype in (d.strip() for d in args.dtypes.split(",") if d.strip()):
        steps = {name: make_step(m, shifted_loss, torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True), ids,
                                 ids[:, 1:], dtype) for name, m in models.items()}
        wall, _ = time_alternating(steps, 1, args.reps)
        rows = {}
        for name, model in models.items():
            kept = kept_bytes(model, ids, dtype)
            peak, cuda_peak = (None, None) if args.no_peak else peak_bytes(model, ids, dtype)
            rows[name] = kept
            print(f"{dtype:<6}{name:>14}{kept / MIB:>10.1f}{'-' if peak is None else f'{peak / MIB:.1f}':>10}"
                  f"{'-' if cuda_peak is None else f'{cuda_peak / MIB:.1f}':>10}{statistics.median(wall[name]):>9.3f}")
        print(f"{dtype:<6}{'saving':>14}{1 - rows['checkpointed'] / rows['plain']:>10.0%}"
              f"{'':>20}{statistics.median(wall['checkpointed']) / statistics.median(wall['plain']):>8.2f}x")


if __name__ == "__main__":
    main()
