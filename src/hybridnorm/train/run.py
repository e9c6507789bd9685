"""A trained run on disk: open its folder (or one checkpoint in it) as model, tokenizer and config.

Runs only. :func:`hybridnorm.loading.load_run` opens a run OR a Hugging Face model folder; it sits above
``hybridnorm.hf`` (which itself opens runs through this module to export them), so the two never import
each other.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from hybridnorm.data import Tokenizer, load_tokenizer
from hybridnorm.errors import ConfigError
from hybridnorm.nn.model import TransformerLM
from hybridnorm.train.checkpoint import (
    CheckpointError,
    check_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_weights,
)
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
        with warnings.catch_warnings(record=True) as skipped:  # said once below: in the error, or again
            warnings.simplefilter("always")
            ckpt = latest_checkpoint(path / "checkpoints")
        if ckpt is None:
            found = list_checkpoints(path / "checkpoints")
            raise CheckpointError(f"{path} has no usable checkpoint" + (
                f" ({len(found)} found, none verifies; the newest: {_problem(found[-1])})" if found
                else " (no checkpoints/step_* folder)"))
        for w in skipped:  # a good checkpoint older than corrupt ones: which were skipped is worth a warning
            warnings.warn(w.message, stacklevel=2)
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


def _problem(ckpt: Path) -> str:
    try:
        check_checkpoint(ckpt)
    except CheckpointError as e:
        return str(e)
    return "it verifies now (changed while it was read)"
