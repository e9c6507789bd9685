"""A trained tiny HybridNorm* run, and its export, for the export / generation round trips (fixtures:
tests/conftest.py)."""

from pathlib import Path

import pytest


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


@pytest.fixture(scope="session")
def exported(trained_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``trained_run`` exported by the command (``hybridnorm export RUN --to hf DIR``); read only: a test that
    changes a file works on a copy."""
    from train_helpers import cli_in_process

    out = tmp_path_factory.mktemp("exported") / "hf"
    cli_in_process("export", str(trained_run), "--to", "hf", str(out))
    return out
