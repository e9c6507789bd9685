"""The verdict rules on synthetic metric series: each verdict, the borderlines, and the order of the rules."""

import json
import math

import pytest

from hybridnorm.experiments.runs import read_run
from hybridnorm.experiments.verdict import (
    COLLAPSE_COS,
    FALLBACK_RATIO,
    PROGRESS_FRACTION,
    STALL_MARGIN,
    VANISH_RATIO,
    collapse_signals,
    judge,
)

H = 6.172  # the KJV unigram baseline


def _diag(n: int, cos: list[float] | None = None, first: float = 0.1, last: float = 0.1) -> dict:
    d = {f"cos_sim/blocks.{i}": c for i, c in enumerate(cos or [0.3] * n)}
    d.update({f"grad_norm/blocks.{i}": 0.1 for i in range(n)})
    d["grad_norm/blocks.0"], d[f"grad_norm/blocks.{n - 1}"] = first, last
    return d


def _judge(**kw):
    args = dict(diverged=False, final_val_loss=5.4, unigram_entropy=H, first_train_loss=9.0, final_train_loss=5.3,
                last_diag=_diag(6), n_layers=6)
    args.update(kw)
    return judge(**args).verdict


def test_trained_and_stalled_around_the_margin():
    assert _judge() == "trained"
    # margin: strictly ≥ STALL_MARGIN below the baseline counts as progress
    assert _judge(final_val_loss=H - STALL_MARGIN - 1e-6) == "trained"
    assert _judge(final_val_loss=H - STALL_MARGIN + 1e-6) == "stalled"
    assert _judge(final_val_loss=H + 0.03) == "stalled"  # above the context-free baseline
    # the old rule (train loss < 0.95 × first) was satisfied by this stalled run: the verdict must not be
    assert _judge(final_val_loss=6.19, first_train_loss=6.5, final_train_loss=6.10) == "stalled"


def test_collapse_by_cosine_needs_more_than_half_the_blocks():
    n = 6
    half = [COLLAPSE_COS] * 3 + [0.5] * 3
    assert _judge(last_diag=_diag(n, half), final_val_loss=6.0) == "trained"  # exactly half: not "most"
    most = [COLLAPSE_COS] * 4 + [0.5] * 2
    assert _judge(last_diag=_diag(n, most)) == "collapsed"
    below = [COLLAPSE_COS - 1e-4] * 6
    assert _judge(last_diag=_diag(n, below)) == "trained"


def test_collapse_by_vanishing_first_block_gradient():
    assert _judge(last_diag=_diag(6, first=VANISH_RATIO * 0.99, last=1.0)) == "collapsed"
    assert _judge(last_diag=_diag(6, first=VANISH_RATIO * 1.01, last=1.0)) == "trained"
    sig = collapse_signals(_diag(6, first=1e-12, last=1e-2), 6)
    assert sig["grad_ratio_first_last"] == pytest.approx(1e-10)


def test_diverged_wins_over_everything():
    assert _judge(diverged=True, diverged_at=13) == "diverged"
    assert _judge(final_val_loss=math.nan) == "diverged"
    assert _judge(final_train_loss=math.inf) == "diverged"
    # collapsed beats stalled: a run that collapsed also cannot beat the unigram baseline; collapse says why
    assert _judge(final_val_loss=H, last_diag=_diag(6, [1.0] * 6)) == "collapsed"


def test_without_a_unigram_baseline_the_first_loss_rule_decides():
    assert _judge(unigram_entropy=None, first_train_loss=9.0, final_train_loss=8.54) == "trained"
    assert _judge(unigram_entropy=None, first_train_loss=9.0, final_train_loss=8.56) == "stalled"
    assert _judge(unigram_entropy=None, final_val_loss=None, first_train_loss=None, final_train_loss=None) == "stalled"


def test_no_diagnostics_means_no_collapse_signal():
    assert collapse_signals(None, 6) == {}
    assert _judge(last_diag=None) == "trained"


