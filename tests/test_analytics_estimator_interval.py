"""The companion interval of an integer-valued total holds it at the nominal level.

The companion's total ceiling (committed + cap_trim over the blocks) is an integer; a closed
percentile interval of integer samples also holds the atoms at both of its ends, which is why
the sweep measured 0.99 at 95% (issue 21). :func:`lattice_interval` is exact in distribution.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_obs.analytics._frames import quantile_interval
from dspark_obs.analytics.estimator_summary import lattice_interval


def _coverage(truths: np.ndarray, intervals: list[tuple[float, float]]) -> float:
    lo, hi = np.array(intervals).T
    return float(((lo <= truths) & (truths <= hi)).mean())


@pytest.mark.parametrize(("n", "p"), [(1, 0.7), (3, 0.6), (12, 0.5), (40, 0.8)])
def test_randomized_interval_covers_at_the_nominal_level(n: int, p: float) -> None:
    rng = np.random.default_rng(7)
    reps = 3000
    samples = rng.binomial(n, p, size=(reps, 1000)).astype(np.float64)
    truths = rng.binomial(n, p, size=reps).astype(np.float64)
    randomized = [
        lattice_interval(s, 0.95, np.random.default_rng(i)) for i, s in enumerate(samples)
    ]
    # 3000 replicates measure a coverage to about +-0.008 (one sd 0.004)
    covered = _coverage(truths, randomized)
    assert covered == pytest.approx(0.95, abs=0.016)
    closed = [quantile_interval(s, 0.95) for s in samples]
    assert _coverage(truths, closed) > covered  # what the percentile interval did


def test_degenerate_total_gives_the_point_and_non_lattice_samples_percentiles() -> None:
    rng = np.random.default_rng(0)
    assert lattice_interval(np.full(100, 37.0), 0.95, rng) == (37.0, 37.0)
    x = rng.normal(10.0, 1.0, 5000)
    assert lattice_interval(x, 0.95, rng) == quantile_interval(x, 0.95)
    assert all(np.isnan(lattice_interval(np.array([np.nan]), 0.95, rng)))


def test_shift_is_at_most_half_a_unit() -> None:
    samples = np.random.default_rng(1).binomial(20, 0.5, 3000).astype(np.float64)
    spread = quantile_interval(samples + np.random.default_rng(2).uniform(-0.5, 0.5, 3000), 0.95)
    for seed in range(50):
        lo, hi = lattice_interval(samples, 0.95, np.random.default_rng(seed))
        assert abs(lo - spread[0]) <= 0.5 + 0.2 and abs(hi - spread[1]) <= 0.5 + 0.2
        assert hi - lo == pytest.approx(spread[1] - spread[0], abs=0.4)
