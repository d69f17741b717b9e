"""Summaries of block estimates: acceptance chains, their realizations, and intervals.

Every censored block's ``chain_p`` holds the conditional acceptance of its offsets after the
committed base (resolved a_k, then the tail model's rates), so its realized ceiling is
committed + the number of leading accepted offsets and ``point`` is the expectation. The
intervals here draw the tail model's parameters (its uncertainty) as well as the accept coin
flips, and (except ``companion_ci``) resample whole requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from dspark_obs.analytics._frames import (
    bootstrap_weights,
    is_missing,
    list_matrix,
    quantile_interval,
    request_key_array,
)
from dspark_obs.analytics.estimator_tail import TailModel

CATEGORIES = ("exact_in_window", "resolved", "diverged", "at_end", "eos")

INTERVALS = ("point_ci", "pred_ci", "companion_ci", "bracket_ci")
"""The summary's intervals; each is a ``_lo`` / ``_hi`` column pair."""

SUMMARY_COLUMNS = (
    "blocks",
    "requests",
    "censored_share",
    *[f"n_{c}" for c in CATEGORIES],
    "mean_committed",
    "mean_lo",
    "mean_mid",
    "mean_hi",
    "mean_point",
    *[f"{c}_{end}" for c in INTERVALS for end in ("lo", "hi")],
    "greedy_exact_share",
    "greedy_mean",
    "greedy_mean_lo",
    "greedy_mean_hi",
)


def chain_survival(chain_p: Sequence[Any] | pd.Series, width: int | None = None) -> np.ndarray:
    """Survival matrix [blocks, offsets]: S_j = prod_{i<=j} chain_p_i (0 past a chain's end).

    S_j = P(realized ceiling >= committed + j) of each block's acceptance chain.
    """
    values = list(chain_p)
    if width is None:
        width = max((len(v) for v in values if not is_missing(v)), default=0)
    p = np.clip(np.nan_to_num(list_matrix(values, width), nan=0.0), 0.0, 1.0)
    return np.cumprod(p, axis=1)


