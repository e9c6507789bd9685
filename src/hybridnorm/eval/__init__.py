"""Evaluation of trained runs: log-likelihood scoring on a TransformerLM, zero-shot multiple choice,
document perplexity (tokens, bits per byte, words), and an lm-eval-harness adapter.

lm-eval is an optional dependency (``pip install 'hybridnorm[eval]'``): importing this package never
imports it; :func:`run_lm_eval` and :class:`HybridNormLM` are loaded from ``lm_eval_adapter`` on first use
and raise :class:`~hybridnorm.errors.ConfigError` when it is missing.
"""

from typing import Any

from hybridnorm.eval.multiple_choice import MCItem, MCItemResult, MCResult, evaluate_mc, read_mc_jsonl
from hybridnorm.eval.paths import TASKS_DIR
from hybridnorm.eval.perplexity import PerplexityResult, perplexity, perplexity_of_run, read_documents
from hybridnorm.eval.scoring import (
    encode_pair,
    greedy_until,
    loglikelihood,
    loglikelihood_rolling,
    loglikelihood_rolling_text,
    loglikelihood_text,
)

_LAZY = ("run_lm_eval", "HybridNormLM")


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # imports lm_eval only when asked for
        from hybridnorm.eval import lm_eval_adapter

        return getattr(lm_eval_adapter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "TASKS_DIR", "HybridNormLM", "MCItem", "MCItemResult", "MCResult", "PerplexityResult", "encode_pair",
    "evaluate_mc", "greedy_until", "loglikelihood", "loglikelihood_rolling", "loglikelihood_rolling_text",
    "loglikelihood_text", "perplexity", "perplexity_of_run", "read_documents", "read_mc_jsonl", "run_lm_eval",
]
