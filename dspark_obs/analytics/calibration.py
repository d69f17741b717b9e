"""Calibration of the drafter's confidence head, per draft position, censoring-aware.

Words as in DESIGN.md: confidence c_j (conditional), survival S_j = prod_{i<=j} c_i, prefix
label 1[j <= correct_drafts]. The prediction scored against the prefix label is S_j.

Censoring (why this module exists instead of a one-line ECE): in ``compact`` a step with
window w = verify_len (anchor included) verifies drafts 1..w-1 only. If all of them were
accepted (correct_drafts = w-1), positions j >= w were never tested: they are *unobserved*
and are dropped, never counted as rejections. If a draft was rejected inside the window,
all later prefix labels are known to be 0. In ``cap-accept`` the whole block was verified,
so the full accept count correct_drafts + cap_trim labels every position. ``static``
verifies everything. (Code below calls verify_len - 1 ``verified``: SGLang's JSONL "w".)

The ECE below is SGLang 0.5.23's definition (benchmark/dspark_sts_fit.py
``expected_calibration_error``): float64, clamp to [1e-8, 1-1e-8], bin =
int(p * n_bins) clamped to [0, n_bins-1], sum_b n_b |mean_pred_b - mean_label_b| / N, NaN
for no samples. Everything else here (equal-mass ECE, MCE, Brier, AUROC, bootstrap CIs) is
an addition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dspark_obs.analytics._frames import (
    FrameLike,
    as_frame,
    bootstrap_weights,
    column,
    group_items,
    list_matrix,
    mode_of_rows,
    quantile_interval,
    request_keys,
    text_column,
)

EPS_PROB = 1e-8
N_BINS = 15

LABEL_COLUMNS = (
    "run_id",
    "dp_rank",
    "rid",
    "forward_ct",
    "workload",
    "position",
    "pred",
    "conf",
    "label",
    "observed",
    "at_risk",
    "verified",
    "gamma",
)


# ---------------------------------------------------------------- metrics on arrays


def clamp_probs(pred: np.ndarray) -> np.ndarray:
    return np.clip(np.asarray(pred, dtype=np.float64).ravel(), EPS_PROB, 1.0 - EPS_PROB)


def bin_index(pred: np.ndarray, n_bins: int = N_BINS) -> np.ndarray:
    """SGLang's bin of each (clamped) probability: truncate, then clamp to the last bin."""
    return np.clip((np.asarray(pred, dtype=np.float64) * n_bins).astype(np.int64), 0, n_bins - 1)


