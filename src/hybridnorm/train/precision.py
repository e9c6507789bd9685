"""``precision="auto"``: bf16 autocast only where it makes a training step faster on this device.

The rule is fixed, not timed at start-up, so two runs of one config on one machine always train in the same
precision (a grid whose points picked different precisions from a noisy probe would not compare like with
like). It rests on these measurements of ``benchmarks/train_step.py`` (interleaved steps, our Pre-Norm):

=======================================  ==================  ==================  ===============
CPU                                      d=64, 24 layers     d=256, 6 layers     d=512, 4 layers
=======================================  ==================  ==================  ===============
AMX-BF16 (2 cores, Xeon, 2026-12-01)     bf16 1.26x slower   bf16 1.31x faster   bf16 2.4x faster
AVX512-BF16, no AMX (2 cores, EPYC)      bf16 1.26x slower   bf16 1.39x faster   bf16 1.69x faster
=======================================  ==================  ==================  ===============

* CUDA: bf16 where the GPU supports it (tensor cores), else fp32.
* CPU: bf16 where the CPU multiplies bf16 natively (AMX or AVX512-BF16) and ``d_model >= 256``: below that
  the step is made of many small kernels whose cost autocast's casts only add to; without native bf16 the
  bf16 matmuls are emulated and slower than fp32.
* Anything else (MPS, other CPUs): fp32.

The chosen precision is written to the run's config.yaml and printed with its reason.
"""

from __future__ import annotations

import torch

BF16_MIN_D_MODEL_CPU = 256  # see the table above


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AMX tiles or AVX512-BF16)."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # torch.cpu's own probes (cpuinfo)
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def choose_precision(requested: str, device: torch.device, d_model: int) -> tuple[str, str]:
    """The precision to train in, ``"fp32"`` or ``"bf16"``, and why (one short clause for the log).

    ``requested`` other than ``"auto"`` is kept as it is."""
    if requested == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        return "bf16", ("as configured; this CPU has no native bf16 (AMX or AVX512-BF16), so its bf16 matmuls are "
                        "emulated, many times slower than fp32 (--precision=auto picks fp32 here)")
    if requested != "auto":
        return requested, "as configured"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16", f"auto: {torch.cuda.get_device_name(device)} has bf16 tensor cores"
        return "fp32", "auto: this GPU has no native bf16"
    if device.type == "cpu":
        if not cpu_has_native_bf16():
            return "fp32", "auto: this CPU has no native bf16 (AMX or AVX512-BF16), so bf16 matmuls are emulated"
        if d_model < BF16_MIN_D_MODEL_CPU:
            return "fp32", (f"auto: d_model={d_model} < {BF16_MIN_D_MODEL_CPU}: at this width the casts cost more "
                            "than bf16 matmuls save on CPU")
        return "bf16", f"auto: the CPU has native bf16 and d_model={d_model} >= {BF16_MIN_D_MODEL_CPU}"
    return "fp32", f"auto: fp32 on {device.type}"
