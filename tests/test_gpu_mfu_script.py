"""benchmarks/gpu_mfu.py without a GPU: it says so and exits 0; on the CPU (``--device cpu``) the same
code path runs end to end on a tiny model and prints its table (eager blocks: no compile in a quick test)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_mfu.py"


@pytest.fixture(scope="module")
def gpu_mfu():
    spec = importlib.util.spec_from_file_location("gpu_mfu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_it_exits_cleanly_with_a_message(gpu_mfu, capsys):
    assert gpu_mfu.main([]) == 0
    assert "no CUDA GPU is available" in capsys.readouterr().out


def test_cpu_smoke_run_prints_a_row_per_configuration(gpu_mfu, capsys, monkeypatch):
    monkeypatch.setattr(gpu_mfu, "measured_peak_flops", lambda *a, **k: 1e12)  # skip the matmul timing
    assert gpu_mfu.main(["--device", "cpu", "--size", "tiny", "--seq", "32", "--batch", "2", "--steps", "1",
                         "--warmup", "1", "--no-compile", "--placements", "pre,hybridnorm_star"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    table = [r for r in rows if r and r[0] in ("pre", "hybridnorm_star")]
    assert [(r[0], r[1]) for r in table] == [("pre", "off"), ("pre", "on"), ("hybridnorm_star", "off"),
                                             ("hybridnorm_star", "on")]
    assert all(r[-1] != "loss!)" and r[6].endswith("%") for r in table)
    assert gpu_mfu.peak_flops(torch.device("cpu"), False)[1] == "measured bf16 matmul"


@pytest.mark.parametrize("loss", ["plain", "compiled"])
def test_cpu_smoke_run_with_each_head_and_loss(gpu_mfu, capsys, monkeypatch, loss):
    monkeypatch.setattr(gpu_mfu, "measured_peak_flops", lambda *a, **k: 1e12)
    assert gpu_mfu.main(["--device", "cpu", "--size", "tiny", "--seq", "32", "--batch", "2", "--steps", "1",
                         "--warmup", "1", "--no-compile", "--placements", "pre", "--ac", "off", "--loss", loss]) == 0
    out = capsys.readouterr().out
    assert f"{loss} head + loss" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("pre "))
    assert row[-1] != "loss!)" and row[6].endswith("%")


def test_set_overrides_preset_fields_and_names_a_bad_one(gpu_mfu):
    import argparse

    import hybridnorm as hn

    sets = ["n_layers=1", "moe={num_experts: 2, top_k: 1}"]
    args = argparse.Namespace(size="tiny-moe", batch=2, seq=32, steps=1, warmup=1, no_compile=True, set=sets)
    got = gpu_mfu.measure(args, "pre", False, torch.device("cpu"))
    want = hn.ModelConfig.from_preset("tiny-moe", placement="pre", n_layers=1, moe={"num_experts": 2, "top_k": 1})
    want = want.build("meta")
    preset = hn.ModelConfig.from_preset("tiny-moe", placement="pre").build("meta")
    assert got["params"] == want.num_params() != preset.num_params()
    assert got["finite"]
    with pytest.raises(hn.ConfigError, match="n_layer"):
        gpu_mfu.measure(argparse.Namespace(**{**vars(args), "set": ["n_layer=1"]}), "pre", False, torch.device("cpu"))
