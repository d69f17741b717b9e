"""How big are the windows the scheduler picks, and what budget did each step get.

window = verify_len (anchor included, 1..gamma+1) per request per step. "At the maximum"
means verify_len == gamma + 1 (the whole block verified); "<= 3" is the share of small
windows, where trimming bites hardest.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from dspark_obs.analytics._frames import FrameLike, as_frame, column, request_keys, text_column

WINDOW_COLUMNS = (
    "steps",
    "requests",
    "mean_window",
    "median_window",
    "share_max_window",
    "share_window_le3",
    "mean_committed",
    "gamma",
)


def _window_frame(req_steps: FrameLike) -> pd.DataFrame:
    df = as_frame(req_steps)
    vl = column(df, "verify_len", np.nan)
    keep = np.isfinite(vl)
    df = df.loc[keep]
    return pd.DataFrame(
        {
            "run_id": text_column(df, "run_id", ""),
            "workload": text_column(df, "workload", "unknown"),
            "rid": text_column(df, "rid", ""),
            "request": request_keys(df),
            "verify_len": vl[keep].astype(np.int64),
            "gamma": column(df, "gamma", 0).astype(np.int64),
            "acc_len": column(df, "acc_len", np.nan),
        }
    )


def window_stats(req_steps: FrameLike, by: Sequence[str] = ("workload",)) -> pd.DataFrame:
    """Per group (default per workload; ("run_id", "workload"), ("run_id", "rid") also work)."""
    f = _window_frame(req_steps)
    by = list(by)
    if len(f) == 0:
        return pd.DataFrame(columns=[*by, *WINDOW_COLUMNS])
    f["at_max"] = f["verify_len"] == f["gamma"] + 1
    f["le3"] = f["verify_len"] <= 3
    if not by:
        f["_all"] = "all"
        by_ = ["_all"]
    else:
        by_ = by
    out = (
        f.groupby(by_, sort=True)
        .agg(
            steps=("verify_len", "size"),
            requests=("request", "nunique"),
            mean_window=("verify_len", "mean"),
            median_window=("verify_len", "median"),
            share_max_window=("at_max", "mean"),
            share_window_le3=("le3", "mean"),
            mean_committed=("acc_len", "mean"),
            gamma=("gamma", "max"),
        )
        .reset_index()
    )
    if not by:
        out = out.drop(columns=["_all"])
    return out[[*by, *WINDOW_COLUMNS]]


def window_histogram(req_steps: FrameLike, by: Sequence[str] = ("workload",)) -> pd.DataFrame:
    """Long histogram: group, verify_len (1..gamma+1, zeros included), steps, share."""
    f = _window_frame(req_steps)
    by = list(by)
    cols = [*by, "verify_len", "steps", "share"]
    if len(f) == 0:
        return pd.DataFrame(columns=cols)
    rows = []
    groups = f.groupby(by, sort=True) if by else [((), f)]
    for key, g in groups:
        key = key if isinstance(key, tuple) else (key,)
        top = int(g["gamma"].max()) + 1
        counts = np.bincount(g["verify_len"].to_numpy(), minlength=top + 1)[1 : top + 1]
        total = counts.sum()
        for v, c in enumerate(counts, start=1):
            rows.append(
                {
                    **dict(zip(by, key, strict=True)),
                    "verify_len": v,
                    "steps": int(c),
                    "share": c / total,
                }
            )
    return pd.DataFrame(rows, columns=cols)


def budget_stats(steps: FrameLike) -> pd.DataFrame:
    """Per run: the verify budget the planner set per step (SGLang's -1 = unset is excluded).

    Budgets belong to batch steps, not requests, so they are per run (a mixed-workload run
    has one budget per step shared by all its workloads).
    """
    df = as_frame(steps)
    cols = [
        "run_id",
        "steps",
        "budget_steps",
        "mean_budget",
        "median_budget",
        "max_budget",
        "mean_verify_tokens",
        "mean_bs",
    ]
    if len(df) == 0:
        return pd.DataFrame(columns=cols)
    f = pd.DataFrame(
        {
            "run_id": text_column(df, "run_id", ""),
            "budget": column(df, "budget", -1),
            "num_verify_tokens": column(df, "num_verify_tokens", -1),
            "bs": column(df, "bs", -1),
        }
    )
    for c in ("budget", "num_verify_tokens", "bs"):
        f.loc[f[c] < 0, c] = np.nan
    out = (
        f.groupby("run_id", sort=True)
        .agg(
            steps=("budget", "size"),
            budget_steps=("budget", "count"),
            mean_budget=("budget", "mean"),
            median_budget=("budget", "median"),
            max_budget=("budget", "max"),
            mean_verify_tokens=("num_verify_tokens", "mean"),
            mean_bs=("bs", "mean"),
        )
        .reset_index()
    )
    return out[cols]
