"""MFU's denominator: the matmul peak is measured per machine by its first few runs and cached (the largest
sample), so later runs on one machine share it, and the run's meta record carries the peak its MFU used."""

from __future__ import annotations

import json

import pytest
import torch
from train_helpers import read_metrics

from hybridnorm.train import flops
from hybridnorm.train.run import open_run
from hybridnorm.train.trainer import train


def fresh_process() -> None:
    """What a new process sees: nothing measured in memory yet (the lru_cache), only the file."""
    flops.measured_peak_flops.cache_clear()


@pytest.fixture
def fake_matmul(tmp_path, monkeypatch):
    """The peak cache in tmp_path, and matmul_flops answering from a list (the values later runs would
    measure), recording each call; nothing is timed."""
    monkeypatch.setenv("HYBRIDNORM_PEAK_CACHE", str(tmp_path / "sub" / "peak.json"))
    answers, calls = [], []

    def measure(device, dtype, n):
        calls.append((device, dtype, n))
        return answers.pop(0)

    monkeypatch.setattr(flops, "matmul_flops", measure)
    fresh_process()
    yield tmp_path / "sub" / "peak.json", answers, calls
    fresh_process()


def test_the_first_runs_each_add_a_sample_and_the_peak_is_the_largest(fake_matmul):
    """A first sample taken while the machine was busy (4e9) is raised by the next runs' (9e9), and after
    PEAK_SAMPLES runs nothing is measured again: every later run shares one peak."""
    cache, answers, calls = fake_matmul
    answers += [4e9, 9e9, 7e9, 1e12]
    seen = []
    for _ in range(flops.PEAK_SAMPLES + 2):
        fresh_process()
        seen.append(flops.measured_peak_flops("cpu", torch.float32))
    assert flops.PEAK_SAMPLES == 3 and seen == [4e9, 9e9, 9e9, 9e9, 9e9]
    assert len(calls) == 3 and answers == [1e12]
    assert json.loads(cache.read_text()) == {flops.machine_key("cpu", torch.float32): [4e9, 9e9, 7e9]}
    fresh_process()
    flops.measured_peak_flops("cpu", torch.bfloat16)  # another dtype is another machine key: measured afresh
    assert len(calls) == 4 and json.loads(cache.read_text())[flops.machine_key("cpu", torch.bfloat16)] == [1e12]


def test_a_full_cache_is_used_as_is(fake_matmul):
    cache, _, calls = fake_matmul
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({flops.machine_key("cpu", torch.float32): [1.25e9, 2.5e9, 2e9]}))
    assert flops.measured_peak_flops("cpu", torch.float32) == 2.5e9 and calls == []


@pytest.mark.parametrize("stored, kept", [
    (5e9, [5e9]),  # an earlier release's one number: one sample
    ([5e9, "x", -1.0, True, None, [3e9]], [5e9]),  # what is not a positive number counts as nothing
    ("fast", []), ({"a": 1}, []), (0, []),
    ([float("inf"), 4e9, float("nan")], [4e9]),  # json reads Infinity and NaN: no peak (MFU against inf)
])
def test_stored_values_count_as_samples_only_when_they_are_positive_numbers(fake_matmul, stored, kept):
    cache, answers, calls = fake_matmul
    cache.parent.mkdir(parents=True)
    key = flops.machine_key("cpu", torch.float32)
    cache.write_text(json.dumps({key: stored, "other": 1.0}))
    answers.append(3e9)
    assert flops.measured_peak_flops("cpu", torch.float32) == max([*kept, 3e9]) and len(calls) == 1
    assert json.loads(cache.read_text()) == {key: [*kept, 3e9], "other": 1.0}  # other keys kept as they were


def test_a_real_measurement_is_stored(tmp_path, monkeypatch):
    cache = tmp_path / "peak.json"
    monkeypatch.setenv("HYBRIDNORM_PEAK_CACHE", str(cache))
    fresh_process()
    try:
        first = flops.measured_peak_flops("cpu", torch.float32)
        assert first > 0 and json.loads(cache.read_text()) == {flops.machine_key("cpu", torch.float32): [first]}
    finally:
        fresh_process()


def test_meta_records_the_peak_and_mfu_uses_it(make_cfg, tmp_path):
    """``make_cfg`` pins the peak at 1e12 FLOP/s (conftest), so MFU = tokens/s × FLOPs/token / 1e12."""
    train(make_cfg(tmp_path / "run", "--max_steps=2", "--log_interval=1"), quiet=True)
    (meta,) = read_metrics(tmp_path / "run", "meta")
    assert meta["matmul_peak_flops"] == 1e12
    rows = [r for r in read_metrics(tmp_path / "run", "train") if "mfu" in r]
    assert rows and all(r["mfu"] > 0 for r in rows)


