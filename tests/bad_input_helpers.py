"""Shared by the bad-input property tests: a tiny HF folder and run, the CLI called in-process, and the
promise every case checks (exit 2, one ``error:`` line naming the culprit, no traceback, files unchanged)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings

from hybridnorm.cli import main

# modest: the suite stays fast; every example is a real command line
PROPS = settings(max_examples=12, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def make_hf_and_run(root: Path) -> tuple[Path, Path]:
    """A tiny random Llama-class HF folder (byte tokenizer) and the run folder `import` makes of it."""
    from hybridnorm.config import ModelConfig
    from hybridnorm.data.tokenizer import ByteTokenizer
    from hybridnorm.hf.export import export_model
    from hybridnorm.nn.model import TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.from_preset("tiny", placement="pre", vocab_size=257)).eval()
    hf, run = root / "hf", root / "run"
    export_model(model, hf, ByteTokenizer())
    assert main(["import", str(hf), "--out", str(run)]) == 0
    return hf, run


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_refused(argv: list[str], capsys, needles: list[str], root: Path) -> str:
    """``main(argv)`` exits 2 with one ``error:`` line holding every needle, no traceback, and every file that
    was under ``root`` before is byte-identical after (new files, e.g. a data cache, are allowed)."""
    before = snapshot(root)
    capsys.readouterr()
    assert main(argv) == 2, argv
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("error:"), captured.err
    assert "Traceback" not in captured.err + captured.out
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    after = snapshot(root)
    for name, data in before.items():
        assert after.get(name) == data, f"{name} was changed or removed"
    return lines[0]