def draw_leading(surv: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Leading accepted offsets per block for uniforms ``u`` in [0, 1): L = #{j: u < S_j}.

    S is non-increasing along a row, so P(L >= j) = S_j: one uniform per block realizes the
    whole chain (offset j accepted with prob a_j given every earlier offset was).
    """
    s = np.asarray(surv, dtype=np.float64)
    u = np.asarray(u, dtype=np.float64)
    out = np.zeros(u.shape, dtype=np.int64)
    for j in range(s.shape[-1]):
        out += u < s[..., j]
    return out


def sample_ceilings(
    committed: np.ndarray | Sequence[float],
    chain_p: Sequence[Any] | pd.Series,
    rng: np.random.Generator,
    size: int | None = None,
) -> np.ndarray:
    """Draw realized ceilings committed + L per block: [blocks], or [size, blocks] draws.

    Same convention as ``point`` (DESIGN: acc_len + cap_trim), whose value is their mean.
    """
    base = np.asarray(committed, dtype=np.float64)
    surv = chain_survival(chain_p)
    shape = base.shape if size is None else (int(size), *base.shape)
    return base + draw_leading(surv, rng.random(shape))


def _chain_matrices(
    g: pd.DataFrame,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(chains [n, W] NaN-padded, tail mask, tail positions, tail confidences, workloads):
    where each block's chain comes from the tail model, so draws can replace it."""
    lens = np.array([0 if is_missing(v) else len(v) for v in g["chain_p"]], dtype=np.int64)
    width = int(lens.max()) if lens.size else 0
    chains = list_matrix(list(g["chain_p"]), width)
    mask = np.zeros(chains.shape, dtype=bool)
    pos = np.zeros(chains.shape, dtype=np.int64)
    conf = np.full(chains.shape, np.nan)
    if "tail_conf" in g.columns and width:
        tl = np.array([0 if is_missing(v) else len(v) for v in g["tail_conf"]], dtype=np.int64)
        start = lens - tl
        col = np.arange(width)[None, :]
        mask = (col >= start[:, None]) & (col < lens[:, None])
        last_k = g["last_k"].to_numpy(np.int64)
        pos = last_k[:, None] + 1 + (col - start[:, None])
        tc = list_matrix(list(g["tail_conf"]), width)
        idx = np.clip(col - start[:, None], 0, width - 1)
        conf = np.where(mask, np.take_along_axis(tc, idx, axis=1), np.nan)
    wl = np.broadcast_to(g["workload"].to_numpy().astype(str)[:, None], chains.shape)
    return chains, mask, pos, conf, wl


REALIZATIONS_PER_DRAW = 20
"""Chain realizations per tail-parameter draw for ``companion_ci``: its quantiles are read
from n_boot x this many totals, so they rest on thousands of samples, not n_boot."""


def _ceiling_draws(
    g: pd.DataFrame, tail_model: Any, n_draws: int, seed: int, n_real: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per draw: expected and realized ceiling of every block, [n_draws, blocks] each, and
    the realized total over the blocks of ``n_real`` realizations per draw [n_draws * n_real].

    Draw d takes the tail model's parameter draw d (its uncertainty; the MAP chain when the
    model is fixed or absent), then realizes every chain with one uniform per block.
    """
    committed = g["committed"].to_numpy(np.float64)
    chains, mask, pos, conf, wl = _chain_matrices(g)
    base = np.clip(np.nan_to_num(chains, nan=0.0), 0.0, 1.0)
    params = (
        tail_model.draws(n_draws, seed)
        if tail_model is not None and mask.any() and not tail_model.fixed
        else [None] * n_draws
    )
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x9E3779B9]))
    expected = np.empty((n_draws, len(g)))
    realized = np.empty((n_draws, len(g)))
    totals = np.empty((n_draws, n_real))
    for d, theta in enumerate(params):
        p = base
        if theta is not None:
            p = base.copy()
            p[mask] = np.clip(tail_model.rates(pos[mask], conf[mask], wl[mask], theta), 0.0, 1.0)
        surv = np.cumprod(p, axis=1)
        expected[d] = committed + surv.sum(axis=1)
        leading = draw_leading(surv, rng.random((n_real, len(g))))
        realized[d] = committed + leading[0]
        totals[d] = committed.sum() + leading.sum(axis=1)
    return expected, realized, totals.ravel()


def lattice_interval(
    totals: np.ndarray, level: float, rng: np.random.Generator
) -> tuple[float, float]:
    """A ``level`` interval for an integer-valued total from predictive samples of it.

    Why not the samples' percentiles: the companion's total (committed + cap_trim summed over
    blocks) is an integer, and a closed percentile interval of an integer distribution also
    holds the atoms at both ends, so it covers far more than ``level`` when the total's
    spread is a few tokens (issue 21: 0.99 at 95%). Here each sample is spread uniformly
    over its unit cell (a continuous distribution G), G's percentiles are taken and the
    interval is shifted by one uniform draw in (-1/2, 1/2): it then holds the total with
    probability exactly ``level`` when the samples follow its distribution (a randomized
    interval, as for discrete tests; the shift is at most half a token of the total, i.e.
    0.5 / blocks of the mean). A degenerate total (every block exact, or 0/1 chains)
    gives the point itself, so exact cases stay exact.
    """
    t = np.asarray(totals, dtype=np.float64)
    t = t[np.isfinite(t)]
    if t.size == 0:
        return float("nan"), float("nan")
    if t.min() == t.max():
        return float(t[0]), float(t[0])
    if not np.array_equal(t, np.round(t)):  # not a lattice: plain percentiles
        return quantile_interval(t, level)
    lo, hi = quantile_interval(t + rng.uniform(-0.5, 0.5, t.size), level)
    shift = float(rng.uniform(-0.5, 0.5))
    return lo + shift, hi + shift


def _resampled_means(values: np.ndarray, codes: np.ndarray, wts: np.ndarray) -> np.ndarray:
    """Mean over blocks per bootstrap draw, whole requests resampled (``wts`` [n_boot, n_req]
    counts); ``values`` per block [blocks], or one row per draw [n_boot, blocks]."""
    n_req = wts.shape[1]
    cnt = wts @ np.bincount(codes, minlength=n_req)
    if values.ndim == 1:
        return (wts @ np.bincount(codes, weights=values, minlength=n_req)) / cnt
    sums = np.stack([np.bincount(codes, weights=v, minlength=n_req) for v in values])
    return (wts * sums).sum(axis=1) / cnt


def summarize_blocks(
    blocks: pd.DataFrame,
    by: Sequence[str] = ("workload",),
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
    tail_model: Any = None,
) -> pd.DataFrame:
    """Means over blocks per group, with intervals (seeded, percentile, ``n_boot`` draws).

    Every draw takes a parameter draw of ``tail_model`` (the estimate's ``.tail_model``; the
    tail model's uncertainty; none when absent or fixed) and realizes every block's chain.
    point_ci: requests resampled, expected ceilings: the *expected* mean ceiling of traffic
    like this. pred_ci: requests resampled, realized ceilings: the realized mean ceiling of
    traffic like this. companion_ci: the same blocks, realized ceilings: where the mean
    ceiling a cap-accept companion of *this* run measures should fall (the one to hold to
    the nominal level against its companion; issue 21's validation). All equal the mean
    where every chain is 0/1 (greedy, exact blocks) and requests are not resampled.
    bracket_ci: lower percentile of mean lo to upper percentile of mean hi (request
    resampling, SGLang's bracket). greedy_mean is the mean exact ceiling, NaN unless every
    block is exact.
    """
    by = list(by)
    rows = []
    groups = [((), blocks)] if not by else blocks.groupby(by, sort=True)
    for key, g in groups:
        if len(g) == 0:
            continue
        key = key if isinstance(key, tuple) else (key,)
        row: dict[str, Any] = dict(zip(by, key, strict=True))
        reqs = request_key_array(g["run_id"].to_numpy(object), g["rid"].to_numpy(object))
        reqs = reqs.astype(str)  # np.unique below sorts: one string dtype
        uniq, codes = np.unique(reqs, return_inverse=True)
        row["blocks"] = len(g)
        row["requests"] = int(uniq.size)
        row["censored_share"] = float(g["censored"].mean())
        for c in CATEGORIES:
            row[f"n_{c}"] = int((g["category"] == c).sum())
        for name in ("committed", "lo", "mid", "hi", "point"):
            row[f"mean_{name}"] = float(g[name].mean())
        for c in INTERVALS:
            row[f"{c}_lo"] = row[f"{c}_hi"] = float("nan")
        if n_boot > 0:
            wts = bootstrap_weights(uniq.size, n_boot, seed)

            for name in ("lo", "hi"):
                q = quantile_interval(
                    _resampled_means(g[name].to_numpy(np.float64), codes, wts), level
                )
                row[f"bracket_ci_{name}"] = q[0] if name == "lo" else q[1]
            if "chain_p" in g.columns:
                expected, realized, totals = _ceiling_draws(
                    g, tail_model, n_boot, seed, REALIZATIONS_PER_DRAW
                )
                row["point_ci_lo"], row["point_ci_hi"] = quantile_interval(
                    _resampled_means(expected, codes, wts), level
                )
                row["pred_ci_lo"], row["pred_ci_hi"] = quantile_interval(
                    _resampled_means(realized, codes, wts), level
                )
                rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x1A77]))
                lo, hi = lattice_interval(totals, level, rng)
                row["companion_ci_lo"], row["companion_ci_hi"] = lo / len(g), hi / len(g)
            else:
                q = quantile_interval(
                    _resampled_means(g["point"].to_numpy(np.float64), codes, wts), level
                )
                row["point_ci_lo"], row["point_ci_hi"] = q
        ex = g["greedy_exact"].to_numpy(dtype=bool)
        row["greedy_exact_share"] = float(ex.mean())
        row["greedy_mean"] = float(g["greedy_ceiling"].mean()) if ex.all() else float("nan")
        row["greedy_mean_lo"] = float(g["greedy_lo"].mean())
        row["greedy_mean_hi"] = float(g["greedy_hi"].mean())
        rows.append(row)
    return pd.DataFrame(rows, columns=[*by, *SUMMARY_COLUMNS])


@dataclass
class BlockEstimate:
    """Per-block brackets and estimates, the tail model used, and data problems found."""

    blocks: pd.DataFrame
    problems: list[str]
    tail: str
    tail_model: TailModel | None = None
    observations: pd.DataFrame | None = None
    """The tail-model observations these rows gave (``OBS_COLUMNS``), so a live consumer
    can fit later rows' tail model on them."""

    def summary(
        self,
        by: Sequence[str] = ("workload",),
        n_boot: int = 200,
        seed: int = 0,
        level: float = 0.95,
    ) -> pd.DataFrame:
        """:func:`summarize_blocks` of these blocks, redrawing the tail model's parameters."""
        return summarize_blocks(
            self.blocks, by=by, n_boot=n_boot, seed=seed, level=level, tail_model=self.tail_model
        )
