"""Validation of the block-accept estimator against a cap-accept companion's measured ceiling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from dspark_obs.analytics._frames import as_frame
from dspark_obs.analytics.estimator_summary import INTERVALS, BlockEstimate, summarize_blocks

COVERS = {
    "point_ci": "interval_covers",
    "pred_ci": "pred_interval_covers",
    "companion_ci": "companion_interval_covers",
    "bracket_ci": "bracket_interval_covers",
}
"""The validation column saying whether each summary interval held its truth."""


def _inside(lo: pd.Series, hi: pd.Series, x: pd.Series, tol: float) -> pd.Series:
    return (lo - tol <= x) & (x <= hi + tol)


def _truth_table(truth: Any, by: Sequence[str]) -> pd.DataFrame:
    from dspark_obs.analytics.companion import CompanionResult, ceiling_summary, step_ceilings

    if isinstance(truth, CompanionResult):
        steps = truth.steps.dropna(subset=["ceiling"])
        return ceiling_summary(steps, by)
    f = as_frame(truth)
    if "mean_ceiling" in f.columns:
        return f
    if "ceiling" in f.columns:
        return ceiling_summary(f, by)
    return ceiling_summary(step_ceilings(f), by)


def validate_estimator(
    estimate: BlockEstimate | pd.DataFrame,
    companion_truth: Any,
    by: Sequence[str] = ("workload",),
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
    tol: float = 1e-9,
) -> pd.DataFrame:
    """Compare the compact-only estimate with the cap-accept companion's measured ceiling.

    ``estimate``: a BlockEstimate, its blocks frame, or a summarize_blocks frame.
    ``companion_truth``: a CompanionResult, step_ceilings frame, the cap-accept req_steps,
    or a ceiling_summary frame. Per group: truth mean ceiling (DESIGN: acc_len + cap_trim)
    and its uncut twin (correct_drafts + 1 + cap_trim), mean lo/mid/hi, point, errors, and
    whether bracket and intervals contain the truth. The bracket (SGLang's) is judged
    against the uncut truth, point / interval / greedy against DESIGN's; they differ only
    on requests' cut final steps. ``interval_covers`` judges point_ci (an interval for the
    expected mean ceiling), ``pred_interval_covers`` judges pred_ci (a predictive interval
    for the realized mean ceiling of traffic like this), ``companion_interval_covers`` judges
    companion_ci (the realized mean ceiling of these very blocks: what the companion
    measured, the interval to hold to the nominal level against it).
    """
    by = list(by)
    if hasattr(estimate, "summary"):  # a BlockEstimate: its tail model is redrawn
        est = estimate.summary(by, n_boot=n_boot, seed=seed, level=level)
    else:
        e = as_frame(estimate)
        est = (
            e
            if "mean_lo" in e.columns
            else summarize_blocks(e, by, n_boot=n_boot, seed=seed, level=level)
        )
    truth = _truth_table(companion_truth, by)
    if "mean_ceiling_uncut" not in truth.columns:
        truth = truth.assign(mean_ceiling_uncut=truth["mean_ceiling"])
    t = truth[[*by, "steps", "mean_ceiling", "mean_ceiling_uncut"]].rename(
        columns={
            "steps": "truth_steps",
            "mean_ceiling": "truth_mean_ceiling",
            "mean_ceiling_uncut": "truth_mean_uncut",
        }
    )
    m = (
        est.merge(t, on=by, how="outer")
        if by
        else est.assign(_k=0).merge(t.assign(_k=0), on="_k").drop(columns="_k")
    )
    truth_v = m["truth_mean_ceiling"]
    uncut = m["truth_mean_uncut"]
    out = pd.DataFrame({c: m[c] for c in by})
    out["truth_steps"] = m["truth_steps"]
    out["truth_mean_ceiling"] = truth_v
    out["truth_mean_uncut"] = uncut
    out["blocks"] = m["blocks"]
    ends = [f"{c}_{e}" for c in INTERVALS for e in ("lo", "hi")]
    for c in ("mean_lo", "mean_mid", "mean_hi", "mean_point", *ends, "greedy_mean"):
        out[c] = m[c] if c in m.columns else float("nan")
    # SGLang's bracket lives in the uncut convention; point and greedy in DESIGN's
    out["inside_bracket"] = _inside(out["mean_lo"], out["mean_hi"], uncut, tol)
    out["mid_abs_err"] = (out["mean_mid"] - uncut).abs()
    out["point_err"] = out["mean_point"] - truth_v
    out["point_abs_err"] = out["point_err"].abs()
    out["point_pct_err"] = 100.0 * out["point_abs_err"] / truth_v
    for c in INTERVALS:
        against = uncut if c == "bracket_ci" else truth_v
        out[COVERS[c]] = _inside(out[f"{c}_lo"], out[f"{c}_hi"], against, tol)
    out["greedy_err"] = m["greedy_mean"] - truth_v
    return out


def coverage(
    validations: Sequence[pd.DataFrame], by: Sequence[str] = ("workload",)
) -> pd.DataFrame:
    """Over replicate validations (e.g. seeds): how often bracket / intervals held the truth.

    interval_coverage: point_ci (expected mean); pred_interval_coverage: pred_ci (realized
    mean, requests resampled); companion_interval_coverage: companion_ci (realized mean of
    the same blocks, the one to hold to the nominal level against a companion); mean widths.
    """
    by = list(by)
    allv = pd.concat([v.assign(_rep=i) for i, v in enumerate(validations)], ignore_index=True)
    for c in ("pred_ci", "companion_ci"):
        for col in (f"{c}_lo", f"{c}_hi", COVERS[c]):
            if col not in allv.columns:
                allv[col] = np.nan
    allv["_point_w"] = allv["point_ci_hi"] - allv["point_ci_lo"]
    allv["_pred_w"] = allv["pred_ci_hi"] - allv["pred_ci_lo"]
    allv["_comp_w"] = allv["companion_ci_hi"] - allv["companion_ci_lo"]
    for c in ("pred_interval_covers", "companion_interval_covers"):
        allv[c] = allv[c].astype(np.float64)
    if not by:
        allv["_all"] = "all"
    keys = by or ["_all"]
    out = (
        allv.groupby(keys, sort=True)
        .agg(
            replicates=("_rep", "nunique"),
            inside_bracket_rate=("inside_bracket", "mean"),
            interval_coverage=("interval_covers", "mean"),
            pred_interval_coverage=("pred_interval_covers", "mean"),
            companion_interval_coverage=("companion_interval_covers", "mean"),
            bracket_interval_coverage=("bracket_interval_covers", "mean"),
            point_ci_width=("_point_w", "mean"),
            pred_ci_width=("_pred_w", "mean"),
            companion_ci_width=("_comp_w", "mean"),
            mean_abs_err=("point_abs_err", "mean"),
            mean_pct_err=("point_pct_err", "mean"),
        )
        .reset_index()
    )
    return out.drop(columns=["_all"]) if not by else out
