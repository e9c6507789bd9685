"""The next token from a model's last logits, as transformers' ``generate()`` picks it.

transformers' order (``GenerationMixin._get_logits_processor``): the repetition penalty on the raw logits
(greedy decoding too), then, when sampling, temperature, top-k, top-p, min-p, and one ``torch.multinomial``
draw per row from the softmax. Kept in that order with the same rules, a generator seeded with ``s`` draws
the tokens ``generate(do_sample=True, ...)`` draws after ``torch.manual_seed(s)`` from the same logits
(tests/hf/test_hf_sampling.py checks this token for token). A filter that is off (``top_k=0``,
``top_p=1``, ``min_p=0``, ``repetition_penalty=1``) costs nothing. :func:`check_sampling` refuses settings
out of range (``TransformerLM.generate`` and ``hybridnorm generate`` call it before any work).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hybridnorm.errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; every filter off by default (plain sampling at temperature 1)."""

    temperature: float = 1.0         # 0 (or one that rounds to 0 in fp32): greedy
    top_k: int = 0                   # keep the k most likely tokens; 0: no limit
    top_p: float = 1.0               # keep the fewest most likely tokens whose probability reaches p; 1: no limit
    min_p: float = 0.0               # drop tokens below min_p x the most likely one's probability; 0: no limit
    repetition_penalty: float = 1.0  # divide a seen token's positive logit by it, multiply a negative one; 1: none

    @property
    def greedy(self) -> bool:
        # a temperature that rounds to 0 in fp32 (the logits' dtype here) is the T -> 0 limit
        return self.temperature < torch.finfo(torch.float32).tiny

    def penalize(self, logits: Tensor, seen: Tensor | None) -> Tensor:
        """``logits`` (B, V) with the penalty applied where ``seen`` (B, V) bool is set (transformers'
        ``RepetitionPenaltyLogitsProcessor``: the prompt's tokens and those generated so far)."""
        if self.repetition_penalty == 1.0 or seen is None:
            return logits
        p, big = self.repetition_penalty, torch.finfo(logits.dtype).max
        # kept finite: a penalty far from 1 (a subnormal one, 1e300) would send logits to ±inf, and a row of
        # equal infinities to NaN in the softmax (transformers' generate stops there with an error)
        return torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits).clamp(-big, big)

    def filtered(self, logits: Tensor) -> Tensor:
        """The (B, V) logits a draw is made from: scaled by the temperature, filtered to -inf."""
        # shifted so the largest logit is 0 before dividing: a small temperature then sends the others to
        # -inf instead of every logit to ±inf and the softmax to NaN (the softmax is unchanged by the shift)
        logits = (logits - logits.amax(-1, keepdim=True)) / self.temperature
        if self.top_k:  # transformers' TopKLogitsWarper
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:  # TopPLogitsWarper: ascending order, drop the mass at or below 1 - p
            ordered, order = logits.sort(dim=-1)
            drop = ordered.softmax(-1).cumsum(-1) <= 1 - self.top_p
            drop[:, -1] = False  # the most likely token always stays
            logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        if self.min_p > 0.0:  # MinPLogitsWarper: after the temperature, relative to the most likely token
            probs = logits.softmax(-1)
            drop = probs < self.min_p * probs.amax(-1, keepdim=True)
            drop.scatter_(1, probs.argmax(-1, keepdim=True), False)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits

    def next_token(self, logits: Tensor, seen: Tensor | None = None,
                   generator: torch.Generator | None = None) -> Tensor:
        """(B, 1) token ids from ``logits`` (B, V) float; ``seen`` (B, V) bool for the repetition penalty."""
        logits = self.penalize(logits, seen)
        if self.greedy:
            return logits.argmax(-1, keepdim=True)
        return torch.multinomial(self.filtered(logits).softmax(-1), 1, generator=generator)


def check_sampling(s: Sampling, *, as_options: bool = False) -> None:
    """ConfigError naming the first setting of ``s`` out of range (NaN and infinities are out of every
    range); ``as_options``: named as the command line spells them (``--top-p``)."""
    def name(arg: str) -> str:
        return "--" + arg.replace("_", "-") if as_options else arg

    def number(x: object) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if not number(s.temperature) or s.temperature < 0:
        raise ConfigError(f"{name('temperature')}={s.temperature!r} must be a finite number >= 0 (0: greedy)")
    if not isinstance(s.top_k, int) or isinstance(s.top_k, bool) or s.top_k < 0:
        raise ConfigError(f"{name('top_k')}={s.top_k!r} must be an integer >= 0 (0: no limit)")
    if not number(s.top_p) or not 0 < s.top_p <= 1:
        raise ConfigError(f"{name('top_p')}={s.top_p!r} must be a number in (0, 1] (1: no limit)")
    if not number(s.min_p) or not 0 <= s.min_p <= 1:
        raise ConfigError(f"{name('min_p')}={s.min_p!r} must be a number in [0, 1] (0: no limit)")
    if not number(s.repetition_penalty) or s.repetition_penalty <= 0:
        raise ConfigError(f"{name('repetition_penalty')}={s.repetition_penalty!r} must be a finite number > 0 "
                          "(1: no penalty)")
