#!/usr/bin/env python
"""Time one full training step of hybridnorm models against a stock HF Llama of identical size.

A training step is: forward -> cross-entropy in fp32 -> backward -> AdamW step -> zero_grad. The loss of our
models is the trainer's, ``model(ids, targets=...)`` (on CPU the LM head fused with the loss, no logits
tensor); HF's is ``hn.lm_loss`` of its logits (our chunked cross-entropy: faster than its stock loss).
``--loss logits`` gives every model ``hn.lm_loss`` of its logits, so the ratio measures the models alone.

Compared, in ONE run and with the models INTERLEAVED step by step after warmup (round r runs each model
once, the order rotated by r: A B C, B C A, C A B, ...; the median step time of each is reported):

  (a) our ``placement="pre"`` model  vs  ``transformers.LlamaForCausalLM`` built locally from a LlamaConfig
      of identical size (d, layers, heads, KV heads, intermediate size, vocab, tied embeddings, RMSNorm eps,
      RoPE theta, no biases, ``attn_implementation="sdpa"``). The parameter counts are checked equal, and
      our weights are copied into the HF model and the logits compared (they must agree).
  (b) our ``placement="hybridnorm"`` (or ``--hybrid-placement``)  vs  our ``pre``.

each in fp32 and under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (fp32 master weights). A big
fp32 and bf16 ``torch.mm`` is timed in the same run as the peak to compute MFU against.

Ratios: ``HF / pre`` >= 1.0 means ours is at least as fast; ``hybridnorm / pre`` - 1 is the overhead of
the HybridNorm placement. Nothing is asserted: this script only prints.

    python benchmarks/train_step.py                   # defaults: see --help
    python benchmarks/train_step.py --reps 20 --dtypes bf16
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import statistics
import time
from collections.abc import Callable

import torch

import hybridnorm as hn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", choices=tuple(SHAPES), default="d512",
                   help="preset of the size options below (an option given explicitly wins): d512 = d 512, "
                        "4 layers, B4 x T256; studies = the docs/results studies' 24 layers, d 64, B8 x T128")
    # the size options default to None: the --shape preset fills in every one not given
    p.add_argument("--d-model", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--ffn", type=int, help="SwiGLU hidden (HF intermediate_size)")
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--rope-theta", type=float, default=500_000.0)
    p.add_argument("--reps", type=int, default=30, help="timed steps per model (after warmup)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps per model first")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16 (bf16 = autocast)")
    p.add_argument("--hybrid-placement", default="hybridnorm", help="placement compared against pre in (b)")
    p.add_argument("--adamw", choices=("default", "foreach", "fused"), default="fused",
                   help="AdamW implementation (the same for every model; fused is what the trainer runs on CPU)")
    p.add_argument("--loss", choices=("trainer", "logits"), default="trainer",
                   help="our models' loss: the trainer's model(ids, targets=...) (head fused with the loss on "
                        "CPU), or hn.lm_loss of the logits like HF's (the models alone)")
    p.add_argument("--peak-n", type=int, default=2048, help="size of the square torch.mm for peak GFLOP/s")
    p.add_argument("--malloc", choices=("retain", "system"), default="retain",
                   help="retain: glibc mallopt so freed memory is kept and reused (no mmap, no trim), as "
                        "jemalloc/tcmalloc would; system: the default glibc behaviour, which returns big "
                        "blocks to the OS so every step page-faults its activations in again")
    p.add_argument("--no-hf", action="store_true", help="skip the HF Llama model (only (b))")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, torch.profiler one step of each model per dtype and print its top-N ops "
                        "by self CPU time (0: off)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# the two shapes of benchmarks/README.md (the goals are stated for both)
SHAPES = {
    "d512": dict(d_model=512, layers=4, heads=8, kv_heads=4, ffn=1376, vocab=8192, seq=256, batch=4),
    "studies": dict(d_model=64, layers=24, heads=4, kv_heads=2, ffn=344, vocab=8192, seq=128, batch=8),
}


# -- models ----------------------------------------------------------------------------------------

def our_config(args: argparse.Namespace, placement: str) -> hn.ModelConfig:
    return hn.ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                          n_heads=args.heads, n_kv_heads=args.kv_heads, ffn_hidden_size=args.ffn,
                          max_seq_len=args.seq, rope_theta=args.rope_theta, tie_embeddings=True,
                          placement=placement, norm="rms", norm_eps=1e-5)


def build_hf(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.d_model // args.heads, max_position_embeddings=args.seq, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        hidden_act="silu", use_cache=False, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg)
    impl = model.config._attn_implementation
    if impl != "sdpa":
        print(f"WARNING: HF attention implementation is {impl!r}, not 'sdpa'")
    return model


@torch.no_grad()
def copy_ours_into_hf(ours: hn.TransformerLM, hf: torch.nn.Module) -> None:
    """Load our pre-norm weights into the HF Llama (the layouts differ only by our fused matrices)."""
    c = ours.config
    H, Hkv, D = c.n_heads, c.kv_heads, c.head_dim
    hf.model.embed_tokens.weight.copy_(ours.embed.weight[: c.vocab_size])
    for blk, layer in zip(ours.blocks, hf.model.layers, strict=True):
        q, k, v = blk.attn.w_qkv.weight.split((H * D, Hkv * D, Hkv * D))
        layer.self_attn.q_proj.weight.copy_(q)
        layer.self_attn.k_proj.weight.copy_(k)
        layer.self_attn.v_proj.weight.copy_(v)
        layer.self_attn.o_proj.weight.copy_(blk.attn.w_o.weight)
        gate, up = blk.ffn.w_in.weight.chunk(2)
        layer.mlp.gate_proj.weight.copy_(gate)
        layer.mlp.up_proj.weight.copy_(up)
        layer.mlp.down_proj.weight.copy_(blk.ffn.w_out.weight)
        layer.input_layernorm.weight.copy_(blk.attn_norm.weight)
        layer.post_attention_layernorm.weight.copy_(blk.ffn_norm.weight)
    hf.model.norm.weight.copy_(ours.final_norm.weight)


def hf_forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


def our_forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids)


def hf_loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return hn.lm_loss(hf_forward(model, ids), targets)


def our_logits_loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return hn.lm_loss(our_forward(model, ids), targets)


def our_trainer_loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(ids, targets=targets)  # the trainer's call: on CPU the head fused with the loss


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are one Parameter: counted once


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in a matmul: every >= 2-D weight (the tied embedding counted once, as
    the LM head). Norm gains (1-D) are left out of N."""
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2)


