"""Helpers shared by the training tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from hybridnorm.config import SIZES

WORDS = ("the lord said unto moses and aaron go forth into a land of milk and honey where the people shall "
         "keep my law by day and by night for they are my people and i am their god behold the river ran "
         "dry and the city was built upon a hill with seven gates of brass").split()


def write_corpus(folder: Path, n_docs: int = 8, n_lines: int = 60, seed: int = 0) -> Path:
    """``n_docs`` .txt files of English-like lines (~3 KB each)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
                 for _ in range(n_lines)]
        (folder / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def tiny_overrides(corpus: Path, cache: Path, out_dir: Path) -> list[str]:
    model = [f"--model.{k}={v}" for k, v in SIZES["tiny"].items() if k != "vocab_size"]
    return [*model, f"--data.source={corpus}", "--data.tokenizer=bytes", f"--data.cache_dir={cache}",
            "--seq_len=32", "--batch_size=4", "--log_interval=1", "--eval_interval=1000", "--eval_batches=2",
            "--ckpt_interval=1000", "--optim.warmup_steps=2", "--optim.lr=2e-3", "--precision=fp32",
            "--device=cpu", f"--out_dir={out_dir}"]


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    """Records of ``metrics.jsonl`` of one kind (a torn last line of a killed run is skipped)."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == kind:
            out.append(rec)
    return out
