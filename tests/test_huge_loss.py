"""A finite loss past the range of exp: a model trained at a far too large learning rate can score thousands
of nats per token and still be finite. ``math.exp`` raises OverflowError past ~709.78, and the commands that
print a perplexity did: ``train`` after the run had finished and saved (a traceback and exit 1 where the run
had succeeded), ``eval RUN`` and ``eval RUN --text``. The perplexity of such a loss is inf (null in JSON)."""

from __future__ import annotations

import json
import math
import sys

import pytest
from train_helpers import read_metrics, tiny_overrides

from hybridnorm import cli
from hybridnorm.eval.perplexity import PerplexityResult, perplexity_of_nll


def test_perplexity_of_a_loss_is_exp_up_to_the_largest_float_then_inf():
    for nll in (0.0, 1.5, 50.0, 709.0):
        assert perplexity_of_nll(nll) == math.exp(nll)
    assert perplexity_of_nll(math.log(sys.float_info.max)) == pytest.approx(sys.float_info.max, rel=1e-12)
    assert perplexity_of_nll(709.79) == perplexity_of_nll(65221.4) == perplexity_of_nll(math.inf) == math.inf
    assert math.isnan(perplexity_of_nll(math.nan))
    result = PerplexityResult("x", n_docs=1, n_tokens=10, n_bytes=20, n_words=2, loglikelihood=-20_000.0)
    assert result.token_perplexity == result.byte_perplexity == result.word_perplexity == math.inf
    assert result.bits_per_byte == pytest.approx(1000 / math.log(2))  # finite, as before


def test_commands_report_an_infinite_perplexity_for_a_huge_finite_loss(corpus, cache_dir, no_peak_measure,
                                                                        tmp_path, capsys):
    """init_std=100 makes logits in the thousands (the tied head's rows), so the loss at init is ~2,000 nats
    whatever the CPU; lr 1e-9 keeps it there for the one step."""
    run = tmp_path / "run"
    argv = [*tiny_overrides(corpus, cache_dir, run), "--max_steps=1", "--model.init_std=100", "--optim.lr=1e-9"]
    assert cli.main(["train", *argv]) == 0
    val_loss = read_metrics(run, "eval")[-1]["val_loss"]
    assert math.isfinite(val_loss) and val_loss > 710
    assert f"val loss {val_loss:.4f} (val ppl inf)" in capsys.readouterr().out

    out = tmp_path / "eval.json"
    assert cli.main(["eval", str(run), "--output", str(out)]) == 0
    assert "perplexity inf over" in capsys.readouterr().out
    val = json.loads(out.read_text(encoding="utf-8"))["val"]
    assert val["loss"] > 710 and val["perplexity"] is None  # strict JSON has no inf

    text = tmp_path / "text.json"
    assert cli.main(["eval", str(run), "--text", str(next(corpus.glob("*.txt"))), "--output", str(text)]) == 0
    scored = json.loads(text.read_text(encoding="utf-8"))["text"]
    assert -scored["loglikelihood"] / scored["n_tokens"] > 710
    assert scored["token_perplexity"] is scored["byte_perplexity"] is scored["word_perplexity"] is None
