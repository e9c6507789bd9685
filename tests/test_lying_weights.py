"""Weight files whose header lies, or whose values are not finite, are refused before use, naming the file
and the tensor: generated over which tensor, which false dtype (its shape rescaled so the byte count stays
consistent, as a careful forger would), which value turns NaN or inf, and which command reads the file
(import and generate of an HF folder; generate, eval and export of a run, manifest re-signed)."""

from __future__ import annotations

import hashlib
import json
import math
import struct
import tempfile
from pathlib import Path

import pytest
from bad_input_helpers import PROPS, assert_refused, copy_tree, make_hf_and_run
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

SIZES = {"I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1, "I64": 8, "F64": 8}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_hf_and_run(tmp_path_factory.mktemp("lying"))


def _read(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path: Path, header: dict, body: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def _lie(path: Path, pick: int, dtype: str) -> str:
    """Relabel one F32 tensor of ``path`` as ``dtype``, its last dimension rescaled to keep the byte count."""
    header, body = _read(path)
    names = sorted(k for k in header if k != "__metadata__")
    name = names[pick % len(names)]
    info = header[name]
    nbytes = info["data_offsets"][1] - info["data_offsets"][0]
    rows = math.prod(info["shape"][:-1]) if len(info["shape"]) > 1 else 1
    per_row = nbytes // rows
    if per_row % SIZES[dtype]:
        dtype = "I32"  # an odd row length cannot be relabelled with 8-byte elements: the same-size lie
    info["dtype"], info["shape"] = dtype, [*info["shape"][:-1], per_row // SIZES[dtype]] if len(
        info["shape"]) > 1 else [nbytes // SIZES[dtype]]
    _write(path, header, body)
    return name


def _poison(path: Path, pick: int, index: int, value: float) -> str:
    """Set one float32 element of one tensor of ``path`` to ``value`` (NaN or ±inf)."""
    header, body = _read(path)
    names = sorted(k for k in header if k != "__metadata__")
    name = names[pick % len(names)]
    start, end = header[name]["data_offsets"]
    at = start + 4 * (index % ((end - start) // 4))
    body = body[:at] + struct.pack("<f", value) + body[at + 4:]
    _write(path, header, body)
    return name


def _resign(ckpt: Path) -> None:
    """Rewrite the checkpoint's manifest for its changed model file: the forger has write access."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / "model.safetensors").read_bytes()
    manifest["model.safetensors"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _target(kind: str, root: Path, hf: Path, run: Path) -> tuple[Path, list[str], Path]:
    """(the weights file to damage, argv that reads it, the folder it lies in)."""
    if kind.startswith("hf"):
        h = copy_tree(hf, root / "hf")
        argv = ["import", str(h), "--out", str(root / "out")] if kind == "hf import" else \
            ["generate", str(h), "--max-new-tokens", "2"]
        return h / "model.safetensors", argv, h
    r = copy_tree(run, root / "run")
    ckpt = next((r / "checkpoints").glob("step_*"))
    argv = {"run generate": ["generate", str(r), "--max-new-tokens", "2"],
            "run eval": ["eval", str(r), "--text", str(r / "config.yaml")],
            "run export": ["export", str(r), "--to", "hf", str(root / "exported")]}[kind]
    return ckpt / "model.safetensors", argv, ckpt


COMMANDS = ["hf import", "hf generate", "run generate", "run eval", "run export"]


@pytest.mark.parametrize("kind", COMMANDS)
@PROPS
@given(pick=st.integers(0, 10**6), dtype=st.sampled_from(sorted(SIZES)))
def test_a_header_that_lies_about_the_dtype_is_refused_naming_file_and_tensor(folders, tmp_path, capsys, kind,
                                                                              pick, dtype) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    file, argv, where = _target(kind, root, *folders)
    name = _lie(file, pick, dtype)
    if kind.startswith("run"):
        _resign(where)
    line = assert_refused(argv, capsys, [str(file), repr(name), "stored as"], root)
    assert not (root / "out").exists() and not (root / "exported").exists()
    assert "the config implies F32" in line or "floating point" in line


@pytest.mark.parametrize("kind", COMMANDS)
@PROPS
@given(pick=st.integers(0, 10**6), index=st.integers(0, 10**6),
       value=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_a_weight_that_is_not_finite_is_refused_naming_it(folders, tmp_path, capsys, kind, pick, index,
                                                          value) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    file, argv, where = _target(kind, root, *folders)
    name = _poison(file, pick, index, value)
    if kind.startswith("run"):
        _resign(where)
    assert_refused(argv, capsys, [str(file), repr(name), "non-finite"], root)
    assert not (root / "out").exists() and not (root / "exported").exists()
