"""Model FLOPs per token and the machine's measured matmul peak, for throughput and MFU.

Training FLOPs per token (PaLM appendix B, causal attention counted once):

    6 · N_matmul  +  6 · L · d · T

N_matmul is every weight that takes part in a matmul for a token: all block weights (for MoE only the
top-k experts' share) plus the LM head (a tied head still multiplies), but not the embedding lookup. The
attention term is QKᵀ and AV: 2 matmuls × 2 FLOPs × (T/2 keys on average under the causal mask) × d,
times 3 for forward + backward (here d = n_heads · head_dim: d_model unless ``attn_head_dim`` is set).
MFU = achieved FLOP/s ÷ a peak. On a GPU whose datasheet we know (:data:`DATASHEET_PEAK_BF16`) and a bf16 run,
the peak is the datasheet's dense bf16 number, as MFU is reported in the field (PaLM, OLMo-core,
torchtitan): a timed matmul reaches well under it on a GPU (a 2048³ bf16 matmul on an H200 made a
trainer run read 80 % "MFU" that is 35 % of the datasheet). Elsewhere (CPUs, fp32, unknown GPUs) the peak is
measured here with a large matmul in the run's precision, not a datasheet number. So that two runs' MFU
compare (one peak measured per run varied by 2× on a loaded machine), the peak is measured per machine,
device, dtype and thread count, as the median of several best-of rounds, and cached in a small JSON file
(``$HYBRIDNORM_PEAK_CACHE``, default ``~/.cache/hybridnorm/matmul_peak.json``). The first
:data:`PEAK_SAMPLES` runs on a machine each add one measurement and the peak is the largest kept; later runs
measure nothing and share it. One sample taken while the machine was busy would otherwise stay the
machine's peak for good (found: 117 GFLOP/s cached on a Xeon that multiplies at 160-320, so every later run
logged about twice its MFU). The trainer records the peak it used in the run's ``meta``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from hybridnorm import plain_data


def matmul_params(model: nn.Module) -> int:
    cfg = model.config
    n = model.num_params(active=True, exclude_embeddings=True)
    return n + cfg.embedding_size * cfg.d_model  # the head's matmul (tied or not)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    cfg = model.config
    return 6.0 * matmul_params(model) + 6.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, FLOP/s, matched in this order
# against torch.cuda.get_device_name ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA GH200 480GB", ...).
DATASHEET_PEAK_BF16 = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12),
                       ("H800", 989e12), ("A100", 312e12))


def datasheet_peak(device_name: str, dtype: torch.dtype) -> tuple[float, str] | None:
    """(dense bf16 datasheet FLOP/s, where it comes from) for a known GPU name and a bf16 run, else None."""
    if dtype != torch.bfloat16:
        return None
    for key, peak in DATASHEET_PEAK_BF16:
        if key in device_name:
            return peak, f"datasheet dense bf16 of {device_name}"
    return None


def gpu_datasheet_peak(device: torch.device | str, dtype: torch.dtype) -> tuple[float, str] | None:
    """:func:`datasheet_peak` of a CUDA ``device``; None on any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return datasheet_peak(torch.cuda.get_device_name(device), dtype)


def cpu_or_measured_peak(device: torch.device, dtype: torch.dtype,
                         measure: Callable[[str, torch.dtype, int], float] | None = None) -> tuple[float, str]:
    """The matmul peak MFU is counted against where no datasheet gives it (``measure``: default
    :func:`measured_peak_flops`): a timed matmul in the run's dtype, or in fp32 where that is faster: a CPU
    without native bf16 computes bf16 through fp32, so fp32's rate is its ceiling (counted against the bf16
    path alone, ~1 GFLOP/s on an AVX2-only CPU, a compiled bf16 step read 250% MFU)."""
    measure = measure or measured_peak_flops
    n = 8192 if device.type == "cuda" else 2048
    peak = measure(str(device), dtype, n)
    if device.type == "cpu" and dtype != torch.float32:
        fp32 = measure(str(device), torch.float32, n)
        if fp32 > peak:
            return fp32, "measured matmul in fp32, faster on this CPU than in bf16, which it has no native unit for"
    return peak, "measured matmul"


