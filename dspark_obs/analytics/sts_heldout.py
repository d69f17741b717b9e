"""STS fitted on some requests and judged on the others, with intervals over requests.

Whole requests go to one side of the split (steps of a request share a prompt and a cache,
so a step-level split would judge the fit on near-copies of its own data); ECE before and
after comes with bootstrap intervals over the held-out requests and one verdict
(:func:`~dspark_obs.analytics.sts_verdict.sts_verdict`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dspark_obs.analytics._frames import bootstrap_weights, quantile_interval
from dspark_obs.analytics.calibration import N_BINS, _ece_from_bins, bin_index, clamp_probs
from dspark_obs.analytics.sts import (
    StsData,
    ece_by_workload,
    fit_sts,
    pooled_ece,
    position_ece,
    survival_labels,
)
from dspark_obs.analytics.sts_verdict import MIN_HELDOUT_REQUESTS, StsVerdict, sts_verdict
from dspark_obs.sts_file import StsCalibration


@dataclass
class StsHeldout:
    """A fit on some requests, judged on the others."""

    calibration: StsCalibration
    fit_requests: int
    heldout_requests: int
    ece_before: list[float]  # per position, held-out, T = 1
    ece_after: list[float]  # per position, held-out, fitted T
    pooled_before: float
    pooled_after: float
    by_workload: pd.DataFrame  # workload, requests, samples, ece_before, ece_after (held-out)
    after_ci: tuple[float, float] = (float("nan"), float("nan"))
    """Bootstrap interval (over held-out requests) of ``pooled_after``."""
    change_ci: tuple[float, float] = (float("nan"), float("nan"))
    """Bootstrap interval of ``pooled_after - pooled_before`` (same resamples)."""

    @property
    def few_heldout(self) -> bool:
        """Too few held-out requests for the ECE comparison to mean much."""
        return self.heldout_requests < MIN_HELDOUT_REQUESTS

    @property
    def worse(self) -> bool:
        """ECE after STS is higher than before on the held-out requests."""
        return bool(self.pooled_after > self.pooled_before)

    def verdict(self) -> StsVerdict:
        """ok | too few to trust | worse: do not serve (:func:`sts_verdict`)."""
        return sts_verdict(
            self.pooled_before,
            self.pooled_after,
            self.heldout_requests,
            fit_requests=self.fit_requests,
            after_ci=self.after_ci,
            change_ci=self.change_ci,
        )

    def caveats(self) -> list[str]:
        """Plain-language flags a reader must see next to the numbers (empty when none)."""
        return self.verdict().reasons


def split_requests(keys: np.ndarray, heldout_frac: float, seed: int) -> np.ndarray:
    """Boolean mask of held-out rows: whole requests go to one side (seeded permutation)."""
    uniq = np.unique(np.asarray(keys, dtype=str))
    rng = np.random.default_rng(seed)
    perm = rng.permutation(uniq.size)
    n_held = int(round(heldout_frac * uniq.size))
    if uniq.size >= 2:
        n_held = min(max(n_held, 1), uniq.size - 1)
    held = set(uniq[perm[:n_held]].tolist())
    return np.array([k in held for k in np.asarray(keys, dtype=str)], dtype=bool)


def _request_bins(
    test: StsData, temperatures: Sequence[float] | None, inverse: np.ndarray, n: int, n_bins: int
) -> np.ndarray:
    """Per request, the ECE bin sums (count, pred sum, label sum): [3, n_requests, n_bins]."""
    s, labels, obs = survival_labels(test.logits, test.prefix_mask, temperatures, test.observed)
    p = clamp_probs(s[obs])
    y = labels[obs]
    req = np.broadcast_to(inverse[:, None], obs.shape)[obs]
    cell = req * n_bins + bin_index(p, n_bins)
    size = n * n_bins
    return np.stack(
        [
            np.bincount(cell, minlength=size).astype(np.float64),
            np.bincount(cell, weights=p, minlength=size),
            np.bincount(cell, weights=y, minlength=size),
        ]
    ).reshape(3, n, n_bins)


def _heldout_intervals(
    test: StsData, temperatures: Sequence[float], n_bins: int, n_boot: int, seed: int
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Percentile intervals of ECE after, and of after - before, resampling whole requests.

    Each request's bin sums are computed once; a resample is a weighted sum of them, so the
    bootstrap costs one matrix product instead of ``n_boot`` ECE passes.
    """
    nan = (float("nan"), float("nan"))
    if test.request is None or len(test.logits) == 0 or n_boot < 1:
        return nan, nan
    keys, inverse = np.unique(np.asarray(test.request, dtype=str), return_inverse=True)
    w = bootstrap_weights(keys.size, n_boot, seed)  # [n_boot, n_requests]
    after = _ece_from_bins(
        *np.einsum("br,krm->kbm", w, _request_bins(test, temperatures, inverse, keys.size, n_bins))
    )
    before = _ece_from_bins(
        *np.einsum("br,krm->kbm", w, _request_bins(test, None, inverse, keys.size, n_bins))
    )
    return quantile_interval(after, 0.95), quantile_interval(after - before, 0.95)


def fit_sts_heldout(
    data: StsData,
    heldout_frac: float = 0.3,
    seed: int = 0,
    n_bins: int = N_BINS,
    n_boot: int = 200,
) -> StsHeldout:
    """Fit on a request split, report ECE before/after on held-out requests only, with
    bootstrap intervals over the held-out requests (``n_boot`` resamples)."""
    if data.request is None:
        raise ValueError("a request split needs StsData.request")
    held = split_requests(data.request, heldout_frac, seed)
    fit_part, test = data.subset(~held), data.subset(held)
    if len(fit_part.logits) == 0:
        raise ValueError("no request left to fit on")
    cal = fit_sts(fit_part.logits, fit_part.prefix_mask, fit_part.observed, n_bins=n_bins)
    after_ci, change_ci = _heldout_intervals(test, cal.temperatures, n_bins, n_boot, seed)
    return StsHeldout(
        calibration=cal,
        fit_requests=int(np.unique(fit_part.request).size),
        heldout_requests=int(np.unique(test.request).size) if test.request is not None else 0,
        ece_before=position_ece(
            test.logits, test.prefix_mask, None, test.observed, n_bins
        ).tolist(),
        ece_after=position_ece(
            test.logits, test.prefix_mask, cal.temperatures, test.observed, n_bins
        ).tolist(),
        pooled_before=pooled_ece(test.logits, test.prefix_mask, None, test.observed, n_bins),
        pooled_after=pooled_ece(
            test.logits, test.prefix_mask, cal.temperatures, test.observed, n_bins
        ),
        by_workload=ece_by_workload(test, cal.temperatures, n_bins),
        after_ci=after_ci,
        change_ci=change_ci,
    )
