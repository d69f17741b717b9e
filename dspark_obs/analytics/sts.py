"""Sequential temperature scaling (STS) of the confidence head, SGLang-compatible.

The fitter is SGLang 0.5.23's (benchmark/dspark_sts_fit.py), restated: positions in order;
for position k the candidate temperatures are the 41 values of
``torch.logspace(log10(0.1), log10(10), 41)`` (float32, as SGLang builds them, so fitted
values read e.g. 0.10000000149011612); each candidate gives the cumulative survival
``S_k = S_{k-1}^fitted * sigmoid(z_k / T)`` and its ECE (15 equal-width bins) against the
prefix label; the first candidate with the strictly smallest ECE wins. ``ece_before`` is the
same ECE for T = 1 at every position. Confidence at serve time: c_k = sigmoid(z_k / T_k).

One addition: an ``observed`` mask, so compact-mode data (positions past a fully accepted
window are unobserved) can be fitted without counting them as rejections. With no mask the
result is SGLang's. A position with no observed sample keeps T = 1 (SGLang never meets one).

The STS JSON file is :mod:`dspark_obs.sts_file`; SGLang's collection shards are
:mod:`dspark_obs.analytics.sts_shards`; fitting on some requests and judging on the others is
:mod:`dspark_obs.analytics.sts_heldout`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dspark_obs.analytics._frames import FrameLike, request_keys, text_column
from dspark_obs.analytics.calibration import N_BINS, ece, wide_labels
from dspark_obs.sts_file import StsCalibration

GRID_SIZE = 41
# Confidences are stored rounded to 4 decimals; 0.0 / 1.0 would give infinite logits.
# Clamp half a rounding unit in from the ends.
CONF_EPS = 5e-5


# ---------------------------------------------------------------- numerics


def temperature_grid(size: int = GRID_SIZE) -> np.ndarray:
    """SGLang's candidate temperatures (float32 logspace 0.1..10, widened to float64)."""
    try:
        import torch

        return (
            torch.logspace(math.log10(0.1), math.log10(10.0), steps=size).to(torch.float64).numpy()
        )
    except ImportError:  # pragma: no cover - torch is a project dependency
        return np.logspace(-1.0, 1.0, size, dtype=np.float32).astype(np.float64)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function in float64; 1/(1+exp(-x)) as torch computes it (inf-safe)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def logit(conf: np.ndarray, eps: float = CONF_EPS) -> np.ndarray:
    """Raw confidence logit z from a stored confidence (clamped: stored values are rounded)."""
    c = np.clip(np.asarray(conf, dtype=np.float64), eps, 1.0 - eps)
    return np.log(c) - np.log1p(-c)


def apply_sts(conf_logits: np.ndarray, temperatures: Sequence[float] | np.ndarray) -> np.ndarray:
    """Calibrated confidences c_k = sigmoid(z_k / T_k) for z of shape [n, gamma] (or [gamma])."""
    z = np.asarray(conf_logits, dtype=np.float64)
    t = np.asarray(temperatures, dtype=np.float64)
    if z.shape[-1] != t.shape[-1]:
        raise ValueError(
            f"logits have {z.shape[-1]} positions but {t.shape[-1]} temperatures were given"
        )
    if not np.all(np.isfinite(t) & (t > 0)):
        raise ValueError(f"temperatures must all be finite and > 0, got {t.tolist()}")
    return sigmoid(z / t)


def survival(conf: np.ndarray) -> np.ndarray:
    """S_j = prod_{i<=j} c_i along the last axis."""
    return np.cumprod(np.asarray(conf, dtype=np.float64), axis=-1)


