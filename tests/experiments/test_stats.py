"""Mean ± std and the paired-by-seed difference against hand computations (t quantiles from the table)."""

import math
import statistics

import pytest

from hybridnorm.experiments.stats import fmt_mean_std, mean_std, paired_difference


def test_mean_std_is_the_sample_std_of_the_finite_values():
    xs = [5.1, 5.3, 4.9, math.nan]
    m, s = mean_std(xs)
    assert m == pytest.approx(statistics.mean(xs[:3])) and s == pytest.approx(statistics.stdev(xs[:3]))
    assert math.isnan(mean_std([math.nan])[0])
    assert fmt_mean_std([5.0]) == "5.0000" and fmt_mean_std([]) == "—"


def test_paired_difference_matches_the_t_table():
    base = {0: 5.0, 1: 5.2, 2: 5.1}
    x = {0: 4.9, 1: 5.0, 2: 5.1}           # differences -0.1, -0.2, 0.0: mean -0.1, sd 0.1
    d = paired_difference(x, base)
    t975_df2 = 4.302652729911275           # Student t, 97.5th percentile, 2 degrees of freedom (tables)
    half = t975_df2 * 0.1 / math.sqrt(3)
    assert d.n == 3 and d.mean == pytest.approx(-0.1)
    assert (d.low, d.high) == (pytest.approx(-0.1 - half), pytest.approx(-0.1 + half))


def test_paired_difference_uses_only_seeds_both_have():
    d = paired_difference({0: 1.0, 1: 2.0, 3: math.nan}, {1: 1.5, 2: 0.0, 3: 1.0})
    assert d.n == 1 and d.mean == pytest.approx(0.5) and math.isnan(d.low)
    assert "n=1" in str(d)
    assert paired_difference({}, {0: 1.0}).n == 0