def test_run_folder_verdict_and_record(tmp_path):
    """A run folder written by hand (the trainer's record kinds) is read back into the right verdict and a
    record that names its init and knobs."""
    run = tmp_path / "r"
    run.mkdir()
    point = {"point": {"placement": "hybridnorm", "init": "megatron", "knobs": {"optim.lr": 0.01}, "seed": 2},
             "config": {"max_steps": 100, "model": {"n_layers": 4}, "optim": {"lr": 0.01, "warmup_steps": 10}}}
    (run / "point.json").write_text(json.dumps(point))
    recs = [{"kind": "meta", "step": 0, "init": "megatron", "unigram_entropy": H, "params": 123},
            {"kind": "train", "step": 10, "loss": 6.6, "tokens": 1000},
            {"kind": "train", "step": 100, "loss": 6.1, "tokens": 10000},
            {"kind": "eval", "step": 100, "val_loss": 6.19, "val_tokens": 4096},
            {"kind": "diag", "step": 100, **_diag(4, [0.4, 0.999, 1.0, 1.0])}]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, recs)) + "\n{\"kind\": \"tra")  # torn last line
    (run / "done.json").write_text("{}")
    r = read_run(run)
    assert r.verdict.verdict == "collapsed" and r.done
    rec = r.to_record(tmp_path)
    assert rec["init"] == "megatron" and rec["knobs"] == {"optim.lr": 0.01} and rec["seed"] == 2
    assert rec["final_val_loss"] == 6.19 and rec["tokens_seen"] == 10000 and rec["val_tokens"] == 4096
    assert rec["cos_collapsed_frac"] == 0.75 and rec["run"] == "r"
    json.dumps(rec, allow_nan=False)  # strict JSON: no NaN in a record


def _numbers(text: str) -> list[float]:
    import re

    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?(?:e-?\d+)?", text)]


def test_a_reason_at_a_threshold_shows_the_side_its_verdict_was_decided_on():
    """Each number a reason holds against a threshold reads on the side of it the rule found (hand check:
    parse the shown number, compare it with the documented threshold). Shown at 3 digits, a gain of
    0.0999999999999996 read "0.100 ... trained needs ≥ 0.1" under a *stalled* verdict."""
    v = judge(diverged=False, final_val_loss=5.9, unigram_entropy=6.0, first_train_loss=9.0, final_train_loss=5.9)
    assert v.verdict == "stalled" and 6.0 - 5.9 < STALL_MARGIN  # the float difference is just under
    gain = v.reason.split(" is ")[1].split(" nats below")[0]
    assert float(gain) < STALL_MARGIN and gain != "0.100"
    v = judge(diverged=False, final_val_loss=5.0, unigram_entropy=6.0, first_train_loss=9.0, final_train_loss=5.0,
              best_gain=4.0 + 1e-7)  # 1.0 nats of 4.0000001: just under 25%
    share = v.reason.split(", ")[1].split("%")[0]
    assert v.verdict == "stalled" and float(share) < 100 * PROGRESS_FRACTION
    v = judge(diverged=False, final_val_loss=5.0, unigram_entropy=6.0, first_train_loss=9.0, final_train_loss=5.0,
              last_diag=_diag(2, [0.1, 0.1], first=VANISH_RATIO * (1 - 1e-9), last=1.0), n_layers=2)
    assert v.verdict == "collapsed" and _numbers(v.reason.split("ratio ")[1])[0] < VANISH_RATIO
    cos = [COLLAPSE_COS] * 51 + [0.1] * 50  # 51 of 101 blocks: "50%" would not be "most"
    v = judge(diverged=False, final_val_loss=5.0, unigram_entropy=6.0, first_train_loss=9.0, final_train_loss=5.0,
              last_diag=_diag(101, cos), n_layers=101)
    assert v.verdict == "collapsed" and _numbers(v.reason.split(" in ")[1])[0] > 50
    seen = set()
    for final in (8.55, 9.0 * FALLBACK_RATIO):  # 8.55 / 9 is 0.9500000000000001; 9 × 0.95 / 9 is just under
        v = judge(diverged=False, final_val_loss=None, unigram_entropy=None, first_train_loss=9.0,
                  final_train_loss=final)
        ratio = float(v.reason.split("(")[1].split("×")[0])
        assert (ratio < FALLBACK_RATIO) == (v.verdict == "trained"), v.reason
        seen.add(v.verdict)
    assert seen == {"trained", "stalled"}