def model_flops_per_step(args: argparse.Namespace, n_matmul: int) -> float:
    # Model FLOPs of one training step (PaLM, arXiv 2204.02311 App. B; the usual MFU convention):
    #     6 * N * tokens                       N = matmul parameters (tied embedding counted once);
    #                                          2 (fwd) + 4 (bwd) FLOPs per parameter per token
    #   + 12 * L * (H * D_h) * T * tokens      attention scores QK^T and A.V: 2 * 2 * T * H * D_h FLOPs per
    #                                          token per layer forward, x3 for fwd + bwd; counted over the
    #                                          full T x T square (no causal halving), as the convention does
    # with tokens = batch * seq and T = seq. Norms, RoPE, softmax, SiLU and the optimizer are not counted.
    tokens = args.batch * args.seq
    d_attn = args.heads * (args.d_model // args.heads)
    return 6.0 * n_matmul * tokens + 12.0 * args.layers * d_attn * args.seq * tokens


def retain_malloc() -> str:
    """Make glibc keep freed memory (M_MMAP_MAX=0: no per-block mmap; M_TRIM_THRESHOLD=2 GiB: no trim),
    so the activations of step n+1 reuse the pages of step n instead of faulting fresh ones in. On a VM
    a page fault can cost ~10 us per 4 KiB page, which otherwise swamps the arithmetic."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        ok = libc.mallopt(m_mmap_max, 0) == 1 and libc.mallopt(m_trim_threshold, 2**31 - 1) == 1
    except (OSError, AttributeError):
        ok = False
    return "retain (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2GiB)" if ok else "system (mallopt unavailable)"


# -- timing ----------------------------------------------------------------------------------------

def autocast_ctx(dtype: str, device_type: str = "cpu") -> contextlib.AbstractContextManager:
    if dtype == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_optimizer(model: torch.nn.Module, impl: str) -> torch.optim.Optimizer:
    kw = {"foreach": True} if impl == "foreach" else {"fused": True} if impl == "fused" else {}
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **kw)


def make_step(model: torch.nn.Module, loss_of: Callable, opt: torch.optim.Optimizer, ids: torch.Tensor,
              targets: torch.Tensor, dtype: str) -> Callable[[], tuple[float, float]]:
    """One training step; returns (wall seconds, process CPU seconds). ``loss_of(model, ids, targets)``. On
    CUDA the step ends with a device sync, so that the wall time covers the kernels it queued."""
    def step() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        with autocast_ctx(dtype, ids.device.type):
            loss = loss_of(model, ids, targets)  # fp32
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, time.process_time() - c0
    return step


def time_alternating(steps: dict[str, Callable[[], tuple[float, float]]], warmup: int,
                     reps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Interleave the models step by step: round r runs every model once, the order rotated by r
    (A B C, B C A, C A B, ...) so that no model always follows the same one. Returns wall and CPU
    times per model."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(reps):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                w, c = steps[name]()
                wall[name].append(w)
                cpu[name].append(c)
    finally:
        gc.enable()
    return wall, cpu


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a_i / b_i (robust to slow phases of a noisy machine)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def profile_steps(steps: dict[str, Callable[[], tuple[float, float]]], top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        print(f"\n  profile of one {name} step (self CPU time, ms):")
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]:
            print(f"    {e.self_cpu_time_total / 1e3:9.2f}  {e.count:5d}x  {e.key}")


def peak_matmul(n: int, dtype: torch.dtype, reps: int = 10) -> float:
    """GFLOP/s of an n x n x n torch.mm: the best of ``reps`` (a peak, so the fastest repetition)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    for _ in range(2):
        torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best / 1e9


# -- main ------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    malloc = retain_malloc() if args.malloc == "retain" else "system"
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in ("fp32", "bf16"):
            raise SystemExit(f"--dtypes: unknown {d!r} (fp32, bf16)")

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {platform.processor() or platform.machine()}")
    print(f"model: d={args.d_model} L={args.layers} H={args.heads} Hkv={args.kv_heads} ffn={args.ffn} "
          f"V={args.vocab} | batch {args.batch} x seq {args.seq} = {args.batch * args.seq} tokens | "
          f"AdamW {args.adamw} | our loss {args.loss} | malloc {malloc}")

    pre = hn.TransformerLM(our_config(args, "pre"))
    hyb = hn.TransformerLM(our_config(args, args.hybrid_placement))
    models: dict[str, tuple[torch.nn.Module, Callable]] = {}
    if not args.no_hf:
        import transformers

        hf = build_hf(args)
        n_hf, n_pre = num_params(hf), num_params(pre)
        same = "EQUAL" if n_hf == n_pre else "DIFFERENT (!)"
        print(f"transformers {transformers.__version__}: LlamaForCausalLM attn_implementation="
              f"{hf.config._attn_implementation!r}")
        print(f"parameter counts: HF Llama {n_hf:,}  ours(pre) {n_pre:,}  -> {same}")
        copy_ours_into_hf(pre, hf)
        ids = torch.randint(0, args.vocab, (2, min(args.seq, 64)))
        with torch.no_grad():
            diff = (hf_forward(hf, ids) - our_forward(pre, ids)).abs().max().item()
        print(f"same weights -> max |logits_HF - logits_pre| = {diff:.2e} (fp32; should be ~1e-5 or less)")
        models["hf_llama"] = (hf, hf_loss)
    ours = our_trainer_loss if args.loss == "trainer" else our_logits_loss
    models["pre"] = (pre, ours)
    models[args.hybrid_placement] = (hyb, ours)
    print(f"parameter count {args.hybrid_placement}: {num_params(hyb):,}")

    n_matmul = matmul_params(pre)
    flops = model_flops_per_step(args, n_matmul)
    print(f"model FLOPs/step = 6*N*tokens + 12*L*d*T*tokens = {flops / 1e9:.1f} GFLOP (N = {n_matmul:,})")

    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    targets = torch.roll(ids, -1, dims=1)

    peak_dt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    peaks = {d: peak_matmul(args.peak_n, peak_dt[d]) for d in dtypes}

    results: dict[str, dict[str, float]] = {}
    hb = args.hybrid_placement
    for dtype in dtypes:
        steps = {}
        for name, (model, fwd) in models.items():
            model.train()
            steps[name] = make_step(model, fwd, make_optimizer(model, args.adamw), ids, targets, dtype)
        wall, cpu = time_alternating(steps, args.warmup, args.reps)
        med = {name: statistics.median(t) for name, t in wall.items()}
        results[dtype] = med
        print(f"\n[{dtype}{' autocast' if dtype == 'bf16' else ''}] {args.reps} interleaved steps per model "
              f"after {args.warmup} warmup; per-step wall times (s):")
        for name, t in wall.items():
            print(f"  {name:>16}: median {med[name]:.4f}  min {min(t):.4f}  max {max(t):.4f}  "
                  f"cpu median {statistics.median(cpu[name]):.4f} | {' '.join(f'{x:.3f}' for x in t)}")
        pairs = ([("hf_llama", "pre", "HF/pre")] if "hf_llama" in med else []) + [(hb, "pre", f"{hb}/pre")]
        for a, b, label in pairs:
            print(f"  {label} = {med[a] / med[b]:.3f}  (median of per-round ratios: wall "
                  f"{paired_ratio(wall[a], wall[b]):.3f}, cpu {paired_ratio(cpu[a], cpu[b]):.3f})")
        # Rounds in which no model was slowed down by other load: every step within 20 % of its model's min.
        quiet = [r for r in range(args.reps) if all(wall[n][r] <= 1.2 * min(wall[n]) for n in wall)]
        if quiet and len(quiet) < args.reps:
            qmed = {n: statistics.median(wall[n][r] for r in quiet) for n in wall}
            print(f"  quiet rounds only ({len(quiet)}/{args.reps}: every step <= 1.2x its model's min): "
                  + ", ".join(f"{label} = {qmed[a] / qmed[b]:.3f}" for a, b, label in pairs))
        if args.profile:
            profile_steps(steps, args.profile)
        # refresh the peak after the models ran (the machine is noisy): keep the best of the two
        peaks[dtype] = max(peaks[dtype], peak_matmul(args.peak_n, peak_dt[dtype]))

    # -- final table --
    print(f"\npeak torch.mm {args.peak_n}^3 (best of 10, before/after the models): "
          + ", ".join(f"{d} {peaks[d]:.1f} GFLOP/s" for d in dtypes))
    names = list(models)
    print(f"\n{'dtype':<6}{'model':>18}{'step s':>9}{'GFLOP/s':>9}{'MFU':>7}{'HF/x':>8}{'x/pre':>8}")
    for dtype in dtypes:
        med = results[dtype]
        for name in names:
            gfs = flops / med[name] / 1e9
            hf_ratio = f"{med['hf_llama'] / med[name]:.3f}" if "hf_llama" in med else "-"
            print(f"{dtype:<6}{name:>18}{med[name]:>9.4f}{gfs:>9.1f}{gfs / peaks[dtype]:>7.1%}"
                  f"{hf_ratio:>8}{med[name] / med['pre']:>8.3f}")
    print("HF/x >= 1: x is at least as fast as HF Llama; x/pre - 1: overhead of x over our pre-norm model.")


if __name__ == "__main__":
    main()
