"""What ``hybridnorm eval --tasks`` checks of its lm-eval inputs before any request is scored: the values of
``--gen-kwargs`` (lm-eval would apply them at the first generation batch, after every other task had been
scored), integer arguments given as text, and task files under ``--include-path`` that do not parse (lm-eval
skips them without a word, so a task defined in one is only "unknown")."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridnorm.errors import ConfigError

MAX_GEN_TOKS_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # lm-eval's order


def positive_int(value: object, name: str) -> int:
    """``value`` (a model arg, a generation kwarg: often a string) as an integer >= 1, else one ConfigError."""
    try:
        n = int(value)  # model_args arrive as strings from the lm-eval command line
    except (TypeError, ValueError):
        n = 0
    if n < 1 or (isinstance(value, float) and value != n):
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    return n


def check_gen_kwargs(lm: Any, gen_kwargs: str | dict[str, Any]) -> None:
    """The values of ``gen_kwargs`` as ``lm`` (a :class:`~hybridnorm.eval.lm_eval_adapter.HybridNormLM`) checks
    them at its first generation batch (lm-eval merges them into each generation task's own, and parses a
    string as ``lm_eval --gen_kwargs`` does)."""
    from lm_eval.utils import simple_parse_args_string

    given = simple_parse_args_string(gen_kwargs) if isinstance(gen_kwargs, str) else dict(gen_kwargs)
    try:
        for key in MAX_GEN_TOKS_KEYS:
            if given.get(key) is not None:
                positive_int(given[key], key)
        lm._sampling(given)
    except ConfigError as e:
        raise ConfigError(f"gen_kwargs={gen_kwargs!r}"[:300] + f": {e}") from None


def unreadable_yaml(folders: Sequence[str | Path]) -> str:
    """``"; ... do not parse ..."`` naming the task files under ``folders`` that are not YAML (lm-eval skips
    them without a word, so a task defined there is just "unknown"); else ``""``. Composed, not constructed:
    lm-eval's tags (``!function``) need no resolving to find a syntax error, nor an alias bomb expanding."""
    import yaml

    bad = []
    for folder in folders:
        for f in sorted(Path(folder).rglob("*.y*ml")):
            try:
                list(yaml.compose_all(f.read_text(encoding="utf-8"), Loader=yaml.SafeLoader))
            except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
                bad.append(f"{f} ({' '.join(str(e).split())[:160]})")
    if not bad:
        return ""
    return f"; these task files do not parse, and lm-eval skipped them: {'; '.join(bad[:3])}" + (
        f" and {len(bad) - 3} more" if len(bad) > 3 else "")
