"""Fixtures of the evaluation tests: one tiny byte-level model (d 32, 2 layers, window 48) trained for 60
steps in-process (no trainer, no data cache), and the same weights saved as a run folder. Every number is
checked against a naive oracle on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from eval_helpers import corpus_text, save_run, tiny_model

from hybridnorm import TransformerLM
from hybridnorm.data import ByteTokenizer


@pytest.fixture(scope="session")
def model() -> TransformerLM:
    return tiny_model(train_steps=60)


@pytest.fixture(scope="session")
def tok() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory, model: TransformerLM) -> Path:
    root = tmp_path_factory.mktemp("eval_run")
    corpus = root / "corpus.txt"
    corpus.write_text(corpus_text(), encoding="utf-8")
    return save_run(model, root / "run", corpus)
