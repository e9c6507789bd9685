"""Reuse the training tests' tiny corpus, byte-level cache and config factory (tests/train/conftest.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest

_train = Path(__file__).resolve().parents[1] / "train"
sys.path.insert(0, str(_train))  # for `from train_helpers import ...` here and in the test modules
_spec = importlib.util.spec_from_file_location("train_conftest", _train / "conftest.py")
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)

corpus, cache_dir, make_cfg, no_peak_measure = _mod.corpus, _mod.cache_dir, _mod.make_cfg, _mod.no_peak_measure


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory, corpus: Path, cache_dir: Path) -> Path:
    """A tiny HybridNorm* (byte tokenizer) trained 60 steps: enough that greedy decoding is not one
    repeated token, so generation round trips compare real text."""
    from train_helpers import tiny_overrides

    import hybridnorm.train.trainer as trainer
    from hybridnorm.train.config import TrainConfig, apply_overrides

    out = tmp_path_factory.mktemp("hf_run")
    cfg = TrainConfig.from_dict(apply_overrides({}, [*tiny_overrides(corpus, cache_dir, out),
                                                     "--model.placement=hybridnorm_star", "--max_steps=60"]))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "measured_peak_flops", lambda *a, **k: 1e12)
        trainer.train(cfg, quiet=True)
    return out
