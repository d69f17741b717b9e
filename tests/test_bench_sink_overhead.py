"""bench_sink_overhead's interval for a median ratio: the order statistics it picks, and that
they cover the true median as often as they say (a seeded simulation, not a timing)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_bench_step_profile import _bench

median_interval = _bench("bench_sink_overhead").median_interval


@pytest.mark.parametrize(
    ("n", "low", "high", "coverage"),
    [
        (5, 0, 4, 1 - 2 / 32),  # min to max
        (7, 0, 6, 1 - 2 / 128),
        (8, 1, 6, 1 - 2 * (1 + 8) / 256),
        (9, 1, 7, 1 - 2 * (1 + 9) / 512),  # the 2nd smallest to the 2nd largest
        (20, 5, 14, 1 - 2 * sum(math.comb(20, i) for i in range(6)) / 2**20),
    ],
)
def test_the_interval_is_the_widest_order_statistics_with_enough_coverage(
    n: int, low: int, high: int, coverage: float
) -> None:
    values = [float(v) for v in reversed(range(n))]  # order of the input does not matter
    assert median_interval(values) == (low, high, pytest.approx(coverage))


def test_it_covers_the_true_median_at_least_as_often_as_it_claims() -> None:
    rng = np.random.default_rng(0)
    true_median = math.exp(0.0)  # lognormal(0, 0.05): skewed, like throughput ratios
    for n in (5, 7, 9, 15):
        hits, claimed = 0, None
        for _ in range(4000):
            lo, hi, claimed = median_interval(list(rng.lognormal(0.0, 0.05, size=n)))
            hits += lo <= true_median <= hi
        assert hits / 4000 >= claimed - 0.02, n  # 4,000 draws: +-0.01 of the true rate
