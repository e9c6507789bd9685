"""A verdict for every run — ``trained``, ``stalled``, ``collapsed`` or ``diverged`` — from what it logged.

The rules, in order (the first that holds wins):

``diverged``
    the non-finite guard stopped the run (``divergence.json``) or a logged loss is not finite.
``collapsed``
    rank collapse at the last diagnostics step: the token cosine similarity of the residual stream is
    ≥ :data:`COLLAPSE_COS` in more than half of the blocks (every token carries the same vector, so the
    model can only predict the unigram distribution), or the first block's gradient norm is below
    :data:`VANISH_RATIO` × the last block's (the bottom of the network no longer learns).
``stalled``
    no real progress beyond the context-free baseline: the final validation loss is not at least
    :data:`STALL_MARGIN` nats below the unigram cross-entropy of the validation set (what a model that
    ignores the context reaches); or, where the run is judged beside others of the same budget (a report),
    its gain over that baseline is less than :data:`PROGRESS_FRACTION` of the largest gain among them.
    Without that baseline (runs from before it was logged) the train loss
    must have fallen below :data:`FALLBACK_RATIO` × the first logged loss.
``trained``
    none of the above.

Why these thresholds (measured on the embedded KJV corpus, BPE 8192, unigram baseline 6.17 nats;
6 layers, d=64, lr 1e-2, 10 warmup steps, 100 steps, fp32): HybridNorm ended at val 6.196 (above the
baseline) with cosine similarity 0.998–1.000 in blocks 4–6; Post-Norm 6.032 and HybridNorm* 5.985 kept
learning (cosine ≤ 0.78), Pre-Norm 5.403 (cosine ≤ 0.36). At 24 layers the same stalled HybridNorm run
shows cosine 1.00 from block 6 up and a first-block gradient near 1e-12. Validation loss on ≥ 100k tokens
has a standard error of about 0.01 nats, so a margin of 0.1 nats is ten of them, and less than the
smallest margin of a run that visibly kept learning (Post-Norm's 0.14). A trained run's cosine stays far
from 0.99 and its first/last gradient ratio far above 1e-6 (see docs/results/README.md for the grid's own
distribution of both).

Why the relative rule (issue #23): in study A (24 layers, 1,000 steps) the best run gains 1.96 nats over the
unigram baseline; five HybridNorm*/HybridNorm runs at normal init gained only 0.11–0.22 nats (6–11% of it)
and were called trained, while the next run up gains 0.75 (38%). No run of either study falls between 11%
and 38%, so :data:`PROGRESS_FRACTION` = 0.25 splits that gap; the borderline runs are listed in
docs/results/README.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

VERDICTS = ("trained", "stalled", "collapsed", "diverged")
STALL_MARGIN = 0.1        # nats below the unigram baseline that count as real progress
COLLAPSE_COS = 0.99       # token cosine similarity that counts as "all tokens the same"
VANISH_RATIO = 1e-6       # first-block / last-block gradient norm below which the bottom has stopped learning
PROGRESS_FRACTION = 0.25  # beside runs of the same budget: gain over unigram ≥ this × the largest gain
FALLBACK_RATIO = 0.95     # without a unigram baseline: final train loss < this × the first logged loss


@dataclass(frozen=True)
class Verdict:
    verdict: str          # one of VERDICTS
    reason: str           # the measured numbers that decided it, in words

    def __str__(self) -> str:
        return self.verdict


def _shown(x: float, holds: Callable[[float], bool], digits: int, kind: str = "f") -> str:
    """``x`` with ``digits`` digits (``kind``: ``f``, ``e`` or ``%``), or with more where fewer would make the
    rule ``holds`` read otherwise of the shown number than of ``x``: a gain of 0.0999999 shown as 0.100 beside
    "trained needs ≥ 0.1" contradicted its own verdict, and a reader could not check it."""
    scale = 100.0 if kind == "%" else 1.0
    for d in range(digits, 18):
        text = f"{x * scale:.{d}{'f' if kind == '%' else kind}}"
        if holds(float(text) / scale) == holds(x):
            return text + ("%" if kind == "%" else "")
    return repr(x)  # every digit: what the rule read


def collapse_signals(diag: dict[str, Any] | None, n_layers: int) -> dict[str, float]:
    """From one diagnostics record: the fraction of blocks whose token cosine similarity is ≥ COLLAPSE_COS,
    and the first/last block gradient-norm ratio (keys left out when not collected)."""
    if not diag or n_layers < 1:
        return {}
    out: dict[str, float] = {}
    cos = [diag.get(f"cos_sim/blocks.{i}") for i in range(n_layers)]
    cos = [c for c in cos if isinstance(c, (int, float)) and math.isfinite(c)]
    if cos:
        out["cos_collapsed_frac"] = sum(c >= COLLAPSE_COS for c in cos) / len(cos)
    first, last = diag.get("grad_norm/blocks.0"), diag.get(f"grad_norm/blocks.{n_layers - 1}")
    if n_layers > 1 and isinstance(first, (int, float)) and isinstance(last, (int, float)) and last > 0:
        out["grad_ratio_first_last"] = first / last
    return out


def judge(*, diverged: bool, diverged_at: int | None = None, final_val_loss: float | None,
          unigram_entropy: float | None, first_train_loss: float | None, final_train_loss: float | None,
          last_diag: dict[str, Any] | None = None, n_layers: int = 0,
          best_gain: float | None = None) -> Verdict:
    """The verdict of one run from its logged numbers (see the module docstring for the rules).
    ``best_gain``: the largest gain over the unigram baseline among the runs of the same budget it is
    judged beside (None: judged alone, the relative rule is not applied)."""
    if diverged or any(v is not None and not math.isfinite(v) for v in (final_val_loss, final_train_loss)):
        return Verdict("diverged", f"non-finite loss or gradient at step {diverged_at}" if diverged_at is not None
                       else "non-finite loss")
    sig = collapse_signals(last_diag, n_layers)
    frac, ratio = sig.get("cos_collapsed_frac"), sig.get("grad_ratio_first_last")
    if frac is not None and frac > 0.5:
        shown = _shown(frac, lambda f: f > 0.5, 0, "%")  # "most": 51 of 101 blocks is 50.5%, not 50%
        return Verdict("collapsed", f"token cosine ≥ {COLLAPSE_COS} in {shown} of blocks")
    if ratio is not None and ratio < VANISH_RATIO:
        shown = _shown(ratio, lambda q: q < VANISH_RATIO, 1, "e")
        return Verdict("collapsed", f"first/last block gradient ratio {shown} < {VANISH_RATIO:g}")
    if final_val_loss is not None and unigram_entropy is not None:
        gain = unigram_entropy - final_val_loss
        if gain < STALL_MARGIN:
            where = (f"{_shown(gain, lambda g: g < STALL_MARGIN, 3)} nats below" if gain > 0
                     else f"{-gain:.3f} nats above")
            return Verdict("stalled", f"val {final_val_loss:.3f} is {where} the unigram baseline "
                                      f"{unigram_entropy:.3f}; trained needs ≥ {STALL_MARGIN:g} below")
        # decided on the share itself, the number the reason shows (its product form can differ by an ulp)
        if best_gain is not None and best_gain > 0 and gain / best_gain < PROGRESS_FRACTION:
            share = _shown(gain / best_gain, lambda f: f < PROGRESS_FRACTION, 0, "%")
            return Verdict("stalled", f"val {final_val_loss:.3f} is {gain:.3f} nats below the unigram baseline "
                                      f"{unigram_entropy:.3f}, {share} of the best same-budget "
                                      f"run's {best_gain:.3f}; trained needs ≥ {PROGRESS_FRACTION:.0%}")
        return Verdict("trained", f"val {final_val_loss:.3f}, {gain:.3f} nats below the unigram baseline")
    if first_train_loss is None or final_train_loss is None:
        return Verdict("stalled", "no loss logged")
    # the ratio the reason shows decides (a cross-entropy's first loss is > 0)
    fell = final_train_loss / first_train_loss if first_train_loss > 0 else math.inf
    below = fell < FALLBACK_RATIO
    ratio_text = _shown(fell, lambda q: q < FALLBACK_RATIO, 3)
    if not below:
        return Verdict("stalled", f"train loss {first_train_loss:.3f} → {final_train_loss:.3f} ({ratio_text}×; "
                                  f"trained needs < {FALLBACK_RATIO:g}×; no unigram baseline logged)")
    return Verdict("trained", f"train loss {first_train_loss:.3f} → {final_train_loss:.3f} ({ratio_text}×; "
                              "no unigram baseline)")
