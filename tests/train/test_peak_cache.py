"""MFU's denominator: the matmul peak is measured once per machine and cached, so runs on one machine share
it, and the run's meta record carries the peak its MFU used."""

from __future__ import annotations

import json

import torch
from train_helpers import read_metrics

from hybridnorm.train import flops
from hybridnorm.train.trainer import train


def test_a_cached_peak_is_used_as_is(tmp_path, monkeypatch):
    cache = tmp_path / "peak.json"
    monkeypatch.setenv("HYBRIDNORM_PEAK_CACHE", str(cache))
    cache.write_text(json.dumps({flops.machine_key("cpu", torch.float32): 1.25e9}))
    flops.measured_peak_flops.cache_clear()
    try:
        assert flops.measured_peak_flops("cpu", torch.float32) == 1.25e9  # no measurement: the cached value
    finally:
        flops.measured_peak_flops.cache_clear()


def test_the_first_measurement_is_stored_and_reused(tmp_path, monkeypatch):
    cache = tmp_path / "sub" / "peak.json"
    monkeypatch.setenv("HYBRIDNORM_PEAK_CACHE", str(cache))
    flops.measured_peak_flops.cache_clear()
    try:
        first = flops.measured_peak_flops("cpu", torch.float32)
        stored = json.loads(cache.read_text())
        assert stored == {flops.machine_key("cpu", torch.float32): first} and first > 0
        flops.measured_peak_flops.cache_clear()  # a new process: reads the file, does not re-measure
        assert flops.measured_peak_flops("cpu", torch.float32) == first
    finally:
        flops.measured_peak_flops.cache_clear()


def test_meta_records_the_peak_and_mfu_uses_it(make_cfg, tmp_path):
    """``make_cfg`` pins the peak at 1e12 FLOP/s (conftest), so MFU = tokens/s × FLOPs/token / 1e12."""
    train(make_cfg(tmp_path / "run", "--max_steps=2", "--log_interval=1"), quiet=True)
    (meta,) = read_metrics(tmp_path / "run", "meta")
    assert meta["matmul_peak_flops"] == 1e12
    rows = [r for r in read_metrics(tmp_path / "run", "train") if "mfu" in r]
    assert rows and all(r["mfu"] > 0 for r in rows)
