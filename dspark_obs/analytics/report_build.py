"""The numbers of one report over a run (or several), computed from the store's tables.

Per primary run: verify windows, calibration per position, STS judged (given temperatures on
every request, or fitted on a request split and judged on the held-out part), the cap-accept
companion's ceilings and, on compact runs, the block-accept estimate and its validation
against the companion. :class:`~dspark_obs.analytics.report.Report` renders them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from dspark_obs.analytics._frames import FrameLike, as_frame, text_column
from dspark_obs.analytics.calibration import (
    N_BINS,
    calibration_table,
    conditional_acceptance,
    position_labels,
)
from dspark_obs.analytics.companion import (
    CompanionDivergence,
    CompanionResult,
    find_companion,
    pair_companion,
)
from dspark_obs.analytics.estimator import estimate_blocks, validate_estimator
from dspark_obs.analytics.estimator_cells import (
    describe_cell,
    sampling_kind,
    validation_cell,
)
from dspark_obs.analytics.report import WORKLOAD_TABLE, Report
from dspark_obs.analytics.sts import ece_by_workload, pooled_ece, sts_data_from_req_steps
from dspark_obs.analytics.sts_heldout import fit_sts_heldout
from dspark_obs.analytics.sts_verdict import MIN_HELDOUT_REQUESTS, sts_verdict
from dspark_obs.analytics.windows import budget_stats, window_histogram, window_stats
from dspark_obs.sts_file import StsCalibration

ESTIMATE_COLUMNS = {
    "mean_lo": "est_lo",
    "mean_mid": "est_mid",
    "mean_hi": "est_hi",
    "mean_point": "est_point",
    "point_ci_lo": "est_ci_lo",
    "point_ci_hi": "est_ci_hi",
}
"""The estimator summary's columns the workload table shows, and their names there."""

_TABLES = (
    "workloads",
    "windows",
    "hist",
    "calibration",
    "cond",
    "companion",
    "divergences",
    "estimator",
    "validation",
)


