"""A trained run on disk: open its folder (or one checkpoint in it) as model, tokenizer and config.

Runs only. :func:`hybridnorm.loading.load_run` opens a run OR a Hugging Face model folder; it sits above
``hybridnorm.hf`` (which itself opens runs through this module to export them), so the two never import
each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridnorm.data import Tokenizer, load_tokenizer
from hybridnorm.errors import ConfigError
from hybridnorm.nn.model import TransformerLM
from hybridnorm.train.checkpoint import CheckpointError, latest_checkpoint, load_weights
from hybridnorm.train.config import TrainConfig


@dataclass
class Run:
    run_dir: Path
    checkpoint: Path
    config: TrainConfig
    model: TransformerLM
    tokenizer: Tokenizer


def is_hf_folder(path: str | Path) -> bool:
    """A Hugging Face model folder: a ``config.json`` and no run ``config.yaml``."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "config.yaml").exists()


def open_run(path: str | Path) -> Run:
    """``path`` is a run folder (its newest good checkpoint is used) or a ``checkpoints/step_*`` folder, written
    by one process or sharded by several (FSDP): the model is loaded whole either way."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"no run folder or checkpoint at {path}")
    if (path / "manifest.json").exists() or path.name.startswith("step_"):
        ckpt, run_dir = path, path.parent.parent
    else:
        run_dir = path
        bad: list[str] = []  # with none good, each one's problem (newest first) for the error instead of warnings
        ckpt = latest_checkpoint(path / "checkpoints", why_none=bad)
        if ckpt is None:
            raise CheckpointError(f"{path} has no usable checkpoint" + (
                f" ({len(bad)} found, none verifies; the newest: {bad[0]})" if bad
                else " (no checkpoints/step_* folder)"))
    cfg = TrainConfig.load(run_dir / "config.yaml")
    tokenizer = load_tokenizer(run_dir / "tokenizer.json")
    if tokenizer.vocab_size != cfg.model.vocab_size:  # training and import both make them equal
        raise ConfigError(f"vocab mismatch: tokenizer {run_dir / 'tokenizer.json'} has {tokenizer.vocab_size} "
                          f"tokens but {run_dir / 'config.yaml'} gives the model vocab_size {cfg.model.vocab_size} "
                          "(a smaller tokenizer could not decode every id the model emits)")
    model = TransformerLM(cfg.model)
    load_weights(ckpt, model)  # names, shapes, header dtypes and finiteness checked before anything loads
    model.eval()
    return Run(run_dir, ckpt, cfg, model, tokenizer)

