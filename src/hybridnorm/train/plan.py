"""Memory plan of a training job: bytes per GPU under DDP and FSDP, the largest micro-batch that fits, and
the gradient accumulation a global batch (in tokens) needs. Nothing is allocated: the model is built on the
``meta`` device, so parameter counts are the real model's, exactly (:func:`preflight.param_count` is a cheaper
upper bound that over-counts the norm vectors on purpose).

**States** (N parameters, P GPUs; ``shard(x)``: FSDP2's dim-0 shard of each parameter, ceil(rows / P) rows,
summed over parameters: rank 0's share, the largest). What :mod:`hybridnorm.train.parallel` really keeps:

- parameters: fp32 master weights in both modes (bf16 is autocast, or under FSDP a bf16 *gathered copy*);
  DDP 4·N, FSDP 4·shard(N);
- gradients: fp32; DDP 4·N plus 4·N of DDP's reduction buckets (``gradient_as_bucket_view`` is off);
  FSDP 4·shard(N), plus 4·N of unsharded fp32 gradients whenever grad_accum > 1 (the step's ``no_sync``
  accumulates them unreduced);
- AdamW: exp_avg and exp_avg_sq in fp32, 8 bytes per (local) parameter;
- FSDP gathered weights (c bytes each, c = 2 for bf16, 4 for fp32): the root unit (embedding, final norm),
  two blocks (the one running and the prefetched one) and the last block, which is never resharded; plus
  one block's unsharded fp32 gradient before its reduce-scatter.

**Activations** (bytes per token, saved for the backward; r = 4: the residual stream and the norms run in
fp32; c as above; d model width, H/Hkv heads of size D, h FFN hidden size) per block:

    norms  Σ over the d-wide slots on (in/out/post of both sublayers)   (r·d + 4)        input + rstd
    attn   c·d + 2·c·(H + 2·Hkv)·D + 2·c·H·D + 4·H                     qkv input, projection out and
                                                                        q/k/v, SDPA out and W_O input, lse
           + Σ over the Q/K/V/C norms on  (r·w + 4·w/D)                 w = H·D (Q, C) or Hkv·D (K, V)
    ffn    c·d + 2·c·h + 2·c·h                                          w_in input, gate|up, silu·up twice
    MoE    r·d + k·c·(4·h + 3·d) + 8·E + 28·k + 4                       router's fp32 input; per assignment
           (E experts, top k, h per expert)                             its input row, gate|up, silu(gate),
                                                                        silu·up, its output row twice;
                                                                        logits, softmax, ids, sort, gates

plus per token r·d + 4 + c·d + 8 (final norm, head input or its gradient, token ids), and the LM head +
loss (V the padded vocabulary): the fused kernel of ``fast_kernels`` (what runs uncompiled, on every device) keeps
nothing per logit, only while it runs one chunk of fp32 logits and their gradient (~2^28 logits on a GPU)
and the (V, d) weight gradient; the plain line (``fast_kernels=false``) keeps the fp32 log-softmax, 4·V per
token, and at the start of its backward 8·V more (its gradient and its input's); compiled (the trainer's
choice on a GPU under ``--compile=true``, the planner's default) keeps c·V per token, the logits:
:func:`loss_peak_bytes`.
Under DDP with bf16, autocast keeps a bf16 copy of every matmul weight until the
backward: 2·N_matmul bytes, whatever the batch (:func:`weight_copy_bytes`; an MoE's 3-D expert weights too,
which the experts cast by hand for grouped_mm: before 2026-12-02 they were left out).
With activation checkpointing a block keeps only its
input (r·d per token), and one block's full activations come back during its recompute. ResiDual's second
stream adds r·d + 4 per token (its norm) and, with checkpointing, r·d per block (a second input).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from hybridnorm.config import ModelConfig
from hybridnorm.config_base import Config, bounded
from hybridnorm.config_text import parse_text
from hybridnorm.errors import ConfigError
from hybridnorm.nn.kernels.loss import CE_CHUNK_ELEMENTS_GPU

GIB = 2**30
PAPER_GLOBAL_TOKENS = 4 * 2**20  # the paper's 4M-token batch: 1024 sequences of 4096
R = 4  # residual stream and norm statistics are fp32 under autocast too


@dataclass
class PlanOptions(Config):
    """The planner's options; a bad value is one ConfigError naming its ``--option``."""

    SECTION: ClassVar[str] = "plan"
    size: str = "1.2b"
    gpus: int = bounded(8, ge=1)
    gpu_mem: float = bounded(80.0, gt=0, le=2.0**30)  # GiB per GPU (at most an exbibyte: a number it can count)
    seq_len: int = bounded(4096, ge=1)
    micro_batch: int | None = bounded(None, ge=1)  # None: the largest that fits
    global_batch_tokens: int = bounded(PAPER_GLOBAL_TOKENS, ge=1)
    precision: Literal["bf16", "fp32"] = "bf16"
    placement: str = "hybridnorm_star"
    # LM head + loss: compiled = the plain line under torch.compile, what the trainer runs on a GPU under
    # --compile=true (head_loss=auto); fast = the eager fused kernel (fast_kernels=true, no compile); plain =
    # the eager plain line (fast_kernels=false)
    loss: Literal["compiled", "fast", "plain"] = "compiled"
    headroom: float = bounded(0.10, ge=0, lt=1)  # fraction of gpu_mem left for the allocator, NCCL, kernels

    @classmethod
    def label(cls, name: str) -> str:
        return "--" + name.replace("_", "-")  # name the option as it is typed