def _split_companions(
    rs: pd.DataFrame, rq: pd.DataFrame, rn: pd.DataFrame
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Move cap-accept companion runs out of the primary frames (the store view holds both)."""
    if len(rn) == 0 or "companion_of" not in rn.columns or len(rs) == 0:
        return rs, rq, rs.iloc[0:0], rq.iloc[0:0]
    ids = set(rs["run_id"].astype(str))
    comp = {
        str(r)
        for r, c in zip(rn["run_id"], rn["companion_of"], strict=True)
        if isinstance(c, str) and c in ids
    }
    in_c = rs["run_id"].astype(str).isin(comp)
    rq_c = (
        rq["run_id"].astype(str).isin(comp)
        if len(rq) and "run_id" in rq.columns
        else pd.Series(False, index=rq.index)
    )
    return rs.loc[~in_c], rq.loc[~rq_c], rs.loc[in_c], rq.loc[rq_c]


def _sts_note(requests: Any, before: float, after: float) -> str:
    """One workload's STS verdict (:func:`sts_verdict`), empty when ok."""
    n = int(requests) if isinstance(requests, int | np.integer) else MIN_HELDOUT_REQUESTS
    verdict = sts_verdict(before, after, n)
    if verdict.status == "ok":
        return ""
    few = f"too few to trust (only {n} requests)" if n < MIN_HELDOUT_REQUESTS else ""
    worse = "WORSE after STS: do not serve" if not verdict.servable else ""
    return "; ".join(x for x in (worse, few) if x)


def _mode(rn: pd.DataFrame, run_id: str) -> str:
    if len(rn) and "mode" in rn.columns:
        m = rn.loc[rn["run_id"].astype(str) == run_id, "mode"]
        if len(m):
            return str(m.iloc[0])
    return "compact"


def _with_run(frame: pd.DataFrame, run_id: str) -> pd.DataFrame:
    f = frame.copy()
    if "run_id" in f.columns:
        f = f.drop(columns="run_id")
    f.insert(0, "run_id", run_id)
    return f


def _run_sts(
    rows: pd.DataFrame,
    rn: pd.DataFrame,
    temps: list[float] | None,
    n_bins: int,
    n_boot: int,
    seed: int,
    heldout_frac: float,
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """(ECE per workload, the run's STS entry): given temperatures judged on every request,
    else STS fitted on a request split and judged on the held-out part. ValueError when the
    run carries no usable confidence."""
    data = sts_data_from_req_steps(rows, runs=rn if len(rn) else None)
    if len(data.logits) == 0:
        raise ValueError("no step carries a full confidence vector")
    if temps is not None:
        before = pooled_ece(data.logits, data.prefix_mask, None, data.observed, n_bins)
        after = pooled_ece(data.logits, data.prefix_mask, temps, data.observed, n_bins)
        verdict = sts_verdict(before, after, int(np.unique(data.request).size), judged_on="all")
        info = {
            "temperatures": temps,
            "evaluation": "given temperatures, all requests",
            "ece_before": before,
            "ece_after": after,
            "verdict": verdict.status,
            "caveats": verdict.reasons,
        }
        return ece_by_workload(data, temps, n_bins), info
    ho = fit_sts_heldout(data, heldout_frac=heldout_frac, seed=seed, n_bins=n_bins, n_boot=n_boot)
    verdict = ho.verdict()
    info = {
        "temperatures": ho.calibration.temperatures,
        "calibration": ho.calibration.to_dict(),
        "evaluation": f"fit on {ho.fit_requests} requests, held-out {ho.heldout_requests}",
        "fit_requests": ho.fit_requests,
        "heldout_requests": ho.heldout_requests,
        "ece_before": ho.pooled_before,
        "ece_after": ho.pooled_after,
        "ece_after_ci": list(ho.after_ci),
        "ece_change_ci": list(ho.change_ci),
        "verdict": verdict.status,
        "caveats": verdict.reasons,
        "ece_before_per_position": ho.ece_before,
        "ece_after_per_position": ho.ece_after,
        "by_workload": ho.by_workload,
    }
    return ho.by_workload, info


def _with_sts(wk: pd.DataFrame, by_wl: pd.DataFrame) -> pd.DataFrame:
    """The workload table with its judged ECE columns and each workload's STS note."""
    wk = wk.merge(
        by_wl[["workload", "ece_before", "ece_after"]].rename(
            columns={"ece_before": "ece_sts_before", "ece_after": "ece_sts"}
        ),
        on="workload",
        how="left",
    )
    requests = wk["workload"].map(dict(zip(by_wl["workload"], by_wl["requests"], strict=True)))
    wk["sts_note"] = [
        _sts_note(n, b, a)
        for n, b, a in zip(requests, wk["ece_sts_before"], wk["ece_sts"], strict=True)
    ]
    return wk


def _run_estimate(
    rows: pd.DataFrame,
    rreq: pd.DataFrame,
    rn: pd.DataFrame,
    tail: str,
    n_boot: int,
    seed: int,
) -> tuple[pd.DataFrame, dict[str, Any], list[str]]:
    """A compact run's block-accept estimate per workload, its tail model (with the sweep
    cell that measured the estimator where the run sits) and its data problems."""
    est = estimate_blocks(
        rows, rreq if len(rreq) else None, tail=tail, runs=rn if len(rn) else None
    )
    summ = est.summary(("workload",), n_boot=n_boot, seed=seed)
    tail_info = est.tail_model.describe() if est.tail_model is not None else {}
    cell = validation_cell(float(est.blocks["censored"].mean()), sampling_kind(rows))
    tail_info["validation_cell"] = cell
    summ = summ.assign(
        tail_model=tail_info.get("tail_model", tail), validation_cell=describe_cell(cell)
    )
    return summ, tail_info, list(est.problems)


def _pair(
    rows: pd.DataFrame, rreq: pd.DataFrame, crs: pd.DataFrame, crq: pd.DataFrame, cap_id: str
) -> CompanionResult:
    """The run paired with its cap-accept companion; divergence warnings are passed on."""
    cap_rows = crs.loc[text_column(crs, "run_id", "") == cap_id]
    cap_req = crq.loc[text_column(crq, "run_id", "") == cap_id] if len(crq) else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompanionDivergence)
        comp = pair_companion(rows, cap_rows, rreq if len(rreq) else None, cap_req)
    for w in caught:
        warnings.warn(w.message, w.category, stacklevel=3)
    return comp


def build_report(
    req_steps: FrameLike,
    requests: FrameLike | None,
    runs: FrameLike | None,
    companion_req_steps: FrameLike | None = None,
    companion_requests: FrameLike | None = None,
    steps: FrameLike | None = None,
    sts: StsCalibration | Sequence[float] | None = None,
    n_bins: int = N_BINS,
    n_boot: int = 200,
    seed: int = 0,
    heldout_frac: float = 0.3,
    tail: str = "auto",
) -> Report:
    """Compute every table of the report.

    ``req_steps``/``requests``/``runs``: the store's tables (any number of runs; cap-accept
    runs that are some run's companion are used as companions, not reported on their own).
    ``companion_req_steps``: give the companion separately instead. ``sts``: temperatures to
    judge (else STS is fitted per run on a request split and judged on the held-out part).
    """
    rs, rq, rn = as_frame(req_steps), as_frame(requests), as_frame(runs)
    if len(rs) and "run_id" not in rs.columns:
        rs = rs.assign(run_id="")
    if len(rq) and "run_id" not in rq.columns:
        rq = rq.assign(run_id="")
    if companion_req_steps is None:
        rs, rq, crs, crq = _split_companions(rs, rq, rn)
    else:
        crs, crq = as_frame(companion_req_steps), as_frame(companion_requests)
    temps = (
        list(sts.temperatures)
        if isinstance(sts, StsCalibration)
        else (list(sts) if sts is not None else None)
    )

    warn_list: list[str] = []
    tail_models: dict[str, dict] = {}  # per compact run: the estimator's tail model + its cell
    problems: list[str] = []
    tables: dict[str, list[pd.DataFrame]] = {k: [] for k in _TABLES}
    sts_info: dict[str, Any] = {}
    primary = sorted(set(text_column(rs, "run_id", ""))) if len(rs) else []
    comp_ids = sorted(set(text_column(crs, "run_id", ""))) if len(crs) else []

    for run in primary:
        rows = rs.loc[text_column(rs, "run_id", "") == run]
        rreq = rq.loc[text_column(rq, "run_id", "") == run] if len(rq) else rq
        win = window_stats(rows, by=("workload",))
        tables["windows"].append(_with_run(win, run))
        tables["hist"].append(_with_run(window_histogram(rows, by=("workload",)), run))

        labels = position_labels(rows, runs=rn if len(rn) else None)
        cal = calibration_table(
            labels, by=("workload", "position"), n_bins=n_bins, n_boot=n_boot, seed=seed
        )
        tables["calibration"].append(_with_run(cal, run))
        tables["cond"].append(
            _with_run(conditional_acceptance(labels, by=("workload", "position")), run)
        )
        pooled = calibration_table(labels, by=("workload",), n_bins=n_bins)
        wk = win[
            [
                "workload",
                "steps",
                "mean_window",
                "share_max_window",
                "share_window_le3",
                "mean_committed",
            ]
        ].merge(
            pooled[["workload", "ece"]].rename(columns={"ece": "ece_raw"}),
            on="workload",
            how="left",
        )

        try:
            by_wl, sts_info[run] = _run_sts(rows, rn, temps, n_bins, n_boot, seed, heldout_frac)
            warn_list.extend(f"{run}: STS {c}" for c in sts_info[run]["caveats"])
            wk = _with_sts(wk, by_wl)
        except ValueError as exc:
            warn_list.append(f"{run}: STS not evaluated ({exc})")

        # companion truth
        cap_id = find_companion(rn, run) if len(rn) else None
        if cap_id is None and len(primary) == 1 and len(comp_ids) == 1:
            cap_id = comp_ids[0]
        comp = None
        if cap_id is not None and cap_id in comp_ids:
            comp = _pair(rows, rreq, crs, crq, cap_id)
            if comp.alarm or not comp.identical:
                warn_list.append(f"{run} vs {cap_id}: {comp.message}")
            tables["companion"].append(
                _with_run(comp.per_workload, run).assign(companion_run=cap_id)
            )
            if len(comp.divergences):
                tables["divergences"].append(_with_run(comp.divergences, run))
            wk = wk.merge(
                comp.per_workload[["workload", "mean_ceiling", "utilization", "tokens_left"]],
                on="workload",
                how="left",
            )
        for c in ("mean_ceiling", "utilization", "tokens_left"):
            if c not in wk.columns:
                wk[c] = np.nan

        if _mode(rn, run) == "compact":
            summ, tail_models[run], est_problems = _run_estimate(rows, rreq, rn, tail, n_boot, seed)
            problems += [f"{run}: {p}" for p in est_problems]
            tables["estimator"].append(_with_run(summ, run))
            wk = wk.merge(
                summ[["workload", *ESTIMATE_COLUMNS]].rename(columns=ESTIMATE_COLUMNS),
                on="workload",
                how="left",
            )
            if comp is not None:
                val = validate_estimator(summ, comp, by=("workload",))
                tables["validation"].append(_with_run(val, run))
                wk = wk.merge(  # the verdict next to the very value it was judged against
                    val[["workload", "truth_mean_uncut", "inside_bracket"]].rename(
                        columns={
                            "truth_mean_uncut": "bracket_truth",
                            "inside_bracket": "truth_in_bracket",
                        }
                    ),
                    on="workload",
                    how="left",
                )
        for c in WORKLOAD_TABLE:
            if c not in wk.columns and c != "run_id":
                wk[c] = np.nan
        tables["workloads"].append(_with_run(wk, run)[list(WORKLOAD_TABLE)])

    def cat(name: str) -> pd.DataFrame:
        parts = [p for p in tables[name] if len(p)]
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()

    meta = {
        "runs": primary,
        "companions": comp_ids,
        "n_bins": n_bins,
        "n_boot": n_boot,
        "seed": seed,
        "tail": tail,
        "tail_models": tail_models,
        "req_steps": len(rs),
    }
    return Report(
        workloads=cat("workloads")
        if tables["workloads"]
        else pd.DataFrame(columns=list(WORKLOAD_TABLE)),
        windows=cat("windows"),
        window_histogram=cat("hist"),
        budgets=budget_stats(steps) if steps is not None else pd.DataFrame(),
        calibration=cat("calibration"),
        conditional_acceptance=cat("cond"),
        companion=cat("companion"),
        divergences=cat("divergences"),
        estimator=cat("estimator"),
        validation=cat("validation"),
        sts=sts_info,
        warnings=warn_list,
        problems=problems,
        meta=meta,
    )
