"""Reference losses on the tokens a study's runs were scored on (``experiments.references``): the tokens
are those the trainer's validation windows score (checked against ``data.loader.val_batches`` itself), and
the command prints each run's loss beside them."""

import numpy as np

from hybridnorm.data import bigram_entropy, prepare_data, unigram_entropy
from hybridnorm.data.loader import val_batches
from hybridnorm.experiments import references
from hybridnorm.experiments.compare import run_compare
from hybridnorm.experiments.runs import read_report


def test_the_references_are_taken_on_the_scored_tokens(make_cfg, tmp_path, capsys):
    base = make_cfg(tmp_path / "unused", "--max_steps=3")
    run_compare(base, ["pre", "post"], [0], tmp_path / "cmp")

    d = base.data
    data = prepare_data(d.source, tokenizer=d.tokenizer, vocab_size=d.vocab_size, cache_dir=d.cache_dir)
    train, val = data.train_tokens(), data.val_tokens()
    pairs = [(x.numpy().ravel(), y.numpy().ravel())  # what an evaluation scores: (input, target) pairs
             for x, y in val_batches(val, base.batch_size * base.grad_accum, base.seq_len, base.eval_batches)]
    inputs, targets = np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])
    n = len(targets)
    assert n == base.eval_windows * base.seq_len < len(val) - 1  # a prefix of the split, not all of it
    assert np.array_equal(inputs, val[:n]) and np.array_equal(targets, val[1:n + 1])

    ref = references.scored_reference(base)
    assert ref.tokens == n
    assert ref.bigram == bigram_entropy(train, val[:n + 1], data.vocab_size)
    assert ref.unigram == unigram_entropy(train, targets, data.vocab_size)
    assert ref.bigram < ref.unigram

    assert references.main([str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    for rec in read_report(tmp_path / "cmp" / "runs.json"):
        row = next(line for line in out.splitlines() if line.startswith(f"| `{rec['placement']}` |"))
        assert f"s0 {rec['final_val_loss']:.3f} ({rec['verdict']})" in row and f"| {ref.bigram:.3f} |" in row
    assert f"bigram reference on the scored tokens: {ref.bigram:.4f} nats" in out


def test_a_folder_without_runs_is_one_error_line(tmp_path, capsys):
    assert references.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "runs.json" in err[0], err
