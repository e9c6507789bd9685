"""Fixtures shared by every test folder (train, diagnostics, experiments, hf, cli): a small local corpus,
its prepared byte-level cache, and a tiny-model TrainConfig factory (d 64, 2 layers, seq_len 32, batch 4)
that trains a step in milliseconds. Helpers for test modules live in ``train_helpers.py`` beside this."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from train_helpers import tiny_overrides, write_corpus

from hybridnorm.data import prepare_data
from hybridnorm.train.config import TrainConfig, apply_overrides


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.cuda`` tests skip cleanly on a machine without a GPU (CI has none)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    prepare_data(str(corpus), tokenizer="bytes", cache_dir=cache)  # warm: runs and subprocesses reuse it
    return cache


@pytest.fixture
def dynamo() -> Iterator[None]:
    """A clean dynamo for tests that count graphs: compiled code caches (Block.forward's is shared by every
    test in the process) and counters reset before and after."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_peak_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip the trainer's seconds-long matmul peak measurement (only used for the MFU display)."""
    import hybridnorm.train.trainer as trainer

    monkeypatch.setattr(trainer, "measured_peak_flops", lambda *a, **k: 1e12)


@pytest.fixture
def make_cfg(corpus: Path, cache_dir: Path, no_peak_measure: None) -> Callable[..., TrainConfig]:
    def make(out_dir: Path, *extra: str) -> TrainConfig:
        return TrainConfig.from_dict(apply_overrides({}, [*tiny_overrides(corpus, cache_dir, out_dir), *extra]))

    return make


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, corpus: Path, cache_dir: Path) -> Path:
    """A tiny run folder (2 steps) to load, export and generate from, shared by a test module."""
    import hybridnorm.train.trainer as trainer

    out = tmp_path_factory.mktemp("tiny_run") / "run"
    cfg = TrainConfig.from_dict(apply_overrides({}, [*tiny_overrides(corpus, cache_dir, out), "--max_steps=2"]))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "measured_peak_flops", lambda *a, **k: 1e12)
        trainer.train(cfg, quiet=True)
    return out