@dataclass
class ModePlan:
    """One parallel mode's bytes per GPU (activations at ``micro_batch``)."""

    mode: str
    params: int
    grads: int
    optim: int
    buffers: int  # DDP buckets / FSDP gathered weights and unsharded gradients
    act: int
    act_ckpt: int
    max_micro_batch: int
    max_micro_batch_ckpt: int

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optim + self.buffers


@dataclass
class Plan:
    options: PlanOptions
    n_params: int
    n_active: int  # per token: an MoE's top_k of num_experts experts (TransformerLM.num_params(active=True))
    micro_batch: int
    grad_accum: int
    budget: int  # bytes per GPU after the headroom
    modes: list[ModePlan] = field(default_factory=list)

    @property
    def global_tokens(self) -> int:
        return self.micro_batch * self.options.seq_len * self.options.gpus * self.grad_accum

    @property
    def target_micro_batch(self) -> int:
        """The smallest micro-batch whose one step (grad_accum 1) reaches ``--global-batch-tokens``."""
        return max(1, math.ceil(self.options.global_batch_tokens / (self.options.seq_len * self.options.gpus)))


def model_config(opts: PlanOptions) -> ModelConfig:
    preset = ModelConfig.preset(opts.size)
    if opts.seq_len > preset["max_seq_len"]:
        raise ConfigError(f"--seq-len={opts.seq_len} exceeds the {opts.size} preset's max_seq_len="
                          f"{preset['max_seq_len']}")
    return ModelConfig.from_preset(opts.size, placement=placement_value(opts.placement),
                                   fast_kernels=opts.loss != "plain")


def placement_value(text: str) -> str | dict:
    """``--placement`` as ``train --placement`` reads it: a name, or a spec of one's own as a YAML mapping
    (``{name: mine, block: {qkv_norm: QK}}``). A name alone used to be all the planner took, so a placement
    of one's own could not be planned at all (its norm slots change the activations kept per token)."""
    try:
        value = parse_text(text, "yaml")
    except ConfigError:  # not YAML: a name, which the registry refuses if it is none
        return text
    return value if isinstance(value, dict) else text


def meta_model(mc: ModelConfig) -> torch.nn.Module:
    return mc.build("meta")  # shapes only: a 7B model costs nothing


