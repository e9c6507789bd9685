"""Weights checked against what the config implies before any of them is used: dtype, shape, finiteness.

A safetensors header is the file's own claim about its bytes, and nothing else vouches for it: a header
that says ``I32`` over float32 bytes is read without complaint and, converted to float, gives embeddings
around 1e9 and garbage text. Shapes are checked by the loaders (a mismatch names the tensor); this module
adds the rest, for every loader of weights from disk (Hugging Face folders, run checkpoints):

- :func:`check_header_dtypes`: every tensor of a file is a floating dtype (no model here has integer or
  boolean weights) and, where the config names one, that dtype; read from the header alone;
- :func:`check_finite`: every floating tensor is finite (a NaN or inf weight poisons every output).

Each refusal is one ConfigError naming the file and the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from hybridnorm.errors import ConfigError

FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
TORCH_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
# what a model may be cast to by name (export --dtype, eval --dtype / lm-eval's dtype model_arg)
CAST_DTYPES = {name: FLOAT_DTYPES[TORCH_NAMES[name]] for name in ("float32", "bfloat16", "float16")}


def header_dtypes(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (safetensors dtype, shape) of ``file`` from its header; ConfigError naming it if unreadable."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"{file} cannot be read as safetensors: {' '.join(str(e).split())}"[:400]) from None


def expected_dtype(name: str | None, where: str) -> str | None:
    """The safetensors dtype a config's ``dtype``/``torch_dtype`` names ("bfloat16" -> "BF16"), or None."""
    if name is None:
        return None
    name = str(name).removeprefix("torch.")
    if name not in TORCH_NAMES:
        raise ConfigError(f"{where}: dtype={name!r} is not one of {', '.join(TORCH_NAMES)}")
    return TORCH_NAMES[name]


def check_header_dtypes(files: Iterable[Path], expected: str | None = None) -> None:
    """Every tensor in the safetensors ``files`` has a floating dtype, and ``expected`` (e.g. "F32") if given."""
    for file in files:
        for key, (dtype, _shape) in sorted(header_dtypes(file).items()):
            if dtype not in FLOAT_DTYPES:
                raise ConfigError(f"{file}: tensor {key!r} is stored as {dtype}, but every weight of the model is "
                                  f"floating point ({', '.join(FLOAT_DTYPES)}): refused, the file is not this model")
            if expected is not None and dtype != expected:
                raise ConfigError(f"{file}: tensor {key!r} is stored as {dtype}, but the config implies {expected}")


def check_finite(tensors: Iterable[tuple[str, Tensor]], where: str) -> None:
    """Every floating tensor is finite; ConfigError naming ``where`` (the file) and the first bad tensor."""
    for key, t in tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ConfigError(f"{where}: tensor {key!r} holds {bad:,} non-finite values (NaN or inf): refused")


def check_file_finite(file: Path) -> None:
    """:func:`check_finite` over a safetensors file, one tensor in memory at a time."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            check_finite(((k, f.get_tensor(k)) for k in f.keys()), str(file))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ConfigError(f"{file} cannot be read as safetensors: {' '.join(str(e).split())}"[:400]) from None
