"""One report over a run (or several): windows, ceiling, estimate vs truth, calibration.

The CLI (``dspark-obs report``) should only load frames from the store and call
:func:`build_report`; this module owns the numbers and their three renderings (JSON for
machines, Markdown for PRs and notebooks, rich tables for the terminal).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from dspark_obs.analytics._frames import (
    FrameLike,
    as_frame,
    format_cell,
    jsonable,
    markdown_table,
    text_column,
)
from dspark_obs.analytics.calibration import (
    N_BINS,
    calibration_table,
    conditional_acceptance,
    position_labels,
)
from dspark_obs.analytics.companion import CompanionDivergence, find_companion, pair_companion
from dspark_obs.analytics.estimator import estimate_blocks, validate_estimator
from dspark_obs.analytics.estimator_cells import (
    describe_cell,
    describe_tail,
    sampling_kind,
    validation_cell,
)
from dspark_obs.analytics.sts import (
    StsCalibration,
    fit_sts_heldout,
    pooled_ece,
    sts_data_from_req_steps,
)
from dspark_obs.analytics.sts_verdict import MIN_HELDOUT_REQUESTS, sts_verdict
from dspark_obs.analytics.windows import budget_stats, window_histogram, window_stats

WORKLOAD_KEYS = ("run_id", "workload")
WORKLOAD_CEILING = (
    "steps",
    "mean_window",
    "share_max_window",
    "share_window_le3",
    "mean_committed",
    "mean_ceiling",
    "utilization",
    "tokens_left",
)
WORKLOAD_ESTIMATE = (
    "est_lo",
    "est_mid",
    "est_hi",
    "bracket_truth",
    "truth_in_bracket",
    "est_point",
    "est_ci_lo",
    "est_ci_hi",
    "ece_raw",
    "ece_sts_before",
    "ece_sts",
    "sts_note",
)
WORKLOAD_TABLE = (*WORKLOAD_KEYS, *WORKLOAD_CEILING, *WORKLOAD_ESTIMATE)

# Short headers for the terminal and Markdown renderings of the workload table.
HEADERS = {
    "run_id": "run",
    "workload": "workload",
    "steps": "steps",
    "mean_window": "window",
    "share_max_window": "at max",
    "share_window_le3": "<=3",
    "mean_committed": "committed",
    "mean_ceiling": "ceiling",
    "utilization": "util",
    "tokens_left": "left",
    "est_lo": "est lo",
    "est_mid": "est mid",
    "est_hi": "est hi",
    "est_point": "est point",
    "est_ci_lo": "ci lo",
    "est_ci_hi": "ci hi",
    "bracket_truth": "uncut ceiling",
    "truth_in_bracket": "in [lo,hi]",
    "ece_raw": "ECE raw",
    "ece_sts_before": "ECE judged raw",
    "ece_sts": "ECE judged STS",
    "sts_note": "STS note",
}


@dataclass
class Report:
    """Everything the report shows, as frames; render with to_json / to_markdown / to_rich."""

    workloads: pd.DataFrame
    windows: pd.DataFrame
    window_histogram: pd.DataFrame
    budgets: pd.DataFrame
    calibration: pd.DataFrame
    conditional_acceptance: pd.DataFrame
    companion: pd.DataFrame
    divergences: pd.DataFrame
    estimator: pd.DataFrame
    validation: pd.DataFrame
    sts: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return jsonable(
            {
                "meta": self.meta,
                "warnings": self.warnings,
                "problems": self.problems,
                "workloads": self.workloads,
                "windows": self.windows,
                "window_histogram": self.window_histogram,
                "budgets": self.budgets,
                "calibration": self.calibration,
                "conditional_acceptance": self.conditional_acceptance,
                "sts": self.sts,
                "companion": self.companion,
                "divergences": self.divergences,
                "estimator": self.estimator,
                "validation": self.validation,
            }
        )

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def to_markdown(self) -> str:
        parts = ["# dspark-obs report", ""]
        if self.meta:
            parts += [
                f"- {k}: {format_cell(v)}"
                for k, v in self.meta.items()
                if not isinstance(v, dict | list)
            ]
            parts.append("")
        for w in self.warnings:
            parts.append(f"> **WARNING** {w}")
        if self.warnings:
            parts.append("")
        parts += ["## Per workload", "", markdown_table(self.workloads.rename(columns=HEADERS)), ""]
        parts += [
            "window = mean verify_len (anchor included); ceiling = acc_len + cap_trim from the "
            "cap-accept companion; est = block-accept estimate from the compact run alone (SGLang "
            "bracket [lo, hi], point and its bootstrap interval over requests). 'in [lo,hi]' is "
            "judged against the value printed beside it, the companion's *uncut* ceiling "
            "(correct_drafts + 1 + cap_trim, SGLang's convention; it differs from 'ceiling' only "
            "on requests' EOS- or length-cut final steps); point and its interval are judged "
            "against 'ceiling'. ECE: SGLang's 15-bin definition pooled over observed positions "
            "(raw: all requests); 'ECE judged raw' -> 'ECE judged STS' are on the same requests "
            "(held-out ones unless a calibration was given); 'STS note' flags too few of them "
            "or an ECE that got worse.",
            "",
        ]
        sections = [
            ("Calibration per position", self.calibration),
            ("Conditional acceptance per position", self.conditional_acceptance),
            ("Companion ceilings", self.companion),
            ("Estimator", self.estimator),
            ("Estimator vs companion truth", self.validation),
            ("Budgets per step", self.budgets),
        ]
        for title, frame in sections:
            if frame is not None and len(frame):
                parts += [f"## {title}", "", markdown_table(frame), ""]
        if self.meta.get("tail_models"):
            parts += ["## Estimator tail model", ""]
            parts += [f"- {line}" for line in self.tail_model_lines()] + [""]
        if self.sts:
            parts += ["## STS", ""]
            for run, info in self.sts.items():
                temps = ", ".join(f"{t:.3g}" for t in info.get("temperatures", []))
                ci = info.get("ece_after_ci")
                ci_text = f" [95%: {format_cell(ci[0])}, {format_cell(ci[1])}]" if ci else ""
                parts.append(
                    f"- {run}: temperatures [{temps}]; "
                    f"ECE {format_cell(info.get('ece_before'))} -> "
                    f"{format_cell(info.get('ece_after'))}{ci_text} "
                    f"({info.get('evaluation', '')}); verdict: **{info.get('verdict', 'ok')}**"
                )
                parts += [f"  - **CAVEAT** {c}" for c in info.get("caveats", [])]
            parts.append("")
        if len(self.divergences):
            parts += [
                "## Divergences (first 50)",
                "",
                markdown_table(self.divergences.head(50)),
                "",
            ]
        if self.problems:
            parts += ["## Data problems", ""] + [f"- {p}" for p in self.problems[:100]] + [""]
        return "\n".join(parts)

    def tail_model_lines(self) -> list[str]:
        """Per compact run: which tail model filled unresolved offsets, and the sweep cell
        (bench/bench_estimator_sweep.py) that measured the estimator where the run sits."""
        return [
            f"{run}: {describe_tail(info)}"
            for run, info in self.meta.get("tail_models", {}).items()
        ]

    def to_rich(self) -> Any:
        """A rich renderable (Group of tables): ``rich.print(report.to_rich())``."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        items: list[Any] = []
        for w in self.warnings:
            items.append(Text(f"WARNING: {w}", style="bold red"))

        def table(title: str, frame: pd.DataFrame, headers: dict[str, str] | None = None) -> Table:
            t = Table(title=title, show_lines=False)
            for c in frame.columns:
                t.add_column(
                    (headers or {}).get(c, str(c)),
                    justify="left" if frame[c].dtype == object else "right",
                )
            for row in frame.itertuples(index=False):
                t.add_row(*[format_cell(v) for v in row])
            return t

        # Two narrow tables rather than one wide one: readable in an 80-column terminal.
        w = self.workloads
        keys = [c for c in WORKLOAD_KEYS if c in w.columns]
        first = [c for c in WORKLOAD_CEILING if c in w.columns]
        second = [c for c in w.columns if c not in keys and c not in first]
        items.append(table("Windows and ceiling per workload", w[keys + first], HEADERS))
        items.append(table("Estimate (compact alone) and calibration", w[keys + second], HEADERS))
        if len(self.validation):
            v = self.validation
            vcols = [
                c
                for c in (
                    "run_id",
                    "workload",
                    "mean_lo",
                    "mean_hi",
                    "truth_mean_uncut",
                    "inside_bracket",
                    "mean_point",
                    "point_ci_lo",
                    "point_ci_hi",
                    "truth_mean_ceiling",
                    "point_pct_err",
                    "interval_covers",
                )
                if c in v.columns
            ]
            items.append(table("Estimator vs companion truth", v[vcols]))
        for line in self.tail_model_lines():
            items.append(Text(f"Estimator tail model: {line}"))
        if len(self.calibration):
            cols = [
                c
                for c in (
                    "run_id",
                    "workload",
                    "position",
                    "n",
                    "pred_mean",
                    "label_mean",
                    "ece",
                    "ece_lo",
                    "ece_hi",
                    "brier",
                    "auroc",
                )
                if c in self.calibration.columns
            ]
            items.append(table("Calibration per position", self.calibration[cols]))
        if self.problems:
            items.append(
                Text(f"{len(self.problems)} data problem(s); see JSON/Markdown", style="yellow")
            )
        return Group(*items)

    def print_rich(self, console: Any = None) -> None:
        from rich.console import Console

        (console or Console()).print(self.to_rich())


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
    tables: dict[str, list[pd.DataFrame]] = {
        k: []
        for k in (
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
    }
    sts_info: dict[str, Any] = {}
    primary = sorted(set(text_column(rs, "run_id", ""))) if len(rs) else []
    comp_ids = sorted(set(text_column(crs, "run_id", ""))) if len(crs) else []

    for run in primary:
        rows = rs.loc[text_column(rs, "run_id", "") == run]
        rreq = rq.loc[text_column(rq, "run_id", "") == run] if len(rq) else rq
        mode = _mode(rn, run)
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

        # STS: judge given temperatures on everything, or fit on part and judge the rest
        try:
            data = sts_data_from_req_steps(rows, runs=rn if len(rn) else None)
            if len(data.logits) == 0:
                raise ValueError("no step carries a full confidence vector")
            if temps is not None:
                rows_by = []
                for w in sorted(set(data.workload.tolist())):
                    part = data.subset(data.workload == w)
                    rows_by.append(
                        {
                            "workload": w,
                            "requests": int(np.unique(part.request).size),
                            "ece_before": pooled_ece(
                                part.logits, part.prefix_mask, None, part.observed, n_bins
                            ),
                            "ece_after": pooled_ece(
                                part.logits, part.prefix_mask, temps, part.observed, n_bins
                            ),
                        }
                    )
                by_wl = pd.DataFrame(
                    rows_by, columns=["workload", "requests", "ece_before", "ece_after"]
                )
                before = pooled_ece(data.logits, data.prefix_mask, None, data.observed, n_bins)
                after = pooled_ece(data.logits, data.prefix_mask, temps, data.observed, n_bins)
                verdict = sts_verdict(
                    before, after, int(np.unique(data.request).size), judged_on="all"
                )
                caveats = verdict.reasons
                sts_info[run] = {
                    "temperatures": temps,
                    "evaluation": "given temperatures, all requests",
                    "ece_before": before,
                    "ece_after": after,
                    "verdict": verdict.status,
                    "caveats": caveats,
                }
            else:
                ho = fit_sts_heldout(
                    data, heldout_frac=heldout_frac, seed=seed, n_bins=n_bins, n_boot=n_boot
                )
                by_wl = ho.by_workload
                verdict = ho.verdict()
                caveats = verdict.reasons
                sts_info[run] = {
                    "temperatures": ho.calibration.temperatures,
                    "calibration": ho.calibration.to_dict(),
                    "evaluation": (
                        f"fit on {ho.fit_requests} requests, held-out {ho.heldout_requests}"
                    ),
                    "fit_requests": ho.fit_requests,
                    "heldout_requests": ho.heldout_requests,
                    "ece_before": ho.pooled_before,
                    "ece_after": ho.pooled_after,
                    "ece_after_ci": list(ho.after_ci),
                    "ece_change_ci": list(ho.change_ci),
                    "verdict": verdict.status,
                    "caveats": caveats,
                    "ece_before_per_position": ho.ece_before,
                    "ece_after_per_position": ho.ece_after,
                    "by_workload": ho.by_workload,
                }
            warn_list.extend(f"{run}: STS {c}" for c in caveats)
            wk = wk.merge(
                by_wl[["workload", "ece_before", "ece_after"]].rename(
                    columns={"ece_before": "ece_sts_before", "ece_after": "ece_sts"}
                ),
                on="workload",
                how="left",
            )
            wk["sts_note"] = [
                _sts_note(n, b, a)
                for n, b, a in zip(
                    wk["workload"].map(
                        dict(zip(by_wl["workload"], by_wl["requests"], strict=True))
                    ),
                    wk["ece_sts_before"],
                    wk["ece_sts"],
                    strict=True,
                )
            ]
        except ValueError as exc:
            warn_list.append(f"{run}: STS not evaluated ({exc})")

        # companion truth
        cap_id = find_companion(rn, run) if len(rn) else None
        if cap_id is None and len(primary) == 1 and len(comp_ids) == 1:
            cap_id = comp_ids[0]
        comp = None
        if cap_id is not None and cap_id in comp_ids:
            cap_rows = crs.loc[text_column(crs, "run_id", "") == cap_id]
            cap_req = crq.loc[text_column(crq, "run_id", "") == cap_id] if len(crq) else None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", CompanionDivergence)
                comp = pair_companion(rows, cap_rows, rreq if len(rreq) else None, cap_req)
            for w in caught:
                warnings.warn(w.message, w.category, stacklevel=2)
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

        # estimator on compact runs
        if mode == "compact":
            est = estimate_blocks(
                rows, rreq if len(rreq) else None, tail=tail, runs=rn if len(rn) else None
            )
            problems += [f"{run}: {p}" for p in est.problems]
            summ = est.summary(("workload",), n_boot=n_boot, seed=seed)
            tail_info = est.tail_model.describe() if est.tail_model is not None else {}
            cell = validation_cell(float(est.blocks["censored"].mean()), sampling_kind(rows))
            tail_info["validation_cell"] = cell
            tail_models[run] = tail_info
            summ = summ.assign(
                tail_model=tail_info.get("tail_model", tail), validation_cell=describe_cell(cell)
            )
            tables["estimator"].append(_with_run(summ, run))
            wk = wk.merge(
                summ[
                    [
                        "workload",
                        "mean_lo",
                        "mean_mid",
                        "mean_hi",
                        "mean_point",
                        "point_ci_lo",
                        "point_ci_hi",
                    ]
                ].rename(
                    columns={
                        "mean_lo": "est_lo",
                        "mean_mid": "est_mid",
                        "mean_hi": "est_hi",
                        "mean_point": "est_point",
                        "point_ci_lo": "est_ci_lo",
                        "point_ci_hi": "est_ci_hi",
                    }
                ),
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
