"""Float8 training of the blocks' linears: ``torch._scaled_mm`` with dynamic per-tensor scales.

The recipe is the common tensorwise one (torchao's ``Float8Linear`` default, Transformer Engine's delayed
scaling without the history): each operand of each matmul is scaled by ``max_finite / amax`` of that very
tensor and cast, the product is taken on float8 tensor cores with the inverse scales, and the output comes
back in the autocast dtype. Activations and weights use E4M3 (more mantissa), the output gradient E5M2 (more
range)::

    y  = q4(x) q4(W)ᵀ          (forward, fp32 accumulation, bf16 out)
    dx = q5(dy) q4(W)          dW = q5(dy)ᵀ q4(x)

where ``q(t) = fp8(t · s) / s`` with ``s = max_finite / max|t|`` (fp32). Its plain twin is those lines
written out in ``tests/nn/test_float8.py``: the quantization by hand, the three products in float64. Against
bf16 ``F.linear`` it differs by float8's rounding (3 mantissa bits), which is why it is an opt-in speed trade
(``TrainConfig.float8``), used only for the blocks' four big linears and never for the LM head, the router
or the norms. An element of ``t · s`` that sits exactly on a rounding tie between two float8 values may
round either way when ``s`` is one fp32 ulp off (eager and compiled code divide differently); that is
within the recipe's own precision.

``torch._scaled_mm`` wants the first operand row-major, the second column-major, and every dimension a
multiple of 16 on CUDA; :func:`float8_linear` lays the operands out so and falls back to ``F.linear`` for a
shape it cannot take. On the CPU the same op runs (oneDNN or an emulation), so every path here is tested
without a GPU; it pays only on tensor cores with float8 (compute capability 8.9+: H100, L4, ...).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale (its float8 image is zeros either way)
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada and Hopper


def float8_unsupported(precision: str, device: torch.device) -> str | None:
    """Why float8 training cannot run here (None when it can): it needs bf16 autocast, and on CUDA float8
    tensor cores. On the CPU it runs (slowly: for tests and smoke runs)."""
    if precision != "bf16":
        return f"it needs precision='bf16' (bf16 autocast), but this run trains in {precision}"
    if device.type == "cuda" and (capability := torch.cuda.get_device_capability(device)) < MIN_CAPABILITY:
        major, minor = capability
        return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no float8 tensor "
                f"cores: they need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, Hopper)")
    if device.type not in ("cuda", "cpu"):
        return f"torch._scaled_mm is not available on {device.type}"
    if device.type == "cpu" and not _cpu_scaled_mm_runs():
        return f"this torch ({torch.__version__}) has no CPU kernel for torch._scaled_mm (newer releases have one)"
    return None


@functools.cache
def _cpu_scaled_mm_runs() -> bool:
    """Whether torch._scaled_mm runs on the CPU in this torch (it has no CPU kernel in older releases)."""
    a, one = torch.zeros(16, 16, dtype=E4M3), torch.ones((), dtype=torch.float32)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (NotImplementedError, RuntimeError):
        return False
    return True


def to_float8(t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``t`` scaled into ``dtype``'s range and cast, and the fp32 scalar that undoes the scale:
    ``t ≈ q.float() * inv``. Computed on the device (no host sync)."""
    amax = t.detach().abs().amax().float().clamp(min=AMAX_FLOOR)
    fmax = torch.finfo(dtype).max
    scale = fmax / amax
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q, scale.reciprocal()


def _col_major(t: Tensor) -> Tensor:
    """The same matrix stored column by column (what ``_scaled_mm`` wants for its second operand)."""
    return t.t().contiguous().t()


def fits(x: Tensor, weight: Tensor) -> bool:
    """Whether ``x (..., K) @ weight (N, K)ᵀ`` has the shapes ``_scaled_mm`` takes: M, K, N multiples of 16."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return m > 0 and all(n % 16 == 0 for n in (m, *weight.shape))


def _scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
               fast_accum: bool = False) -> Tensor:
    """``torch._scaled_mm`` with autocast off: the dtypes are the recipe's, and on the CPU autocast would
    let oneDNN run the fp32 parts of the product in bf16 (measured on an AMD EPYC with AVX512-BF16: errors
    up to 0.3 % of max|y|, 2x the element itself near zero; 1e-6 with autocast off)."""
    with torch.autocast(a.device.type, enabled=False):
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)


class Float8LinearFn(torch.autograd.Function):
    """``x @ weight.T`` with both operands in E4M3, the output gradient in E5M2 (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, out_dtype: torch.dtype) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        xq, x_inv = to_float8(x2, E4M3)
        wq, w_inv = to_float8(weight, E4M3)  # (N, K)
        y = _scaled_mm(xq, wq.t(), x_inv, w_inv, out_dtype, fast_accum=True)  # (M, N); wq.t() is column-major
        ctx.save_for_backward(xq, x_inv, wq, w_inv)
        ctx.x_dtype, ctx.w_dtype, ctx.x_shape = x.dtype, weight.dtype, x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        gq, g_inv = to_float8(dy.reshape(-1, dy.shape[-1]), E5M2)  # (M, N)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # (M, N) @ (N, K)
            dx = _scaled_mm(gq, _col_major(wq), g_inv, w_inv, ctx.x_dtype)
            dx = dx.view(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # (N, M) @ (M, K)
            dw = _scaled_mm(gq.t().contiguous(), _col_major(xq), g_inv, x_inv, ctx.w_dtype)
        return dx, dw, None


def float8_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``F.linear(x, weight)`` (no bias) through float8 where the shapes allow (:func:`fits`), else
    ``F.linear`` itself. The output is in the autocast dtype when autocast is on, else in ``x``'s."""
    if not fits(x, weight):
        return F.linear(x, weight)
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    return Float8LinearFn.apply(x, weight, out_dtype)


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` without bias whose matmul runs in float8 (same parameter, same state-dict name)."""

    def forward(self, x: Tensor) -> Tensor:
        return float8_linear(x, self.weight)


BLOCK_LINEARS = ("attn.w_qkv", "attn.w_o", "ffn.w_in", "ffn.w_out")


def convert_to_float8(model: nn.Module) -> list[str]:
    """Make each block's attention and dense FFN linears :class:`Float8Linear` in place, keeping the
    module and parameter objects (an optimizer or FSDP built before or after sees the same ones) and the
    state-dict names. The LM head, embeddings, norms and a MoE's router and experts stay as they are. Returns the
    names of the swapped modules."""
    swapped = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or module.bias is not None:
            continue
        if not any(name.endswith(f".{suffix}") for suffix in BLOCK_LINEARS) or not name.startswith("blocks."):
            continue
        module.__class__ = Float8Linear  # it adds no state: the same object, parameter, hooks and flags
        swapped.append(name)
    return swapped
