"""Open a trained run (its folder or one checkpoint in it) for generation and evaluation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridnorm.data import Tokenizer, load_tokenizer, prepare_data, val_batches
from hybridnorm.errors import ConfigError
from hybridnorm.nn.model import TransformerLM, lm_loss
from hybridnorm.train.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_weights
from hybridnorm.train.config import TrainConfig


@dataclass
class Run:
    run_dir: Path
    checkpoint: Path
    config: TrainConfig
    model: TransformerLM
    tokenizer: Tokenizer


def load_run(path: str | Path) -> Run:
    """``path`` is a run folder (its newest good checkpoint is used), a ``checkpoints/step_*`` folder, or a
    local Hugging Face model folder (stock Llama/Qwen3/OLMo-2/... or exported by hybridnorm)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"no run folder or checkpoint at {path}")
    if (path / "config.json").is_file() and not (path / "config.yaml").exists():  # a Hugging Face folder
        try:
            from hybridnorm.hf.export import load_hf_run
        except ImportError:
            raise ConfigError(f"{path} is a Hugging Face model folder: reading it needs transformers "
                              "(pip install 'hybridnorm[hf]')") from None
        return load_hf_run(path)
    if (path / "manifest.json").exists() or path.name.startswith("step_"):
        ckpt, run_dir = path, path.parent.parent
    else:
        run_dir = path
        ckpt = latest_checkpoint(path / "checkpoints")
        if ckpt is None:
            found = list_checkpoints(path / "checkpoints")
            raise CheckpointError(f"{path} has no usable checkpoint" + (
                f" ({len(found)} found, none verifies)" if found else " (no checkpoints/step_* folder)"))
    cfg = TrainConfig.load(run_dir / "config.yaml")
    tokenizer = load_tokenizer(run_dir / "tokenizer.json")
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"vocab mismatch: tokenizer {run_dir / 'tokenizer.json'} has {tokenizer.vocab_size} "
                          f"tokens but the model in {ckpt} has vocab_size {cfg.model.vocab_size}")
    model = TransformerLM(cfg.model)
    load_weights(ckpt, model)
    model.eval()
    return Run(run_dir, ckpt, cfg, model, tokenizer)


@torch.no_grad()
def evaluate_run(run: Run, source: str | None = None, batch_size: int = 8, seq_len: int | None = None,
                 max_batches: int | None = 50) -> tuple[float, int]:
    """Mean next-token loss of ``run`` on the validation split of ``source`` (default: the run's own),
    tokenized with the run's tokenizer. Returns (loss, tokens scored)."""
    seq_len = seq_len or run.config.seq_len
    tok_path = run.run_dir / "tokenizer.json"
    data = prepare_data(source or run.config.data.source, tokenizer=str(tok_path),
                        cache_dir=run.config.data.cache_dir)
    data.check_vocab(run.config.model.vocab_size, f"model vocab_size of {run.checkpoint}")
    val = data.val_tokens()
    if len(val) < seq_len + 1:
        raise ConfigError(f"validation split of {source or run.config.data.source} has {len(val)} tokens, "
                          f"fewer than seq_len + 1 = {seq_len + 1}")
    total, count = 0.0, 0
    for x, y in val_batches(val, batch_size, seq_len, max_batches):
        total += lm_loss(run.model(x), y).item() * y.numel()
        count += y.numel()
    return (total / count if count else math.nan), count