def test_a_known_gpu_is_measured_against_its_datasheet_in_bf16_only():
    """Names as torch.cuda.get_device_name gives them; PCIe and NVL H100s have lower clocks than SXM, and
    GH200 carries an H100/H200-class GPU. fp32 and unknown GPUs fall back to a measured matmul (None)."""
    peak = {name: flops.datasheet_peak(name, torch.bfloat16) for name in (
        "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA GH200 480GB",
        "NVIDIA A100-SXM4-80GB", "NVIDIA L4")}
    assert {k: v and v[0] for k, v in peak.items()} == {
        "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
        "NVIDIA H200": 989e12, "NVIDIA GH200 480GB": 989e12, "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA L4": None}
    assert peak["NVIDIA H200"][1] == "datasheet dense bf16 of NVIDIA H200"
    assert flops.datasheet_peak("NVIDIA H100 80GB HBM3", torch.float32) is None
    assert flops.gpu_datasheet_peak("cpu", torch.bfloat16) is None


def test_on_a_known_gpu_the_run_reports_mfu_against_the_datasheet(make_cfg, tmp_path, monkeypatch, capsys):
    """The trainer's wiring on the CPU, with the device lookup answering as an H200 would: the meta record
    and the console name the datasheet peak, and MFU = tokens/s × FLOPs/token / 989e12 (the measured peak,
    pinned at 1e12 by conftest, is not used)."""
    import hybridnorm.train.trainer as trainer

    monkeypatch.setattr(trainer, "gpu_datasheet_peak", lambda device, dtype: (989e12, "datasheet dense bf16 of X"))
    train(make_cfg(tmp_path / "run", "--max_steps=2", "--log_interval=1"))
    assert "MFU against 989 TFLOP/s (datasheet dense bf16 of X)" in capsys.readouterr().err
    (meta,) = read_metrics(tmp_path / "run", "meta")
    assert (meta["matmul_peak_flops"], meta["mfu_peak_source"]) == (989e12, "datasheet dense bf16 of X")
    run = open_run(tmp_path / "run")  # the model as trained (its vocabulary is the tokenizer's)
    fpt = flops.flops_per_token(run.model, run.config.seq_len)
    rows = [r for r in read_metrics(tmp_path / "run", "train") if "mfu" in r]
    assert rows and all(r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / 989e12, rel=1e-9) for r in rows)


@pytest.mark.parametrize(("probe_seconds", "n", "sizes"), [
    (0.0, 2048, [256]),                        # a product already this slow at 256 is measured there
    (float("inf"), 1024, [256, 512, 1024]),    # a fast one grows, doubling, to n
    (float("inf"), 100, [100]),                # n below the first probe size: n itself
])
def test_the_matmul_grows_until_one_product_is_slow_enough_to_time(monkeypatch, probe_seconds, n, sizes):
    """The size rule, without timing anything: the probe's threshold set to 0 s (every product counts as slow)
    or to infinity (none does). Found on a CPU without native bf16, where 16 bf16 products of 2048² took ~5
    minutes before a bf16 run's first step."""
    made = []
    real = torch.randn

    def randn(*shape, **kw):
        made.append(shape[0])
        return real(*shape, **kw)

    monkeypatch.setattr(flops, "PROBE_SECONDS", probe_seconds)
    monkeypatch.setattr(flops.torch, "randn", randn)
    rate = flops.matmul_flops("cpu", torch.float32, n, reps=1, rounds=1)
    assert made[::2] == sizes and rate > 0  # two matrices a size


@pytest.mark.parametrize(("bf16", "fp32", "device", "expected"), [
    (1.3e9, 1.7e11, "cpu", 1.7e11),   # bf16 emulated through fp32 (AVX2 only): fp32's rate is the ceiling
    (9.0e11, 2.1e11, "cpu", 9.0e11),  # native bf16 (AVX512-BF16, AMX): bf16's own
    (1.0e12, 2.0e12, "cuda", 1.0e12), # a GPU without a datasheet entry: the dtype's own, never compared
])
def test_the_mfu_peak_of_a_bf16_run_is_the_faster_of_bf16_and_fp32_on_a_cpu(bf16, fp32, device, expected):
    asked = []

    def measure(dev, dtype, n):
        asked.append((dev, dtype, n))
        return {torch.bfloat16: bf16, torch.float32: fp32}[dtype]

    peak, source = flops.cpu_or_measured_peak(torch.device(device), torch.bfloat16, measure)
    assert peak == expected and ("fp32" in source) == (expected == fp32 != bf16)
    assert asked[0] == (device, torch.bfloat16, 8192 if device == "cuda" else 2048)
    peak, source = flops.cpu_or_measured_peak(torch.device("cpu"), torch.float32, measure)
    assert (peak, source) == (fp32, "measured matmul")
