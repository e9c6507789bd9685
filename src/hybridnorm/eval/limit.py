"""``--limit`` / ``limit=``: how many documents of each task (or questions of ``--mc``) are scored, taken as
lm-eval's ``--limit`` takes it: a whole number N keeps the first N, a fraction between 0 and 1 the first
``ceil(fraction x count)`` (lm-eval's ``get_sample_size``), so ``--limit 0.5`` scores the same documents here
and in lm-eval. A number above 1 that is not whole is refused: lm-eval would cut 2.5 to 2 without a word."""

from __future__ import annotations

import math

from hybridnorm.errors import ConfigError


def check_limit(value: int | float | str | None, name: str = "limit") -> int | float | None:
    """``value`` (a number, or its text from the command line) as an int >= 1 or a float in (0, 1); None
    stays None (no limit); anything else is one ConfigError naming ``name``."""
    if value is None:
        return None
    given = value
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            try:
                value = float(value)
            except ValueError:
                value = math.nan
    if isinstance(value, float) and value.is_integer() and value >= 1:
        value = int(value)  # 5.0 is 5 documents, as lm-eval reads it
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (isinstance(value, int) and value >= 1) or (isinstance(value, float) and 0 < value < 1)):
        raise ConfigError(f"{name}={given!r} must be a whole number of documents >= 1 or a fraction of each "
                          f"task's documents between 0 and 1 (0.5: the first half), as lm-eval's --limit")
    return value


def limit_count(n: int, limit: int | float | None) -> int:
    """How many of ``n`` items ``limit`` keeps (all when None), rounded up as lm-eval rounds a fraction."""
    if limit is None:
        return n
    limit = check_limit(limit)
    return min(n, math.ceil(n * limit) if isinstance(limit, float) else limit)
