"""Summary statistics over seeds: mean ± std, and paired-by-seed differences with a t confidence interval.

Seeds are the unit of replication. Two placements trained with the same seed share their data order (and
an init drawn from the same generator), so the difference ``x_seed − baseline_seed`` removes the part of
the run-to-run noise they share; the interval is Student's t over those differences (n − 1 degrees of
freedom), the textbook paired test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats as _scipy_stats


def finite(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def mean_std(values: Sequence[float | None]) -> tuple[float, float]:
    """Mean and sample standard deviation (n − 1) of the finite values; NaN, NaN if there are none."""
    xs = finite(values)
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    var = sum((v - m) ** 2 for v in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
    return m, math.sqrt(var)


def fmt_mean_std(values: Sequence[float | None], digits: int = 4) -> str:
    m, s = mean_std(values)
    if not math.isfinite(m):
        return "—"
    return f"{m:.{digits}f} ± {s:.{digits}f}" if len(finite(values)) > 1 else f"{m:.{digits}f}"


@dataclass(frozen=True)
class PairedDiff:
    """``mean`` of x − baseline over the ``n`` seeds both have, with a ``level`` confidence interval."""

    n: int
    mean: float
    low: float
    high: float
    level: float = 0.95

    def to_dict(self) -> dict[str, float]:
        return {"n": self.n, "mean": self.mean, "ci_low": self.low, "ci_high": self.high, "level": self.level}

    def __str__(self) -> str:
        if self.n == 0:
            return "—"
        if self.n == 1 or not math.isfinite(self.low):
            return f"{self.mean:+.4f} (n=1, no interval)"
        return f"{self.mean:+.4f} [{self.low:+.4f}, {self.high:+.4f}]"


def paired_difference(x: dict[int, float], baseline: dict[int, float], level: float = 0.95) -> PairedDiff:
    """Paired difference over the seeds present with a finite value in both ``{seed: value}`` maps."""
    seeds = sorted(s for s in x.keys() & baseline.keys() if math.isfinite(x[s]) and math.isfinite(baseline[s]))
    diffs = [x[s] - baseline[s] for s in seeds]
    n = len(diffs)
    if n == 0:
        return PairedDiff(0, math.nan, math.nan, math.nan, level)
    m, sd = mean_std(diffs)
    if n == 1:
        return PairedDiff(1, m, math.nan, math.nan, level)
    half = float(_scipy_stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return PairedDiff(n, m, m - half, m + half, level)
