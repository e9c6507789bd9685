"""``hybridnorm eval RUN`` scores the run's own corpus from the entry its trainer prepared in the data cache (the
same files by content, split settings and tokenizer by fingerprint), not from a second tokenization of the corpus
keyed by the run's ``tokenizer.json`` path; an entry of the same corpus with another tokenizer is never taken."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from train_helpers import read_metrics, tiny_overrides

from hybridnorm import cli
from hybridnorm.data import prepare_data
from hybridnorm.data.tokens import open_tokens


def _eval_loss(capsys, run: Path) -> str:
    capsys.readouterr()
    assert cli.main(["eval", str(run)]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    (found,) = re.findall(r"val loss (\S+), perplexity", out.out + out.err)
    return found


def _entries(cache: Path) -> set[str]:
    """Every folder of the cache (an entry, or one a preparation began: its lock made it)."""
    return {p.name for p in cache.iterdir()}


def _train(corpus: Path, cache: Path, run: Path, *tokenizer: str) -> None:
    assert cli.main(["train", *tiny_overrides(corpus, cache, run), *tokenizer, "--max_steps=2"]) == 0


@pytest.mark.parametrize("tokenizer", [("--data.tokenizer=bpe", "--data.vocab_size=300"), ("--data.tokenizer=bytes",)],
                         ids=["bpe", "bytes"])
def test_eval_of_a_trained_run_reads_its_trainers_cache_entry(corpus, tmp_path, capsys, monkeypatch, no_peak_measure,
                                                              tokenizer):
    cache, run = tmp_path / "cache", tmp_path / "run"
    _train(corpus, cache, run, *tokenizer)
    (trainer_entry,) = _entries(cache)
    loss = _eval_loss(capsys, run)
    assert _entries(cache) == {trainer_entry}  # before, a second "-tok<fingerprint>" copy of the corpus's tokens
    (val,) = read_metrics(run, "eval")
    assert f"{val['val_loss']:.4f}" == loss  # the trainer's own last evaluation, on its own data

    # the old way: the corpus prepared with the run's tokenizer.json where no trainer's entry is, then scored
    old = prepare_data(str(corpus), tokenizer=str(run / "tokenizer.json"), cache_dir=tmp_path / "old")
    assert old.dir.name.endswith(f"-tok{old.tokenizer.fingerprint[:12]}")
    mine = cache / trainer_entry
    for split in ("train", "val"):
        assert np.array_equal(open_tokens(mine / f"{split}.bin"), open_tokens(old.dir / f"{split}.bin"))
    cache.rename(tmp_path / "hidden")  # the run's data.cache_dir is not here: eval reads $HYBRIDNORM_CACHE
    monkeypatch.setenv("HYBRIDNORM_CACHE", str(tmp_path / "old"))
    assert _eval_loss(capsys, run) == loss
    assert _entries(tmp_path / "old") == {old.dir.name}


def test_an_entry_of_the_same_corpus_with_another_tokenizer_is_not_taken(corpus, tmp_path, capsys, monkeypatch,
                                                                        no_peak_measure):
    cache, run = tmp_path / "cache", tmp_path / "run"
    _train(corpus, cache, run, "--data.tokenizer=bpe", "--data.vocab_size=300")
    (trainer_entry,) = _entries(cache)
    loss = _eval_loss(capsys, run)

    # another machine's cache: the same corpus's entry under the name the run's trainer gave its own, holding
    # another BPE (as one trained by another tokenizers release would), and one honestly named
    other = tmp_path / "other"
    for vocab in (400, 320):
        prepare_data(str(corpus), tokenizer="bpe", vocab_size=vocab, cache_dir=other)
    lookalike = other / trainer_entry
    (other / trainer_entry.replace("-bpe300", "-bpe400")).rename(lookalike)
    kept = {p.name: p.read_bytes() for p in lookalike.iterdir()}
    shutil.rmtree(cache)
    monkeypatch.setenv("HYBRIDNORM_CACHE", str(other))
    assert _eval_loss(capsys, run) == loss  # its own tokens, prepared afresh with the run's tokenizer
    (new,) = _entries(other) - {trainer_entry, trainer_entry.replace("-bpe300", "-bpe320")}
    assert re.fullmatch(r"[0-9a-f]{16}-tok[0-9a-f]{12}", new)
    assert {p.name: p.read_bytes() for p in lookalike.iterdir()} == kept
