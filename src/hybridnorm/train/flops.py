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
compare (one peak measured per run varied by 2× on a loaded machine), the peak is measured once per machine,
device, dtype and thread count, as the median of several best-of rounds, and cached in a small JSON file
(``$HYBRIDNORM_PEAK_CACHE``, default ``~/.cache/hybridnorm/matmul_peak.json``); the trainer records the
peak it used in the run's ``meta``.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time
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


def matmul_flops(device: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 2048, reps: int = 5,
                 rounds: int = 3) -> float:
    """FLOP/s of an n×n @ n×n matmul on ``device`` in ``dtype``: the median over ``rounds`` of the best of
    ``reps`` (the best drops one-off stalls, the median one lucky or loaded round)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if str(device).startswith("cuda") else (lambda: None)
    a @ b  # warm-up: thread pools, kernels
    sync()
    bests = []
    for _ in range(rounds):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            sync()
            best = min(best, time.perf_counter() - t0)
        bests.append(best)
    return 2.0 * n**3 / statistics.median(bests)


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


@functools.lru_cache(maxsize=8)
def measured_peak_flops(device: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 2048) -> float:
    """The machine's n×n matmul peak for ``device``/``dtype``: read from the per-machine cache, else measured
    once (:func:`matmul_flops`) and stored there. A cache that cannot be read or written is measured past."""
    path, key = peak_cache_path(), machine_key(device, dtype, n)
    try:
        cache = plain_data.loads(path.read_bytes()) if path.is_file() else {}
    except (OSError, ValueError):  # the one JSON reader: bad bytes or nesting are ValueErrors
        cache = {}
    if isinstance(cache, dict) and isinstance(cache.get(key), (int, float)) and cache[key] > 0:
        return float(cache[key])
    peak = matmul_flops(device, dtype, n)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**(cache if isinstance(cache, dict) else {}), key: peak}, indent=1))
        tmp.replace(path)  # atomic: parallel runs never read half a file
    except OSError:
        pass
    return peak