def sharded_numel(model: torch.nn.Module, gpus: int) -> int:
    """Rank 0's FSDP2 share: each parameter split on dim 0 into ceil(rows / gpus) rows (padded)."""
    return sum(math.ceil(p.shape[0] / gpus) * (p.numel() // p.shape[0]) if p.dim() else p.numel()
               for p in model.parameters())


def layer_act_bytes(mc: ModelConfig, compute_bytes: int, layer: int = 0) -> int:
    """Activation bytes per token one block keeps for its backward (the formula of the module docstring)."""
    spec = mc.resolved_placement().blocks(mc.n_layers)[layer]
    c, d, H, Hkv, D, h = compute_bytes, mc.d_model, mc.n_heads, mc.kv_heads, mc.head_dim, mc.ffn_hidden_size
    slots = sum((s.in_norm, s.out_norm, s.post_norm).count(True) for s in (spec.attn, spec.ffn))
    norms = slots * (R * d + 4)
    attn = c * d + 2 * c * (H + 2 * Hkv) * D + 2 * c * H * D + 4 * H
    for letter, heads in (("Q", H), ("K", Hkv), ("V", Hkv), ("C", H)):
        if spec.norms(letter):
            attn += R * heads * D + 4 * heads
    if mc.moe is None:
        ffn = c * d + 4 * c * h
    else:
        ffn = moe_act_bytes(mc, compute_bytes)
    return norms + attn + ffn


def moe_act_bytes(mc: ModelConfig, compute_bytes: int) -> int:
    """Per token, what a block's MoE FFN (:class:`hybridnorm.nn.moe.MoEFFN`) keeps for its backward: the
    router's fp32 input, and for each of the token's k assignments its input row, gate|up, silu(gate) and
    silu·up, and its output row (twice: the scatter's and the gated sum's), plus the routing's own tensors."""
    c, d, E, k = compute_bytes, mc.d_model, mc.moe.num_experts, mc.moe.top_k
    h = mc.moe.expert_hidden_size or mc.ffn_hidden_size
    routing = 2 * 4 * E + 4 + k * (8 + 2 * 8 + 4)  # logits, softmax, logsumexp; top-k ids, sort order x2, gates
    return R * d + k * c * (4 * h + 3 * d) + routing


def loss_kind(mc: ModelConfig, loss: str | None) -> str:
    """``loss`` as given, else what an eager model of ``mc`` runs: "fast" (fused kernel) or "plain"."""
    return loss or ("fast" if mc.fast_kernels else "plain")


def head_act_bytes(mc: ModelConfig, compute_bytes: int, loss: str | None = None) -> int:
    """Per token outside the blocks, kept for the backward: final norm input and statistic, the head's input
    (plain line) or d loss/d hidden (fused head + loss), the ids, and with the plain line the loss's fp32
    log-softmax; compiled, the logits in the compute dtype (inductor recomputes the fp32 softmax from them)."""
    kept = R * mc.d_model + 4 + compute_bytes * mc.d_model + 8
    extra = {"fast": 0, "plain": 4, "compiled": compute_bytes}[loss_kind(mc, loss)]
    return kept + extra * mc.embedding_size


def loss_peak_bytes(mc: ModelConfig, tokens: int, compute_bytes: int,
                    chunk_elements: int = CE_CHUNK_ELEMENTS_GPU, loss: str | None = None) -> int:
    """Bytes live only while the LM head and loss run (on top of everything kept), for ``tokens`` tokens.

    Fused head + loss (``fast_kernels``, :class:`~hybridnorm.nn.kernels.LinearCrossEntropyFn`): one chunk
    of fp32 logits and its gradient in the compute dtype, the fp32 weight-gradient accumulator, one chunk's
    weight-gradient term (compute dtype, when not fp32) and the weight gradient it keeps. Plain line
    (F.linear, an fp32 copy, F.cross_entropy): at the start of the backward the fp32 log-softmax (counted as
    kept), its gradient and the gradient of its input are live together: 8 more bytes per logit. Compiled
    (``compile_head_loss``): the logits' gradient takes the kept logits' buffer (inductor reuses a buffer
    whose last reader is the kernel writing the new one), so only the head's weight gradient in the compute
    dtype: measured on an H200, 550M, 25 x 4096 tokens, its peak was 17.3 GiB above the fused kernel's where
    this counts 16.8."""
    V, d, c = mc.embedding_size, mc.d_model, compute_bytes
    kind = loss_kind(mc, loss)
    if kind == "plain":
        return 8 * tokens * V
    if kind == "compiled":
        return c * V * d
    rows = min(tokens, max(1, chunk_elements // V))
    return rows * V * (4 + c) + 4 * V * d + (c * V * d if c != 4 else 0) + c * V * d


def activation_bytes(mc: ModelConfig, tokens: int, precision: str, checkpointing: bool,
                     loss: str | None = None) -> tuple[int, int]:
    """(bytes the forward keeps for the backward, extra bytes live while one block recomputes) for
    ``tokens`` = micro_batch·seq_len tokens; weight copies and the loss's transient bytes
    (:func:`loss_peak_bytes`) are not included (see :func:`plan`)."""
    c = 2 if precision == "bf16" else 4
    layers = [layer_act_bytes(mc, c, i) for i in range(mc.n_layers)]
    head = head_act_bytes(mc, c, loss)
    inputs = R * mc.d_model  # what a checkpointed block keeps: its input
    if mc.resolved_placement().dual_stream:  # ResiDual: the second stream's norm, and its input in every block
        head += R * mc.d_model + 4
        inputs += R * mc.d_model
    if checkpointing:
        return tokens * (mc.n_layers * inputs + head), tokens * max(layers)
    return tokens * (sum(layers) + head), 0


def weight_copy_bytes(model: torch.nn.Module, precision: str) -> int:
    """The bf16 copies of the matmul weights a DDP bf16 step holds from the forward to the backward: autocast's
    cached casts of the 2-D weights, and the 3-D expert weights an MoE casts itself (grouped_mm is on no autocast
    list), each saved for its backward. Norm gains and biases (1-D) are not cast."""
    return 2 * sum(p.numel() for p in model.parameters() if p.dim() >= 2) if precision == "bf16" else 0


def _largest_fitting(fixed: int, act_of: Callable[[int], int], budget: int, cap: int = 2**20) -> int:
    """The largest micro-batch m <= cap with fixed + act_of(m) <= budget (0: not even one sequence);
    ``act_of`` grows with m (linearly, except the loss's chunk, which stops growing at its row cap)."""
    def fits(m: int) -> bool:
        return fixed + act_of(m) <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, cap + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan(opts: PlanOptions) -> Plan:
    """Bytes per GPU for DDP and FSDP at ``opts``; see the module docstring for what each term counts."""
    mc = model_config(opts)
    model = meta_model(mc)
    n = sum(p.numel() for p in model.parameters())
    n_shard = sharded_numel(model, opts.gpus)
    c = 2 if opts.precision == "bf16" else 4
    T = opts.seq_len
    budget = int(opts.gpu_mem * GIB * (1 - opts.headroom))
    block = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    root = n - sum(block)
    weight_copies = weight_copy_bytes(model, opts.precision)

    states = {
        "ddp": (4 * n, 4 * n, 8 * n, 4 * n + weight_copies),  # + 4·n: DDP's reduction buckets
        # gathered: root + 2 running/prefetched blocks + the never-resharded last one; + 1 block's fp32 grad
        "fsdp": (4 * n_shard, 4 * n_shard, 8 * n_shard,
                 c * (root + 3 * max(block)) + 4 * max(block) + 4 * n),  # 4·n: no_sync's unsharded grads
    }

    def act(tokens: int, ckpt: bool) -> int:  # kept, plus whichever transient is larger: the loss's or a recompute's
        kept, recompute = activation_bytes(mc, tokens, opts.precision, ckpt, opts.loss)
        return kept + max(recompute, loss_peak_bytes(mc, tokens, c, loss=opts.loss))

    # largest micro-batch: states and weight copies are fixed, activations grow linearly per sequence
    # (the search counts no_sync's gradient buffer: conservative whenever grad_accum would come out 1)
    fits = {}
    for mode, (p, g, o, buf) in states.items():
        fixed = p + g + o + buf
        fits[mode] = tuple(_largest_fitting(fixed, lambda m, ck=ck: act(m * T, ck), budget) for ck in (False, True))
    _check_something_fits(opts, fits, {m: sum(s) for m, s in states.items()}, act(T, True), budget)
    # the default: FSDP's largest without recompute, else (only checkpointing fits) the largest with it
    mb = opts.micro_batch or fits["fsdp"][0] or max(f[1] for f in fits.values())
    accum = max(1, math.ceil(opts.global_batch_tokens / (mb * T * opts.gpus)))
    modes = []
    for mode, (p, g, o, buf) in states.items():
        if mode == "fsdp" and accum == 1:
            buf -= 4 * n  # no accumulation, no no_sync buffer
        modes.append(ModePlan(mode, p, g, o, buf, act(mb * T, False), act(mb * T, True), *fits[mode]))
    return Plan(opts, n, model.num_params(active=True), mb, accum, budget, modes)


def _check_something_fits(opts: PlanOptions, fits: dict[str, tuple[int, int]], states: dict[str, int],
                          one_seq_ckpt: int, budget: int) -> None:
    """ConfigError naming the options when not one sequence fits anywhere, or when the given
    ``--micro-batch`` fits in no mode, not even with activation checkpointing."""
    best = max(f[1] for f in fits.values())  # checkpointing never needs more than running without it
    where = ", ".join(f"{m.upper()} {f[0]:,} ({f[1]:,} with checkpointing)" for m, f in fits.items())
    if best == 0:
        need = min(states.values()) + one_seq_ckpt
        raise ConfigError(f"nothing fits: not one sequence of --seq-len={opts.seq_len} fits in "
                          f"--gpu-mem={opts.gpu_mem:g} GiB per GPU ({budget / GIB:.2f} GiB usable after the "
                          f"{opts.headroom:.0%} headroom) under "
                          f"DDP or FSDP, even with activation checkpointing: it needs at least {need / GIB:.2f} GiB "
                          f"usable; raise --gpu-mem, add --gpus or lower --seq-len")
    if opts.micro_batch is not None and opts.micro_batch > best:
        raise ConfigError(f"--micro-batch={opts.micro_batch} does not fit in --gpu-mem={opts.gpu_mem:g} GiB per GPU "
                          f"at --seq-len={opts.seq_len}: the largest micro-batch that fits is {best:,} (largest per "
                          f"mode: {where})")


def _gib(x: int) -> str:
    return f"{x / GIB:.2f}"


def _table(rows: list[list[str]]) -> list[str]:
    """Columns as wide as their widest cell, two spaces apart: numbers of any size never run together."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            for r in rows]


def _gpus(n: int) -> str:
    return f"{n:,} GPU{'s' if n != 1 else ''}"


def _target_note(pl: Plan) -> list[str]:
    """When the default micro-batch (the largest that fits) overshoots ``--global-batch-tokens`` and a smaller
    one would reach it in one step: which to pass. The default stays what fits; the note says how to hit the
    target instead of leaving the user to divide by hand."""
    o, n = pl.options, pl.target_micro_batch
    if o.micro_batch is not None or n >= pl.micro_batch:
        return []
    tokens = n * o.seq_len * o.gpus
    over = "" if n > 1 or tokens <= o.global_batch_tokens else (
        f"; one sequence per GPU already makes {tokens:,}: lower --seq-len or --gpus to come closer")
    return [f"note: the micro-batch above is the largest that fits; for the target pass --micro-batch {n} "
            f"({n:,} x grad_accum 1 x {_gpus(o.gpus)} = {tokens:,} tokens per step; train: --batch_size={n} "
            f"--grad_accum=1){over}"]


def format_plan(pl: Plan) -> str:
    """The plan as a plain-text table, GiB per GPU."""
    o = pl.options
    fits = [f"{m.mode.upper()}{' with checkpointing' if ck else ''}" for ck in (False, True) for m in pl.modes
            if pl.micro_batch <= (m.max_micro_batch_ckpt if ck else m.max_micro_batch)]
    spec = placement_value(o.placement)
    name = spec if isinstance(spec, str) else spec["name"]  # a spec of one's own by its name, not its text
    # an MoE is sized by both: the memory holds every expert, the FLOPs a token costs use its top_k
    active = f" ({pl.n_active:,} active per token)" if pl.n_active != pl.n_params else ""
    lines = [f"{o.size} {name}: {pl.n_params:,} parameters{active}, {_gpus(o.gpus)} x {o.gpu_mem:g} GiB "
             f"({o.headroom:.0%} headroom: {pl.budget / GIB:.2f} GiB usable), seq {o.seq_len:,}, {o.precision}, "
             f"{'fused' if o.loss == 'fast' else o.loss} LM head + loss",
             f"micro-batch {pl.micro_batch:,} x grad_accum {pl.grad_accum:,} x {_gpus(o.gpus)} = {pl.global_tokens:,} "
             f"tokens per step (target {o.global_batch_tokens:,})", *_target_note(pl),
             f"micro-batch {pl.micro_batch:,} fits under: {', '.join(fits)}"]
    rows = [["GiB per GPU", "params", "grads", "AdamW", "buffers", "act", "act+ckpt", "total", "w/ ckpt",
             "max mb", "w/ ckpt"]]
    for m in pl.modes:
        rows.append([m.mode.upper(), *map(_gib, (m.params, m.grads, m.optim, m.buffers, m.act, m.act_ckpt,
                                                  m.states + m.act, m.states + m.act_ckpt)),
                     f"{m.max_micro_batch:,}", f"{m.max_micro_batch_ckpt:,}"])
    lines += _table(rows)
    lines.append("buffers: DDP reduction buckets + autocast bf16 weight copies; FSDP gathered weights, one block's "
                 "unsharded gradient, and no_sync's unsharded gradients when grad_accum > 1. Lower bounds: "
                 "fragmentation and kernels' workspaces are what the headroom is for.")
    return "\n".join(lines)
