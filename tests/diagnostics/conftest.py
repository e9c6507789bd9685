"""Fixtures for the diagnostics tests: the training tests' tiny corpus / config factory (their helpers live
in tests/train)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

from train_helpers import tiny_overrides, write_corpus

from hybridnorm.data import prepare_data
from hybridnorm.train.config import TrainConfig, apply_overrides


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    prepare_data(str(corpus), tokenizer="bytes", cache_dir=cache)
    return cache


@pytest.fixture
def make_cfg(corpus: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., TrainConfig]:
    import hybridnorm.train.trainer as trainer

    monkeypatch.setattr(trainer, "measured_peak_flops", lambda *a, **k: 1e12)  # skip the slow matmul timing

    def make(out_dir: Path, *extra: str) -> TrainConfig:
        return TrainConfig.from_dict(apply_overrides({}, [*tiny_overrides(corpus, cache_dir, out_dir), *extra]))

    return make