PROBE_START, PROBE_SECONDS = 256, 0.1  # matmul_flops: the first size, and a product long enough to time


def matmul_flops(device: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 2048, reps: int = 5,
                 rounds: int = 3) -> float:
    """FLOP/s of an n×n @ n×n matmul on ``device`` in ``dtype``: the median over ``rounds`` of the best of
    ``reps`` (the best drops one-off stalls, the median one lucky or loaded round).

    The size grows from 256, doubling, to ``n``, and stops early at one whose product alone takes 0.1 s: a
    path that slow is measured there. Found on a CPU without native bf16 (AVX2 only), whose bf16 matmul runs
    at ~1 GFLOP/s: 16 products of 2048² took ~5 minutes before a bf16 run's first step; at 512 they take ~3 s.
    A fast path (any GPU, fp32 or native bf16 on a CPU) reaches ``n`` as before."""
    sync = (lambda: torch.cuda.synchronize(device)) if str(device).startswith("cuda") else (lambda: None)
    size = min(n, PROBE_START)
    while True:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        a @ b  # warm-up: thread pools, kernels
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        if size >= n or time.perf_counter() - t0 >= PROBE_SECONDS:
            break
        size = min(n, 2 * size)
    bests = []
    for _ in range(rounds):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            sync()
            best = min(best, time.perf_counter() - t0)
        bests.append(best)
    return 2.0 * size**3 / statistics.median(bests)


def peak_cache_path() -> Path:
    return Path(os.environ.get("HYBRIDNORM_PEAK_CACHE") or Path.home() / ".cache" / "hybridnorm" / "matmul_peak.json")


def machine_key(device: str, dtype: torch.dtype, n: int = 2048) -> str:
    """What the peak depends on: the device model, the dtype, the CPU threads torch uses, torch's version
    and the matmul size."""
    if str(device).startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = platform.processor() or platform.machine()
        cpuinfo = Path("/proc/cpuinfo")
        if cpuinfo.is_file():
            model = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text(errors="replace").splitlines()
                     if ln.startswith("model name")]
            name = model[0] if model else name
    return f"{name}|{dtype}|threads={torch.get_num_threads()}|torch={torch.__version__}|n={n}"


PEAK_SAMPLES = 3  # measurements kept per machine key; the peak is their maximum


def cached_samples(cache: dict, key: str) -> list[float]:
    """The measurements ``cache`` (the parsed file) holds for ``key``: a list of positive numbers, or one
    number as earlier releases stored it; anything else counts as none."""
    value = cache.get(key)
    values = value if isinstance(value, list) else [value]
    return [float(v) for v in values
            if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf]  # json reads Infinity


@functools.lru_cache(maxsize=8)
def measured_peak_flops(device: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 2048) -> float:
    """The machine's n×n matmul peak for ``device``/``dtype``: the largest of the measurements in the
    per-machine cache; while it holds fewer than :data:`PEAK_SAMPLES`, this process measures once more
    (:func:`matmul_flops`) and adds its sample. A cache that cannot be read or written is measured past."""
    path, key = peak_cache_path(), machine_key(device, dtype, n)
    try:
        cache = plain_data.loads(path.read_bytes()) if path.is_file() else {}
    except (OSError, ValueError):  # the one JSON reader: bad bytes or nesting are ValueErrors
        cache = {}
    if not isinstance(cache, dict):  # a file of another shape is rewritten as a fresh cache
        cache = {}
    samples = cached_samples(cache, key)
    if len(samples) >= PEAK_SAMPLES:
        return max(samples)
    samples.append(matmul_flops(device, dtype, n))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**cache, key: samples}, indent=1))
        tmp.replace(path)  # atomic: parallel runs never read half a file
    except OSError:
        pass
    return max(samples)