def survival_labels(
    conf_logits: np.ndarray,
    prefix_mask: np.ndarray,
    temperatures: Sequence[float] | np.ndarray | None = None,
    observed: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(survival under ``temperatures`` (None: all 1), prefix labels, observed mask) as
    float64 / bool arrays [n, gamma]: what every ECE of a fit is computed from."""
    z = np.asarray(conf_logits, dtype=np.float64)
    t = np.ones(z.shape[1]) if temperatures is None else np.asarray(temperatures, dtype=np.float64)
    y = np.asarray(prefix_mask, dtype=np.float64)
    obs = np.ones_like(y, dtype=bool) if observed is None else np.asarray(observed, dtype=bool)
    return survival(apply_sts(z, t)), y, obs


def position_ece(
    conf_logits: np.ndarray,
    prefix_mask: np.ndarray,
    temperatures: Sequence[float] | np.ndarray | None = None,
    observed: np.ndarray | None = None,
    n_bins: int = N_BINS,
) -> np.ndarray:
    """Per-position ECE of the cumulative survival under ``temperatures`` (None: all 1)."""
    s, y, obs = survival_labels(conf_logits, prefix_mask, temperatures, observed)
    return np.array([ece(s[obs[:, k], k], y[obs[:, k], k], n_bins) for k in range(s.shape[1])])


def pooled_ece(
    conf_logits: np.ndarray,
    prefix_mask: np.ndarray,
    temperatures: Sequence[float] | np.ndarray | None = None,
    observed: np.ndarray | None = None,
    n_bins: int = N_BINS,
) -> float:
    """ECE over all observed (sample, position) pairs at once: one number per data set."""
    s, y, obs = survival_labels(conf_logits, prefix_mask, temperatures, observed)
    return ece(s[obs], y[obs], n_bins)


# ---------------------------------------------------------------- fitting


def fit_sts(
    conf_logits: np.ndarray,
    prefix_mask: np.ndarray,
    observed: np.ndarray | None = None,
    grid: Sequence[float] | np.ndarray | None = None,
    n_bins: int = N_BINS,
    dataset: str = "",
) -> StsCalibration:
    """Fit per-position temperatures exactly as SGLang's fitter (plus the observed mask)."""
    z = np.asarray(conf_logits, dtype=np.float64)
    y = np.asarray(prefix_mask, dtype=np.float64)
    if z.ndim != 2 or z.shape != y.shape:
        raise ValueError(f"logits {z.shape} and prefix_mask {y.shape} must both be [n, gamma]")
    n, gamma = z.shape
    if n == 0:
        raise ValueError("fit_sts needs at least one sample")
    obs = np.ones((n, gamma), dtype=bool) if observed is None else np.asarray(observed, dtype=bool)
    candidates = [float(t) for t in (temperature_grid() if grid is None else grid)]
    temps, before, after = [], [], []
    s_raw = np.ones(n)
    s_fit = np.ones(n)
    for k in range(gamma):
        m = obs[:, k]
        yk = y[m, k]
        s_raw = s_raw * sigmoid(z[:, k])
        before.append(ece(s_raw[m], yk, n_bins))
        if not m.any():
            temps.append(1.0)
            after.append(float("nan"))
            s_fit = s_fit * sigmoid(z[:, k])
            continue
        best_t = candidates[0]
        best_s = s_fit * sigmoid(z[:, k] / best_t)
        best_e = ece(best_s[m], yk, n_bins)
        for t in candidates[1:]:
            cand = s_fit * sigmoid(z[:, k] / t)
            e = ece(cand[m], yk, n_bins)
            if e < best_e:
                best_t, best_s, best_e = t, cand, e
        temps.append(float(best_t))
        after.append(float(best_e))
        s_fit = best_s
    return StsCalibration(temps, dataset, int(n), before, after)


# ---------------------------------------------------------------- data sources


@dataclass
class StsData:
    """Inputs of a fit: raw logits z, prefix labels, what was observed, who each row belongs to."""

    logits: np.ndarray  # [n, gamma]
    prefix_mask: np.ndarray  # [n, gamma] float 0/1 (0 where unobserved)
    observed: np.ndarray  # [n, gamma] bool
    request: np.ndarray | None = None  # [n] request key, for splitting by request
    workload: np.ndarray | None = None  # [n]

    @property
    def gamma(self) -> int:
        return int(self.logits.shape[1])

    def subset(self, rows: np.ndarray) -> StsData:
        return StsData(
            self.logits[rows],
            self.prefix_mask[rows],
            self.observed[rows],
            None if self.request is None else self.request[rows],
            None if self.workload is None else self.workload[rows],
        )


def sts_data_from_req_steps(
    req_steps: FrameLike, runs: FrameLike | Mapping[str, str] | None = None, mode: str | None = None
) -> StsData:
    """Logits from stored confidences (z = logit(c), c rounded to 4 decimals), censored labels.

    If the run served with an STS file, stored confidences are already calibrated and the
    temperatures fitted here compose with the served ones (T_new * T_served). Rows lacking a
    full confidence vector are dropped; all rows must share one gamma.
    """
    wl = wide_labels(req_steps, runs, mode)
    df = wl.frame
    if len(df) and len(np.unique(wl.gamma)) > 1:
        raise ValueError(
            f"req_steps mix gammas {sorted(set(wl.gamma.tolist()))}; fit one gamma at a time"
        )
    keep = ~np.isnan(np.where(wl.valid, wl.conf, 0.0)).any(axis=1)
    return StsData(
        logit(wl.conf[keep]),
        np.nan_to_num(wl.label[keep], nan=0.0),
        wl.observed[keep],
        request_keys(df.loc[keep]).astype(str),
        text_column(df.loc[keep], "workload", "unknown"),
    )


BY_WORKLOAD_COLUMNS = ("workload", "requests", "samples", "ece_before", "ece_after")


def ece_by_workload(
    data: StsData, temperatures: Sequence[float] | None, n_bins: int = N_BINS
) -> pd.DataFrame:
    """Per workload: requests, observed samples, pooled ECE at T = 1 and under
    ``temperatures`` (columns :data:`BY_WORKLOAD_COLUMNS`; empty without workloads)."""
    rows = []
    if data.workload is not None:
        for wk in sorted(set(data.workload.tolist())):
            part = data.subset(data.workload == wk)
            rows.append(
                {
                    "workload": wk,
                    "requests": 0 if part.request is None else int(np.unique(part.request).size),
                    "samples": int(part.observed.sum()),
                    "ece_before": pooled_ece(
                        part.logits, part.prefix_mask, None, part.observed, n_bins
                    ),
                    "ece_after": pooled_ece(
                        part.logits, part.prefix_mask, temperatures, part.observed, n_bins
                    ),
                }
            )
    return pd.DataFrame(rows, columns=list(BY_WORKLOAD_COLUMNS))
