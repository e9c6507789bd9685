"""Helpers shared by the evaluation tests: a tiny random-init model saved as a run folder, and naive
oracles (one plain full-sequence forward per scored token or continuation, log_softmax in a Python loop)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from hybridnorm import ModelConfig, TransformerLM, lm_loss
from hybridnorm.data import ByteTokenizer
from hybridnorm.train.checkpoint import TrainState, save_checkpoint
from hybridnorm.train.config import DataConfig, TrainConfig

# max_seq_len 48 bytes: truncation and multi-window documents are easy to reach; 257 tokens padded to 320
# embedding rows, so the padding rows are really there.
TINY = dict(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_size=64, max_seq_len=48,
            pad_vocab_multiple=64, placement="hybridnorm_star")


WORDS = ("the lord said unto moses and aaron go forth into a land of milk and honey where the people shall "
         "keep my law by day and by night behold the river ran dry and the city was built upon a hill").split()


def corpus_text(n_lines: int = 300, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
                     for _ in range(n_lines))


def tiny_model(seed: int = 0, train_steps: int = 0, **overrides: object) -> TransformerLM:
    """A seeded tiny model; ``train_steps`` AdamW steps on :func:`corpus_text` (bytes) give it real
    preferences (a fraction of a second), so greedy text and multiple-choice scores are not degenerate."""
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig(**{**TINY, **overrides}))
    if train_steps:
        ids = torch.tensor(list(corpus_text().encode("utf-8")))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(train_steps):
            starts = torch.randint(0, len(ids) - 49, (8,), generator=gen).tolist()
            x = torch.stack([ids[s:s + 49] for s in starts])  # (8, 49)
            loss = lm_loss(model(x[:, :-1]), x[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def save_run(model: TransformerLM, folder: Path, corpus: Path) -> Path:
    """``folder`` as a run the trainer could have written: config.yaml, tokenizer.json, one checkpoint."""
    cfg = TrainConfig(model=model.config, data=DataConfig(source=str(corpus), tokenizer="bytes"), seq_len=32,
                      out_dir=str(folder))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
    ByteTokenizer().save(folder)
    save_checkpoint(folder / "checkpoints", model, torch.optim.SGD(model.parameters(), lr=0.0), TrainState())
    return folder


@torch.no_grad()
def next_token_logprobs(model: TransformerLM, context: list[int]) -> list[float]:
    """log p(· | context) over the real vocabulary, from one full forward of ``context``."""
    logits = model(torch.tensor([context]))[0, -1, :model.config.vocab_size]  # (vocab,)
    return torch.log_softmax(logits.double(), -1).tolist()


def naive_pair(model: TransformerLM, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """Sum log p(cont | ctx) and the greedy flag from ONE forward of ctx + cont[:-1] (must fit the window)."""
    seq = ctx + cont
    assert len(seq) - 1 <= model.config.max_seq_len
    with torch.no_grad():
        logits = model(torch.tensor([seq[:-1]]))[0, :, :model.config.vocab_size].double()  # (T, vocab)
    logp = torch.log_softmax(logits, -1)
    total, greedy = 0.0, True
    for j, tok in enumerate(cont):
        row = logp[len(ctx) - 1 + j].tolist()
        total += row[tok]
        greedy = greedy and max(range(len(row)), key=row.__getitem__) == tok
    return total, greedy


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def task_folder(root: Path, tasks: dict[str, tuple[list[object], str]], extra: str = "") -> Path:
    """``root/tasks``, one lm-eval task YAML per entry of ``tasks`` (name: (documents, the YAML's body)), each
    reading its documents from a JSONL file by absolute path through datasets' ``json`` builder (no network),
    its cache under ``root``. ``extra``: YAML lines every task gets (e.g. ``fewshot_split: test``)."""
    folder = root / "tasks"
    folder.mkdir()
    for name, (docs, body) in tasks.items():
        data = write_jsonl(root / f"{name}.jsonl", docs)
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"  cache_dir: {root / 'hf-cache'}\ntest_split: test\n{extra}{body}metadata:\n  version: 1.0\n",
            encoding="utf-8")
    return folder