def _bin_sums(
    pred: np.ndarray, label: np.ndarray, n_bins: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p = clamp_probs(pred)
    y = np.asarray(label, dtype=np.float64).ravel()
    b = bin_index(p, n_bins)
    count = np.bincount(b, minlength=n_bins).astype(np.float64)
    psum = np.bincount(b, weights=p, minlength=n_bins)
    ysum = np.bincount(b, weights=y, minlength=n_bins)
    return count, psum, ysum


def _ece_from_bins(count: np.ndarray, psum: np.ndarray, ysum: np.ndarray) -> np.ndarray:
    """ECE from (possibly batched, [..., n_bins]) bin sums; NaN where there are no samples."""
    total = count.sum(axis=-1)
    denom = np.maximum(count, 1.0)
    err = np.abs(psum / denom - ysum / denom)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (err * count).sum(axis=-1) / total
    return np.where(total > 0, out, np.nan)


def _mce_from_bins(count: np.ndarray, psum: np.ndarray, ysum: np.ndarray) -> np.ndarray:
    denom = np.maximum(count, 1.0)
    err = np.where(count > 0, np.abs(psum / denom - ysum / denom), -np.inf)
    out = err.max(axis=-1)
    return np.where(np.isfinite(out), out, np.nan)


def ece(pred: np.ndarray, label: np.ndarray, n_bins: int = N_BINS) -> float:
    """Expected calibration error, SGLang's parity definition (equal-width bins)."""
    if np.asarray(pred).size == 0:
        return float("nan")
    return float(_ece_from_bins(*_bin_sums(pred, label, n_bins)))


def mce(pred: np.ndarray, label: np.ndarray, n_bins: int = N_BINS) -> float:
    """Maximum calibration error over the non-empty equal-width bins."""
    if np.asarray(pred).size == 0:
        return float("nan")
    return float(_mce_from_bins(*_bin_sums(pred, label, n_bins)))


def ece_equal_mass(pred: np.ndarray, label: np.ndarray, n_bins: int = N_BINS) -> float:
    """ECE with bins of (near) equal sample counts: robust when predictions bunch near 0 or 1.

    Samples are sorted by prediction (stable) and cut into ``n_bins`` consecutive chunks of
    sizes differing by at most one (numpy.array_split); tied predictions may straddle a cut.
    """
    p = clamp_probs(pred)
    y = np.asarray(label, dtype=np.float64).ravel()
    n = p.size
    if n == 0:
        return float("nan")
    order = np.argsort(p, kind="stable")
    total = 0.0
    for chunk in np.array_split(order, min(n_bins, n)):
        if chunk.size:
            total += chunk.size * abs(p[chunk].mean() - y[chunk].mean())
    return total / n


def brier(pred: np.ndarray, label: np.ndarray) -> float:
    """Mean squared error of the clamped prediction (as SGLang's confidence metrics)."""
    p = clamp_probs(pred)
    if p.size == 0:
        return float("nan")
    y = np.asarray(label, dtype=np.float64).ravel()
    return float(np.mean((p - y) ** 2))


def auroc(pred: np.ndarray, label: np.ndarray) -> float:
    """Exact area under the ROC curve (ties count one half); NaN when only one class is present."""
    from scipy.stats import rankdata

    p = np.asarray(pred, dtype=np.float64).ravel()
    y = np.asarray(label, dtype=np.float64).ravel() > 0.5
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(p)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def auroc_binned(pred: np.ndarray, label: np.ndarray, n_bins: int = 1024) -> float:
    """SGLang's histogram AUROC (1024 bins, ties within a bin count one half), for parity."""
    p = clamp_probs(pred)
    y = np.asarray(label, dtype=np.float64).ravel()
    b = bin_index(p, n_bins)
    pos = np.bincount(b, weights=y, minlength=n_bins)
    neg = np.bincount(b, weights=1.0 - y, minlength=n_bins)
    tp, tn = pos.sum(), neg.sum()
    if tp <= 0 or tn <= 0:
        return float("nan")
    below = np.cumsum(neg) - neg
    return float(((pos * below).sum() + 0.5 * (pos * neg).sum()) / (tp * tn))


def reliability_bins(pred: np.ndarray, label: np.ndarray, n_bins: int = N_BINS) -> pd.DataFrame:
    """Reliability-diagram rows: one per equal-width bin (empty bins have NaN means)."""
    count, psum, ysum = _bin_sums(pred, label, n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.where(count > 0, psum / count, np.nan)
        mean_label = np.where(count > 0, ysum / count, np.nan)
    edges = np.arange(n_bins + 1) / n_bins
    return pd.DataFrame(
        {
            "bin": np.arange(n_bins),
            "lo": edges[:-1],
            "hi": edges[1:],
            "count": count.astype(np.int64),
            "mean_pred": mean_pred,
            "mean_label": mean_label,
            "gap": mean_pred - mean_label,
        }
    )


def calibration_metrics(
    pred: np.ndarray, label: np.ndarray, n_bins: int = N_BINS
) -> dict[str, float]:
    """Every scalar metric for one sample set (the row of a calibration table)."""
    p = np.asarray(pred, dtype=np.float64).ravel()
    y = np.asarray(label, dtype=np.float64).ravel()
    return {
        "n": int(p.size),
        "pred_mean": float(p.mean()) if p.size else float("nan"),
        "label_mean": float(y.mean()) if y.size else float("nan"),
        "ece": ece(p, y, n_bins),
        "ece_mass": ece_equal_mass(p, y, n_bins),
        "mce": mce(p, y, n_bins),
        "brier": brier(p, y),
        "auroc": auroc(p, y),
    }


# ---------------------------------------------------------------- labels from req_steps


@dataclass(frozen=True)
class WideLabels:
    """Per req-step matrices [n_rows, max_gamma] behind :func:`position_labels` (and STS)."""

    frame: pd.DataFrame  # the req_steps rows the matrices belong to (valid rows only)
    pred: np.ndarray  # survival S_j
    conf: np.ndarray  # confidence c_j
    label: np.ndarray  # prefix label as float, NaN where unobserved
    observed: np.ndarray  # bool
    at_risk: np.ndarray  # bool: observed and drafts 1..j-1 accepted
    valid: np.ndarray  # bool: j <= the row's gamma
    verified: np.ndarray  # drafts verified = verify_len - 1 (SGLang's JSONL "w")
    full_correct: np.ndarray  # correct count the labels use (cap-accept: + cap_trim)
    gamma: np.ndarray


def wide_labels(
    req_steps: FrameLike, runs: FrameLike | Mapping[str, str] | None = None, mode: str | None = None
) -> WideLabels:
    """Censoring-aware label matrices; rows lacking verify_len / correct_drafts are dropped."""
    df = as_frame(req_steps)
    vl = column(df, "verify_len", np.nan)
    cd = column(df, "correct_drafts", np.nan)
    keep = np.isfinite(vl) & np.isfinite(cd) & (vl >= 1)
    if "gamma" in df.columns:
        keep &= np.isfinite(column(df, "gamma", np.nan))
    df = df.loc[keep].reset_index(drop=True)
    n = len(df)
    gamma = column(df, "gamma", 0).astype(np.int64)
    width = int(gamma.max()) if n else 0
    v = column(df, "verify_len", 1).astype(np.int64) - 1  # drafts verified
    cd = column(df, "correct_drafts", 0).astype(np.int64)
    ct = column(df, "cap_trim", 0).astype(np.int64)
    modes = mode_of_rows(df, runs, mode)
    full_view = modes == "cap-accept"
    full = np.where(full_view, cd + ct, cd)

    surv = (
        list_matrix(df["survival"], width)
        if "survival" in df.columns
        else np.full((n, width), np.nan)
    )
    conf = (
        list_matrix(df["confidence"], width)
        if "confidence" in df.columns
        else np.full((n, width), np.nan)
    )
    with np.errstate(invalid="ignore", divide="ignore"):
        surv = np.where(np.isnan(surv), np.cumprod(conf, axis=1), surv)
        prev = np.hstack([np.ones((n, 1)), surv[:, :-1]]) if width else surv
        conf = np.where(np.isnan(conf), surv / prev, conf)

    pos = np.arange(1, width + 1)[None, :]
    valid = pos <= gamma[:, None]
    # compact rule: a rejection inside the window settles every position; a fully accepted
    # window leaves positions past it unobserved.
    seen = (cd[:, None] < v[:, None]) | (pos <= v[:, None])
    observed = valid & (full_view[:, None] | seen)
    label = np.where(observed, (pos <= full[:, None]).astype(np.float64), np.nan)
    at_risk = observed & (pos <= full[:, None] + 1)
    return WideLabels(df, surv, conf, label, observed, at_risk, valid, v, full, gamma)


def position_labels(
    req_steps: FrameLike, runs: FrameLike | Mapping[str, str] | None = None, mode: str | None = None
) -> pd.DataFrame:
    """Long frame, one row per (req-step, draft position j = 1..gamma).

    Columns: run_id, dp_rank, rid, forward_ct, workload, position, pred (S_j), conf (c_j),
    label (float prefix label, NaN when unobserved), observed, at_risk (observed and drafts
    1..j-1 accepted: the denominator of conditional acceptance), verified (drafts verified,
    verify_len - 1), gamma. ``runs`` (table or {run_id: mode}) or ``mode`` tells compact
    from cap-accept.
    """
    wl = wide_labels(req_steps, runs, mode)
    df = wl.frame
    n, width = wl.valid.shape
    rows, cols = np.nonzero(wl.valid)
    out = pd.DataFrame(
        {
            "run_id": text_column(df, "run_id", "")[rows],
            "dp_rank": column(df, "dp_rank", 0).astype(np.int64)[rows],
            "rid": text_column(df, "rid", "")[rows],
            "forward_ct": column(df, "forward_ct", -1).astype(np.int64)[rows],
            "workload": text_column(df, "workload", "unknown")[rows],
            "position": (cols + 1).astype(np.int64),
            "pred": wl.pred[rows, cols],
            "conf": wl.conf[rows, cols],
            "label": wl.label[rows, cols],
            "observed": wl.observed[rows, cols],
            "at_risk": wl.at_risk[rows, cols],
            "verified": wl.verified[rows],
            "gamma": wl.gamma[rows],
        },
        columns=list(LABEL_COLUMNS),
    )
    return out


def _scored(labels: pd.DataFrame, pred: str) -> pd.DataFrame:
    """Rows that can be scored: observed, with a prediction."""
    m = labels["observed"].to_numpy(dtype=bool) & np.isfinite(
        labels[pred].to_numpy(dtype=np.float64)
    )
    return labels.loc[m]


# ---------------------------------------------------------------- grouped tables


def calibration_table(
    labels: pd.DataFrame,
    by: Sequence[str] = ("position",),
    n_bins: int = N_BINS,
    n_boot: int = 0,
    seed: int = 0,
    level: float = 0.95,
    pred: str = "pred",
) -> pd.DataFrame:
    """Metrics per group of :func:`position_labels` rows (observed only).

    ``by`` is any label columns: ("position",), ("workload", "position"), ("run_id",),
    ("run_id", "rid") for per request, () for everything pooled. With ``n_boot`` > 0 adds
    percentile intervals (ece, mce, brier, label_mean) from resampling whole requests
    (run_id, rid) of the group, never single steps: steps of one request are correlated.
    """
    data = _scored(labels, pred)
    rows = []
    for key, idx in group_items(data, by):
        g = data.iloc[idx]
        p = g[pred].to_numpy(dtype=np.float64)
        y = g["label"].to_numpy(dtype=np.float64)
        row = dict(key)
        row["requests"] = int(pd.unique(request_keys(g)).size)
        row.update(calibration_metrics(p, y, n_bins))
        if n_boot > 0:
            row.update(_bootstrap_metrics(g, p, y, n_bins, n_boot, seed, level))
        rows.append(row)
    cols = [
        *by,
        "requests",
        "n",
        "pred_mean",
        "label_mean",
        "ece",
        "ece_mass",
        "mce",
        "brier",
        "auroc",
    ]
    if n_boot > 0:
        cols += [f"{m}_{e}" for m in ("ece", "mce", "brier", "label_mean") for e in ("lo", "hi")]
    return pd.DataFrame(rows, columns=cols)


def _bootstrap_metrics(
    g: pd.DataFrame, p: np.ndarray, y: np.ndarray, n_bins: int, n_boot: int, seed: int, level: float
) -> dict[str, float]:
    """Percentile CIs from resampled requests, using per-request bin sums (exact, fast)."""
    uniq, codes = np.unique(request_keys(g).astype(str), return_inverse=True)
    r = uniq.size
    pc = clamp_probs(p)
    b = bin_index(pc, n_bins)
    flat = codes * n_bins + b
    count = np.bincount(flat, minlength=r * n_bins).reshape(r, n_bins).astype(np.float64)
    psum = np.bincount(flat, weights=pc, minlength=r * n_bins).reshape(r, n_bins)
    ysum = np.bincount(flat, weights=y, minlength=r * n_bins).reshape(r, n_bins)
    sq = np.bincount(codes, weights=(pc - y) ** 2, minlength=r)
    wts = bootstrap_weights(r, n_boot, seed)
    bc, bp, by_ = wts @ count, wts @ psum, wts @ ysum
    total = bc.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        stats = {
            "ece": _ece_from_bins(bc, bp, by_),
            "mce": _mce_from_bins(bc, bp, by_),
            "brier": (wts @ sq) / total,
            "label_mean": by_.sum(axis=1) / total,
        }
    out = {}
    for name, s in stats.items():
        out[f"{name}_lo"], out[f"{name}_hi"] = quantile_interval(s, level)
    return out


def reliability_table(
    labels: pd.DataFrame,
    by: Sequence[str] = ("position",),
    n_bins: int = N_BINS,
    pred: str = "pred",
) -> pd.DataFrame:
    """Reliability-diagram bins for each group (observed rows only)."""
    data = _scored(labels, pred)
    parts = []
    for key, idx in group_items(data, by):
        g = data.iloc[idx]
        rb = reliability_bins(g[pred].to_numpy(), g["label"].to_numpy(), n_bins)
        for k, v in key.items():
            rb.insert(0, k, v)
        parts.append(rb)
    if not parts:
        return pd.DataFrame(
            columns=[*by, "bin", "lo", "hi", "count", "mean_pred", "mean_label", "gap"]
        )
    return pd.concat(parts, ignore_index=True)[
        [*by, "bin", "lo", "hi", "count", "mean_pred", "mean_label", "gap"]
    ]


def conditional_acceptance(labels: pd.DataFrame, by: Sequence[str] = ("position",)) -> pd.DataFrame:
    """P(draft j accepted | drafts < j accepted), observed only: the empirical c_j.

    Denominator: steps where position j was verified (or its fate is otherwise known) and
    drafts 1..j-1 were accepted. A compact step that accepted its whole window never counts
    position window+1 as a rejection. ``mean_conf`` is the head's c_j over the same steps.
    """
    m = labels["at_risk"].to_numpy(dtype=bool)
    data = labels.loc[m]
    rows = []
    for key, idx in group_items(data, by):
        g = data.iloc[idx]
        y = g["label"].to_numpy(dtype=np.float64)
        c = g["conf"].to_numpy(dtype=np.float64)
        row = dict(key)
        row["at_risk"] = int(y.size)
        row["accepted"] = int(y.sum())
        row["accept_rate"] = float(y.mean()) if y.size else float("nan")
        row["mean_conf"] = float(np.nanmean(c)) if np.isfinite(c).any() else float("nan")
        row["conf_gap"] = row["mean_conf"] - row["accept_rate"]
        rows.append(row)
    return pd.DataFrame(
        rows, columns=[*by, "at_risk", "accepted", "accept_rate", "mean_conf", "conf_gap"]
    )


REQUEST_CONFIDENCE_COLUMNS = (
    "run_id",
    "rid",
    "workload",
    "steps",
    "pred_window",
    "realized",
    "gap_window",
    "pred_block",
    "realized_block",
    "gap_block",
    "committed",
)


def request_confidence(
    req_steps: FrameLike, runs: FrameLike | Mapping[str, str] | None = None, mode: str | None = None
) -> pd.DataFrame:
    """Per request: predicted vs realized accept length, per step on average.

    pred_window = 1 + sum_{j <= verify_len-1} S_j (the window actually verified) is compared
    with realized = correct_drafts + 1; pred_block = 1 + sum_{j <= gamma} S_j is compared with
    realized_block = full correct + 1, known only when the whole block was verified
    (cap-accept: correct_drafts + cap_trim; static) and NaN in compact. gap_* = pred - realized
    (positive: the head is over-confident for this request).
    """
    wl = wide_labels(req_steps, runs, mode)
    df = wl.frame
    n, width = wl.valid.shape
    if n == 0:
        return pd.DataFrame(columns=list(REQUEST_CONFIDENCE_COLUMNS))
    pos = np.arange(1, width + 1)[None, :]
    s = np.where(wl.valid, wl.pred, 0.0)
    in_window = pos <= wl.verified[:, None]
    pred_window = 1.0 + np.where(in_window, s, 0.0).sum(axis=1)
    pred_block = 1.0 + s.sum(axis=1)
    has_pred = ~np.isnan(np.where(wl.valid, wl.pred, 0.0)).any(axis=1)
    cd = column(df, "correct_drafts", 0)
    modes = mode_of_rows(df, runs, mode)
    whole = (modes == "cap-accept") | (modes == "static") | (wl.verified >= wl.gamma)
    frame = pd.DataFrame(
        {
            "run_id": text_column(df, "run_id", ""),
            "rid": text_column(df, "rid", ""),
            "workload": text_column(df, "workload", "unknown"),
            "pred_window": np.where(has_pred, pred_window, np.nan),
            "realized": cd + 1.0,
            "pred_block": np.where(has_pred, pred_block, np.nan),
            "realized_block": np.where(whole, wl.full_correct + 1.0, np.nan),
            "committed": column(df, "acc_len", np.nan),
        }
    )
    g = frame.groupby(["run_id", "rid", "workload"], sort=True)
    out = g.agg(
        steps=("realized", "size"),
        pred_window=("pred_window", "mean"),
        realized=("realized", "mean"),
        pred_block=("pred_block", "mean"),
        realized_block=("realized_block", "mean"),
        committed=("committed", "mean"),
    ).reset_index()
    out["gap_window"] = out["pred_window"] - out["realized"]
    out["gap_block"] = out["pred_block"] - out["realized_block"]
    return out[list(REQUEST_CONFIDENCE_COLUMNS)]
