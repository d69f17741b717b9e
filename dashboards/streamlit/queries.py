"""What the dashboard shows, as functions over the store: SQL on its views, analytics on frames.

Why a module of its own: the pages stay thin (layout only), the same functions are
benchmarked over a 10-million-row store (bench/bench_dashboard_queries.py) and tested without
a browser. Every function is read-only (``Store.query`` refuses writes) and returns a pandas
DataFrame (or a small dataclass of them); the store may be ingesting while they run, each
query sees every segment acknowledged so far.

Two kinds of functions:

* All-runs aggregates (``run_table``, ``workload_table``, ``window_histogram``,
  ``ceiling_by_workload``, ``cost_model``, ``compare_runs``): added up from per-segment
  partials (rollups.py), so their cost does not grow with the store; latency quantiles
  (``latency``, ``exact_latency``) are exact, from the requests table (one row per
  request); per-run views (``window_per_step``, ``budget_per_step``, one request) are SQL
  on the run's partition.
* Analytics (``ceiling_estimate``, ``calibration``): one run's rows go through the project's
  own functions (:mod:`dspark_obs.analytics`) so the maths is the report's, never redone here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import rollups

from dspark_obs.analytics import (
    calibration_table,
    estimate_blocks,
    fit_sts_heldout,
    position_labels,
    reliability_table,
    sts_data_from_req_steps,
    validate_estimator,
)
from dspark_obs.analytics.estimator_cells import sampling_kind, validation_cell
from dspark_obs.analytics.sts import logit as conf_logit
from dspark_obs.analytics.sts import sigmoid, split_requests
from dspark_obs.analytics.sts_verdict import StsVerdict
from dspark_obs.engine.costs import CostTable, CostTableError
from dspark_obs.store import Store

__all__ = [
    "Calibration",
    "CeilingEstimate",
    "Filters",
    "budget_per_step",
    "calibration",
    "ceiling_by_workload",
    "bench_runs",
    "ceiling_estimate",
    "ceiling_source",
    "compare_runs",
    "exact_latency",
    "run_ceiling",
    "cost_model",
    "cost_table_of",
    "filter_options",
    "latency",
    "request_list",
    "request_steps",
    "request_detail",
    "run_table",
    "store_rows",
    "window_histogram",
    "window_per_step",
    "workload_table",
]

# Modes whose ceiling is measured: the whole block was verified. A compact run's ceiling is
# hidden: never shown as if measured (it is the estimator's, labelled so, or unknown).
MEASURED_CEILING_MODES = ("cap-accept", "static")
HIDDEN_CEILING = "hidden"
MAX_STEP_BUCKETS = 120  # per-step charts: at most this many columns, whatever the run length
MAX_SCATTER_POINTS = 4000  # cost-model scatter: a deterministic sample of steps


def _lit(value: str) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(_lit(v) for v in values)})"


@dataclass(frozen=True)
class Filters:
    """The sidebar's selection; an empty tuple means "all"."""

    runs: tuple[str, ...] = ()
    workloads: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()

    def where(self, run_col: str = "run_id", workload_col: str | None = "workload") -> str:
        """A SQL condition (``true`` when nothing is selected). Mode goes through ``runs``."""
        parts = []
        if self.runs:
            parts.append(_in(run_col, self.runs))
        if self.modes:
            parts.append(f"{run_col} IN (SELECT run_id FROM runs WHERE {_in('mode', self.modes)})")
        if self.workloads and workload_col is not None:
            parts.append(_in(f"coalesce({workload_col}, 'unknown')", self.workloads))
        return " AND ".join(parts) or "true"


def _df(store: Store, sql: str) -> pd.DataFrame:
    return store.query(sql).to_pandas()


def store_rows(store: Store) -> dict[str, int]:
    """Rows per table: tells an empty store (show the command to run) from a filled one."""
    return {
        "runs": len(_runs(store)),
        "steps": int(rollups.partials(store, "steps")["steps_all"].sum()),
        "req_steps": int(rollups.partials(store, "req_steps")["n"].sum()),
        "requests": int(rollups.partials(store, "requests")["n"].sum()),
    }


def filter_options(store: Store) -> dict[str, list[str]]:
    """Values the sidebar offers: runs (newest first), workloads, modes."""
    runs = _runs(store)
    workloads = set(rollups.partials(store, "requests")["workload"])
    workloads |= set(rollups.partials(store, "req_steps")["workload"])
    return {
        "runs": runs["run_id"].tolist(),
        "modes": sorted(set(runs["mode"].dropna())),
        "workloads": sorted(workloads),
    }


# ---------------------------------------------------------------- overview

_REQUEST_TIMES = """
    first_token_time - arrival_time AS ttft_s,
    (finish_time - first_token_time) / greatest(completion_tokens - 1, 1) AS tpot_s,
    finish_time - arrival_time AS e2e_s
"""


def _runs(store: Store) -> pd.DataFrame:
    """The runs table (newest first), from the rollups: no query unless a run was added."""
    runs = rollups.partials(store, "runs").drop_duplicates("run_id", keep="last")
    return runs.sort_values(["started_at", "run_id"], ascending=[False, True],
                            na_position="last").reset_index(drop=True)  # fmt: skip


def _select(frame: pd.DataFrame, f: Filters, runs: pd.DataFrame, workload: bool = True):
    """The rows of a rollup frame the filters keep (same rules as Filters.where)."""
    keep = np.ones(len(frame), dtype=bool)
    if f.runs:
        keep &= frame["run_id"].isin(f.runs).to_numpy()
    if f.modes:
        keep &= frame["run_id"].isin(runs.loc[runs["mode"].isin(f.modes), "run_id"]).to_numpy()
    if f.workloads and workload and "workload" in frame.columns:
        keep &= frame["workload"].isin(f.workloads).to_numpy()
    return frame.loc[keep]


def ceiling_source(mode: object) -> str:
    """How a run's ceiling is known: measured | hidden (compact) | unknown (no runs row)."""
    if mode in MEASURED_CEILING_MODES:
        return "measured"
    return "unknown" if not isinstance(mode, str) else HIDDEN_CEILING


def _xor(values: pd.Series) -> int:
    return int(np.bitwise_xor.reduce(values.to_numpy(dtype=np.uint64))) if len(values) else 0


def run_table(store: Store, f: Filters = Filters()) -> pd.DataFrame:
    """One row per run: mode, requests, tokens/s, accept length, windows, TTFT/TPOT, companion.

    From the per-segment rollups (rollups.py), so its cost does not grow with the store.
    tokens/s = completion tokens / (last finish - first arrival): the run's throughput.
    TTFT / TPOT quantiles are exact (DuckDB's quantile_cont over the stored requests).
    companion_status: none | partial (n/m finished) | identical | diverged: the companion has
    finished as many requests and an equal xor of hash(rid, output tokens), or not.
    """
    runs = _runs(store)
    rs = _select(rollups.partials(store, "req_steps"), f, runs)
    rq = _select(rollups.partials(store, "requests"), f, runs)
    steps = rs.assign(verified=rs["verify_len"] * rs["n"]).groupby("run_id").agg(
        req_steps=("n", "sum"), committed=("committed", "sum"), verified=("verified", "sum"),
        last_record=("last_ts", "max"),
    )  # fmt: skip
    steps["accept_length"] = steps["committed"] / steps["req_steps"]
    steps["mean_window"] = steps["verified"] / steps["req_steps"]
    reqs = rq.groupby("run_id").agg(
        requests=("n", "sum"), tokens=("tokens", "sum"), t0=("t0", "min"), t1=("t1", "max"),
    )  # fmt: skip
    reqs["tokens_per_s"] = reqs["tokens"] / (reqs["t1"] - reqs["t0"]).where(lambda d: d > 0)
    all_rq = rollups.partials(store, "requests")
    sig = all_rq.groupby("run_id").agg(n=("n", "sum"), out_hash=("out_hash", _xor))
    lat = exact_latency(store, f, ("run_id",), (0.5, 0.95))
    ttft = lat[lat["metric"] == "ttft_s"]
    tpot = lat[lat["metric"] == "tpot_s"]
    out = runs.set_index("run_id")
    out = out.join(reqs[["requests", "tokens", "tokens_per_s"]])
    out = out.join(steps[["accept_length", "mean_window", "req_steps", "last_record"]])
    out = out.join(
        ttft.set_index("run_id")[["p50", "p95"]].rename(
            columns={"p50": "ttft_p50_s", "p95": "ttft_p95_s"}
        )
    )
    out = out.join(tpot.set_index("run_id")[["p50"]].rename(columns={"p50": "tpot_p50_s"}))
    companion = runs.dropna(subset=["companion_of"]).drop_duplicates("companion_of")
    out["companion"] = out.index.map(dict(zip(companion["companion_of"], companion["run_id"],
                                              strict=True)))  # fmt: skip

    def status(run_id: str, row: pd.Series) -> str:
        if isinstance(row["companion_of"], str):
            return f"companion of {row['companion_of']}"
        comp = row["companion"]
        if not isinstance(comp, str):
            return "none"
        mine = sig.loc[run_id] if run_id in sig.index else None
        theirs = sig.loc[comp] if comp in sig.index else None
        done = int(theirs["n"]) if theirs is not None else 0
        total = int(mine["n"]) if mine is not None else 0
        if done < total or total == 0:
            return f"partial ({done}/{total})"
        return "identical" if int(mine["out_hash"]) == int(theirs["out_hash"]) else "diverged"

    out["companion_status"] = [status(i, r) for i, r in out.iterrows()]
    out = out.reset_index()
    out = _select(out, replace(f, workloads=()), runs)
    if f.workloads:  # runs with no row of the selected workloads drop out
        out = out[out["run_id"].isin(set(rs["run_id"]) | set(rq["run_id"]))]
    return out.reset_index(drop=True)


def workload_table(store: Store, f: Filters = Filters()) -> pd.DataFrame:
    """Per run and workload: req-steps, finished requests, mean window, committed, ceiling,
    tokens, utilization (a ratio of sums) -- the workload_summary view's numbers, from the
    rollups (its distinct-step count is left out: not additive over segments). The ceiling
    columns are NaN where it is not measured (compact), as in the view; ceiling_source says
    why."""
    runs = _runs(store)
    rs = _select(rollups.partials(store, "req_steps"), f, runs)
    rq = _select(rollups.partials(store, "requests"), f, runs)
    g = rs.assign(verified=rs["verify_len"] * rs["n"]).groupby(["run_id", "workload"]).agg(
        req_steps=("n", "sum"), verified=("verified", "sum"), committed_tokens=("committed", "sum"),
        ceiling_tokens=("ceiling", "sum"),
    )  # fmt: skip
    g = g.join(rq.groupby(["run_id", "workload"])["n"].sum().rename("requests"))
    g["mean_verify_len"] = g["verified"] / g["req_steps"]
    g["mean_acc_len"] = g["committed_tokens"] / g["req_steps"]
    g = g.reset_index().merge(runs[["run_id", "mode"]], on="run_id", how="left")
    g["ceiling_source"] = g["mode"].map(ceiling_source)
    measured = g["ceiling_source"] == "measured"  # as the view: hidden ceilings are NULL
    g["ceiling_tokens"] = g["ceiling_tokens"].where(measured)
    g["mean_ceiling"] = g["ceiling_tokens"] / g["req_steps"]
    g["utilization"] = g["committed_tokens"] / g["ceiling_tokens"].where(lambda c: c > 0)
    cols = [
        "run_id",
        "workload",
        "mode",
        "req_steps",
        "requests",
        "mean_verify_len",
        "mean_acc_len",
        "mean_ceiling",
        "committed_tokens",
        "ceiling_tokens",
        "utilization",
        "ceiling_source",
    ]
    return g[cols].sort_values(["run_id", "workload"]).reset_index(drop=True)  # fmt: skip


LATENCY_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def _qname(q: float) -> str:
    return f"p{round(100 * q):02d}"


def exact_latency(
    store: Store, f: Filters, by: tuple[str, ...], qs: tuple[float, ...] = LATENCY_QUANTILES
) -> pd.DataFrame:
    """Exact TTFT / TPOT quantiles per group (long format: by..., metric, n, p05...).

    DuckDB's ``quantile_cont`` over the stored requests (linear interpolation between order
    statistics: the median of an even count is the mean of the middle two). One row per
    request, so the scan is small next to req_steps; never a histogram estimate.
    """
    cols = ", ".join(by)
    qlist = ", ".join(repr(float(q)) for q in qs)
    names = [_qname(q) for q in qs]
    sql = f"""
        WITH t AS (
            SELECT run_id, coalesce(workload, 'unknown') AS workload,
                   first_token_time - arrival_time AS ttft_s,
                   CASE WHEN completion_tokens > 1 THEN (finish_time - first_token_time)
                        / (completion_tokens - 1) END AS tpot_s
            FROM requests WHERE {f.where()})
        SELECT {cols}, metric, count(*) AS n, quantile_cont(v, [{qlist}]) AS q
        FROM t UNPIVOT (v FOR metric IN (ttft_s, tpot_s))
        WHERE v IS NOT NULL AND isfinite(v) GROUP BY ALL ORDER BY ALL"""
    out = _df(store, sql)
    if len(out) == 0:
        return pd.DataFrame(columns=[*by, "metric", "n", *names])
    quant = pd.DataFrame(out.pop("q").tolist(), columns=names, index=out.index)
    return pd.concat([out, quant], axis=1)


def latency(store: Store, f: Filters = Filters()) -> pd.DataFrame:
    """TTFT and TPOT (TTFT excluded, as SGLang's bench_serving) per run and workload:
    exact p05, p25, p50, p75, p95 from the stored requests (long format)."""
    cols = ["run_id", "workload", "n", *map(_qname, LATENCY_QUANTILES), "metric"]
    return exact_latency(store, f, ("run_id", "workload"))[cols]


# ---------------------------------------------------------------- windows


def window_histogram(store: Store, f: Filters = Filters()) -> pd.DataFrame:
    """Verify-window histogram per run and workload: req-steps at each verify_len, and share."""
    rs = _select(rollups.partials(store, "req_steps"), f, _runs(store))
    rs = rs[rs["verify_len"] >= 1]
    h = rs.groupby(["run_id", "workload", "verify_len"], as_index=False)["n"].sum()
    h = h.rename(columns={"n": "steps"})
    h["share"] = h["steps"] / h.groupby(["run_id", "workload"])["steps"].transform("sum")
    return h.sort_values(["run_id", "workload", "verify_len"]).reset_index(drop=True)


def _step_width(store: Store, f: Filters, table: str, workload_col: str | None) -> int:
    top = (
        store.query(
            f"SELECT max(forward_ct) AS m FROM {table} WHERE {f.where(workload_col=workload_col)}"
        )
        .column(0)[0]
        .as_py()
    )
    return max(1, -(-int(top or 0) // MAX_STEP_BUCKETS))


def window_per_step(store: Store, f: Filters = Filters()) -> pd.DataFrame:
    """How windows are spread over a run's steps (the SGLang study's Figure 4 view).

    Steps are grouped into at most MAX_STEP_BUCKETS buckets of ``step_width`` decode steps;
    per bucket and verify_len: how many req-steps chose that window.
    """
    width = _step_width(store, f, "req_steps", "workload")
    return _df(
        store,
        f"""SELECT run_id, (forward_ct // {width}) * {width} AS step, verify_len,
                   count(*) AS req_steps, {width} AS step_width
            FROM req_steps WHERE {f.where()} GROUP BY ALL ORDER BY ALL""",
    )


def budget_per_step(store: Store, f: Filters = Filters()) -> pd.DataFrame:
    """Per step bucket: the planner's budget (extra verify tokens), verify tokens, batch size.

    Budgets belong to batch steps (SGLang's -1 = unset excluded), so no workload filter.
    """
    width = _step_width(store, f, "steps", None)
    return _df(
        store,
        f"""SELECT run_id, (forward_ct // {width}) * {width} AS step,
                   avg(budget) FILTER (WHERE budget >= 0) AS budget,
                   avg(num_verify_tokens) FILTER (WHERE num_verify_tokens >= 0) AS verify_tokens,
                   avg(bs) FILTER (WHERE bs >= 0) AS batch_size, {width} AS step_width
            FROM steps WHERE {f.where(workload_col=None)} GROUP BY ALL ORDER BY ALL""",
    )


# ---------------------------------------------------------------- ceiling


def ceiling_by_workload(store: Store, f: Filters = Filters()) -> pd.DataFrame:
    """Committed vs ceiling per workload, measured by cap-accept runs (the ceiling's truth).

    A cap-accept run commits what its compact run commits, and its cap_trim says what a
    full-block verify would have added: ceiling = acc_len + cap_trim. Rows are labelled with
    the compact run they shadow (``run_id``) and the cap-accept run that measured it; a
    filter on either run selects the pair.
    """
    runs = _runs(store)
    caps = runs[runs["mode"] == "cap-accept"]
    shadow = dict(zip(caps["run_id"], caps["companion_of"].fillna(caps["run_id"]), strict=True))
    rs = rollups.partials(store, "req_steps")
    rs = rs[rs["run_id"].isin(shadow)]
    if f.workloads:
        rs = rs[rs["workload"].isin(f.workloads)]
    if f.runs or f.modes:
        pick = set(_select(runs, replace(f, workloads=()), runs)["run_id"])
        rs = rs[rs["run_id"].isin(pick) | rs["run_id"].map(shadow).isin(pick)]
    g = rs.groupby(["run_id", "workload"], as_index=False).agg(
        steps=("n", "sum"), committed_tokens=("committed", "sum"),
        ceiling_tokens=("ceiling", "sum"),
    )  # fmt: skip
    g.insert(0, "measured_by", g.pop("run_id"))
    g.insert(0, "run_id", g["measured_by"].map(shadow))
    g["mean_committed"] = g["committed_tokens"] / g["steps"]
    g["mean_ceiling"] = g["ceiling_tokens"] / g["steps"]
    g["utilization"] = g["committed_tokens"] / g["ceiling_tokens"].where(lambda c: c > 0)
    g["tokens_left"] = g["ceiling_tokens"] - g["committed_tokens"]
    return g.sort_values(["run_id", "workload"]).reset_index(drop=True)


_EST_COLUMNS = (
    "run_id, dp_rank, forward_ct, rid, gamma, prefix_len, verify_len, acc_len, correct_drafts, "
    "cap_trim, bonus_token, draft_tokens, confidence, survival, workload, temperature, top_p, "
    "top_k, is_last, trimmed_tokens, q_lp, pg"
)


@dataclass
class CeilingEstimate:
    """The block-accept estimator on a compact run alone, beside its companion's truth."""

    run_id: str
    summary: pd.DataFrame  # per workload: mean_lo, mean_mid, mean_hi, mean_point, CIs ...
    validation: pd.DataFrame  # per workload vs the companion (empty without one)
    problems: list[str] = field(default_factory=list)
    tail: dict[str, Any] = field(default_factory=dict)  # tail model used + its validation cell


def _runs_frame(store: Store, run_ids: list[str]) -> pd.DataFrame:
    where = _in("run_id", tuple(run_ids))
    return _df(store, f"SELECT run_id, mode, temperature FROM runs WHERE {where}")


def ceiling_estimate(store: Store, run_id: str, n_boot: int = 200) -> CeilingEstimate:
    """Estimator [lo, point, hi] per workload for a compact run, validated on its companion."""
    rows = _df(store, f"SELECT {_EST_COLUMNS} FROM req_steps WHERE run_id = {_lit(run_id)}")
    reqs = _df(store, f"FROM requests WHERE run_id = {_lit(run_id)}")
    comp = (
        store.query(f"SELECT run_id FROM runs WHERE companion_of = {_lit(run_id)} LIMIT 1")
        .column(0)
        .to_pylist()
    )
    runs = _runs_frame(store, [run_id, *comp])
    if len(rows) == 0:
        return CeilingEstimate(run_id, pd.DataFrame(), pd.DataFrame(), ["no req_steps rows"])
    est = estimate_blocks(rows, reqs if len(reqs) else None, runs=runs)
    summary = est.summary(("workload",), n_boot=n_boot)
    validation = pd.DataFrame()
    if comp:
        cap = _df(store, f"SELECT {_EST_COLUMNS} FROM req_steps WHERE run_id = {_lit(comp[0])}")
        if len(cap):
            validation = validate_estimator(summary, cap, by=("workload",), n_boot=n_boot)
    tail = est.tail_model.describe() if est.tail_model is not None else {}
    tail["validation_cell"] = validation_cell(
        float(est.blocks["censored"].mean()), sampling_kind(rows)
    )
    return CeilingEstimate(run_id, summary, validation, list(est.problems), tail)


@dataclass
class RunCeiling:
    """The first-screen figures of one run: committed vs ceiling, and how the ceiling is known.

    ``source``: "measured" (the run verified whole blocks), "measured by companion <id>" (a
    compact run's cap-accept companion, same requests), "estimated" (block-accept estimator
    on the compact run alone: ``*_lo`` / ``*_hi`` are its 95% interval) or "unknown". Figures
    that cannot be known are NaN, never a measured-looking 1.0.
    """

    run_id: str
    mode: str | None
    source: str
    committed: float = np.nan  # committed tokens per request-step (accept length)
    ceiling: float = np.nan  # ceiling per request-step
    ceiling_lo: float = np.nan
    ceiling_hi: float = np.nan
    utilization: float = np.nan
    utilization_lo: float = np.nan
    utilization_hi: float = np.nan
    tokens_left: float = np.nan
    tokens_left_lo: float = np.nan
    tokens_left_hi: float = np.nan
    mean_window: float = np.nan
    ece: float = np.nan  # raw confidences, pooled over positions (SGLang's definition)
    ece_n: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def estimated(self) -> bool:
        return self.source == "estimated"


def _step_sums(store: Store, run_id: str) -> dict[str, float]:
    row = store.query(
        "SELECT count(*) AS n, sum(acc_len) AS committed, sum(coalesce(cap_trim, 0)) AS trim, "
        f"sum(verify_len) AS verified FROM req_steps WHERE run_id = {_lit(run_id)}"
    ).to_pylist()[0]
    return {k: float(v) if v is not None else np.nan for k, v in row.items()}


def run_ceiling(store: Store, run_id: str, n_boot: int = 200) -> RunCeiling:
    """Committed vs ceiling for one run, the ceiling measured, or estimated with its interval."""
    runs = _runs(store)
    me = runs[runs["run_id"] == run_id]
    mode = me["mode"].iloc[0] if len(me) else None
    own = _step_sums(store, run_id)
    out = RunCeiling(run_id, mode if isinstance(mode, str) else None, "unknown")
    if not own["n"]:
        out.problems.append("no req_steps rows yet")
        return out
    out.committed = own["committed"] / own["n"]
    out.mean_window = own["verified"] / own["n"]
    comp = runs[(runs["companion_of"] == run_id) & (runs["mode"] == "cap-accept")]["run_id"]
    measured_by = run_id if mode in MEASURED_CEILING_MODES else None
    if measured_by is None and len(comp):
        measured_by = sorted(comp)[0]
    if measured_by is not None:
        sums = own if measured_by == run_id else _step_sums(store, measured_by)
        if sums["n"]:
            out.source = "measured" if measured_by == run_id else f"measured by {measured_by}"
            ceiling = sums["committed"] + sums["trim"]
            out.ceiling = out.ceiling_lo = out.ceiling_hi = ceiling / sums["n"]
            out.utilization = out.utilization_lo = out.utilization_hi = (
                sums["committed"] / ceiling if ceiling > 0 else np.nan
            )
            out.tokens_left = out.tokens_left_lo = out.tokens_left_hi = sums["trim"]
    elif mode == "compact":
        rows = _df(store, f"SELECT {_EST_COLUMNS} FROM req_steps WHERE run_id = {_lit(run_id)}")
        reqs = _df(store, f"FROM requests WHERE run_id = {_lit(run_id)}")
        est = estimate_blocks(rows, reqs if len(reqs) else None, runs=_runs_frame(store, [run_id]))
        out.problems += list(est.problems)
        summ = est.summary((), n_boot=n_boot)
        if len(summ):
            r = summ.iloc[0]
            blocks, committed = float(r["blocks"]), float(r["mean_committed"])
            out.source = "estimated"
            out.ceiling = float(r["mean_point"])
            out.ceiling_lo, out.ceiling_hi = float(r["point_ci_lo"]), float(r["point_ci_hi"])
            out.utilization = committed / out.ceiling
            out.utilization_lo = committed / out.ceiling_hi
            out.utilization_hi = min(1.0, committed / out.ceiling_lo)
            out.tokens_left = blocks * (out.ceiling - committed)
            out.tokens_left_lo = max(0.0, blocks * (out.ceiling_lo - committed))
            out.tokens_left_hi = blocks * (out.ceiling_hi - committed)
    cal = _df(
        store,
        "SELECT run_id, dp_rank, forward_ct, rid, gamma, verify_len, acc_len, correct_drafts, "
        "cap_trim, confidence, survival, workload FROM req_steps "
        f"WHERE run_id = {_lit(run_id)} AND confidence IS NOT NULL",
    )
    if len(cal):
        table = calibration_table(position_labels(cal, runs=_runs_frame(store, [run_id])), by=())
        if len(table):
            out.ece, out.ece_n = float(table["ece"].iloc[0]), int(table["n"].iloc[0])
    return out


# ---------------------------------------------------------------- calibration


@dataclass
class Calibration:
    """Calibration of one run's confidence head, raw and after a held-out STS fit."""

    run_id: str
    metrics: pd.DataFrame  # workload, position, variant (raw | sts), n, ece, ece_lo, ece_hi ...
    reliability: pd.DataFrame  # workload, position, variant, bin, count, mean_pred, mean_label
    sts_json: str | None  # SGLang's STS JSON, fitted on this run's fit split
    evaluation: str  # how the STS numbers were obtained
    pooled: dict[str, float] = field(default_factory=dict)  # ece_before / ece_after held-out
    verdict: StsVerdict | None = None  # ok | too few to trust | worse: do not serve


def _with_sts(rows: pd.DataFrame, temperatures: list[float]) -> pd.DataFrame:
    """The same req-steps with confidences and survival after STS (SGLang's sigmoid(z/T))."""
    conf = np.array([np.asarray(c, dtype=np.float64) for c in rows["confidence"]])
    z = conf_logit(conf) / np.asarray(temperatures, dtype=np.float64)[None, : conf.shape[1]]
    cal = sigmoid(z)
    out = rows.copy()
    out["confidence"] = list(cal.astype(np.float32))
    out["survival"] = list(np.cumprod(cal, axis=1).astype(np.float32))
    return out


def calibration(
    store: Store,
    run_id: str,
    workloads: tuple[str, ...] = (),
    n_boot: int = 200,
    heldout_frac: float = 0.3,
    seed: int = 0,
) -> Calibration:
    """Reliability bins and ECE (15 equal-width bins, SGLang's definition) per position.

    STS is fitted on a request split of the run and both variants are judged on the
    held-out requests only, with bootstrap intervals over requests (never over steps).
    Without enough requests for a split, only the raw variant is shown.
    """
    wl_col = "coalesce(workload, 'unknown')"
    wl = f" AND {_in(wl_col, workloads)}" if workloads else ""
    rows = _df(
        store,
        "SELECT run_id, dp_rank, forward_ct, rid, gamma, verify_len, acc_len, correct_drafts, "
        "cap_trim, confidence, survival, workload, is_last FROM req_steps "
        f"WHERE run_id = {_lit(run_id)}{wl} AND confidence IS NOT NULL",
    )
    runs = _runs_frame(store, [run_id])
    empty = Calibration(run_id, pd.DataFrame(), pd.DataFrame(), None, "no confidence recorded")
    if len(rows) == 0:
        return empty
    by = ("workload", "position")
    variants: list[tuple[str, pd.DataFrame]] = []
    sts_json, evaluation, pooled, verdict = None, "raw confidences, all requests", {}, None
    try:
        ho = fit_sts_heldout(
            sts_data_from_req_steps(rows, runs=runs), heldout_frac=heldout_frac, seed=seed
        )
        keys = (rows["run_id"].astype(str) + "/" + rows["rid"].astype(str)).to_numpy()
        held = rows.loc[split_requests(keys, heldout_frac, seed)]
        if len(held) == 0 or ho.heldout_requests == 0:
            raise ValueError("no held-out request")
        variants = [("raw", held), ("sts", _with_sts(held, ho.calibration.temperatures))]
        sts_json = json.dumps(ho.calibration.to_dict(), indent=2)
        evaluation = f"STS fitted on {ho.fit_requests} requests, judged on {ho.heldout_requests}"
        pooled = {"ece_before": ho.pooled_before, "ece_after": ho.pooled_after}
        verdict = ho.verdict()
    except ValueError:
        variants = [("raw", rows)]
    metrics, bins = [], []
    for name, frame in variants:
        labels = position_labels(frame, runs=runs)
        table = calibration_table(labels, by=by, n_boot=n_boot, seed=seed)
        metrics.append(table.assign(variant=name))
        bins.append(reliability_table(labels, by=by).assign(variant=name))
    return Calibration(
        run_id,
        pd.concat(metrics, ignore_index=True),
        pd.concat(bins, ignore_index=True),
        sts_json,
        evaluation,
        pooled,
        verdict,
    )


# ---------------------------------------------------------------- cost model


def cost_model(store: Store, f: Filters = Filters()) -> dict[str, pd.DataFrame]:
    """Measured vs predicted step time.

    ``by_shape``: per run, batch size and verify tokens: mean predicted and measured ms and
    the mean residual (measured - predicted); ``points``: a deterministic sample of steps for
    the scatter (hash of the step key, the same steps on every refresh). Measured is the GPU
    time when the producer recorded one (SGLang), else the CPU wall time.
    """
    measured = "coalesce(nullif(step_gpu_ms, -1), step_cpu_ms)"
    base = (
        f"FROM steps WHERE {f.where(workload_col=None)} AND predicted_step_ms IS NOT NULL "
        f"AND predicted_step_ms >= 0 AND {measured} IS NOT NULL"
    )
    st = _select(rollups.partials(store, "steps"), f, _runs(store), workload=False)
    st = st[st["n"] > 0]
    thin = max(1, -(-int(st["n"].sum()) // MAX_SCATTER_POINTS))  # keep ~1/thin of the steps
    by_shape = st.groupby(["run_id", "bs", "num_verify_tokens"], as_index=False).agg(
        steps=("n", "sum"), predicted=("predicted", "sum"), measured=("measured", "sum")
    )
    by_shape["predicted_ms"] = by_shape.pop("predicted") / by_shape["steps"]
    by_shape["measured_ms"] = by_shape.pop("measured") / by_shape["steps"]
    by_shape["residual_ms"] = by_shape["measured_ms"] - by_shape["predicted_ms"]
    points = _df(
        store,
        f"""SELECT run_id, forward_ct, bs, num_verify_tokens, predicted_step_ms AS predicted_ms,
                   {measured} AS measured_ms, {measured} - predicted_step_ms AS residual_ms
            {base} AND hash(run_id, dp_rank, forward_ct) % {thin} = 0
            ORDER BY hash(run_id, dp_rank, forward_ct) LIMIT {MAX_SCATTER_POINTS}""",
    )
    return {"by_shape": by_shape, "points": points}


def cost_table_of(store: Store, run_id: str) -> tuple[pd.DataFrame, str]:
    """The cost table a run planned with (from its config), as rows, and a one-line note."""
    cfg = store.query(f"SELECT config FROM runs WHERE run_id = {_lit(run_id)}").column(0)
    text = cfg[0].as_py() if len(cfg) else None
    try:
        data: Any = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return pd.DataFrame(), f"run {run_id}: config is not JSON"
    raw = data.get("cost_table") if isinstance(data, dict) else None
    if not isinstance(raw, dict):
        return pd.DataFrame(), f"run {run_id} recorded no cost table (it verified whole blocks)"
    try:
        CostTable.from_dict(raw, source=f"runs[{run_id}].config.cost_table")
    except CostTableError as exc:
        return pd.DataFrame(), str(exc)
    if "bias_seconds" in raw:
        rows = [{"term": "bias", "key": "", "ms": 1e3 * raw["bias_seconds"]}]
        rows += [
            {"term": "alpha(bs)", "key": f"bs={b}", "ms": 1e3 * a}
            for b, a in zip(raw.get("bs_probes", []), raw.get("alpha_seconds", []), strict=False)
        ]
        rows += [
            {"term": "theta(M)", "key": f"M={m}", "ms": 1e3 * t}
            for m, t in zip(raw.get("m_probes", []), raw.get("theta_seconds", []), strict=False)
        ]
        note = "additive table: T(bs, K) = bias + alpha(bs) + theta(bs + K)"
        return pd.DataFrame(rows), note
    rows = [{"term": str(k), "key": "", "ms": v} for k, v in raw.items() if not isinstance(v, dict)]
    return pd.DataFrame(rows), "1-D steps-per-second table"


# ---------------------------------------------------------------- bench runs


def bench_runs(store: Store) -> pd.DataFrame:
    """Runs stored by ``dspark-obs bench`` (source bench): the summary its config holds."""
    rows = store.query(
        "SELECT run_id, mode, model, started_at, config FROM runs WHERE source = 'bench' "
        "ORDER BY started_at DESC NULLS LAST"
    ).to_pylist()
    out = []
    for r in rows:
        try:
            cfg = json.loads(r.pop("config") or "{}")
        except json.JSONDecodeError:
            cfg = {}
        summ = cfg.get("summary") or {}

        def dist(name: str, key: str, summ: dict = summ) -> Any:
            value = summ.get(name)
            return value.get(key) if isinstance(value, dict) else None

        out.append(
            {
                **r,
                "url": cfg.get("url"),
                "completed": summ.get("completed"),
                "failed": summ.get("failed"),
                "output_tok_per_s": summ.get("output_throughput"),
                "ttft_median_ms": dist("ttft_ms", "median"),
                "ttft_p99_ms": dist("ttft_ms", "p99"),
                "tpot_median_ms": dist("tpot_ms", "median"),
                "accept_length": summ.get("accept_length_pooled"),
            }
        )
    cols = ["run_id", "mode", "model", "started_at", "url", "completed", "failed",
            "output_tok_per_s", "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms",
            "accept_length"]  # fmt: skip
    return pd.DataFrame(out, columns=cols)


# ---------------------------------------------------------------- requests


def request_list(store: Store, f: Filters = Filters(), limit: int = 500) -> pd.DataFrame:
    """Requests to pick from (newest runs first): run, rid, workload, tokens, finish reason."""
    return _df(
        store,
        f"""SELECT run_id, rid, coalesce(workload, 'unknown') AS workload, completion_tokens,
                   finish_reason, {_REQUEST_TIMES}
            FROM requests WHERE {f.where()} ORDER BY run_id, rid LIMIT {int(limit)}""",
    )


def request_steps(store: Store, run_id: str, rid: str) -> pd.DataFrame:
    """One request's steps: window, committed, cap_trim, confidence and survival per draft."""
    return _df(
        store,
        f"""SELECT forward_ct, prefix_len, verify_len, acc_len, correct_drafts, cap_trim, gamma,
                   confidence, survival, draft_tokens, bonus_token, is_last
            FROM req_steps WHERE run_id = {_lit(run_id)} AND rid = {_lit(rid)}
            ORDER BY dp_rank, forward_ct""",
    )


def request_detail(store: Store, run_id: str, rid: str) -> dict[str, Any] | None:
    """The request's row (prompt text, output token ids, timings) or None."""
    rows = store.query(
        f"""SELECT *, {_REQUEST_TIMES} FROM requests
            WHERE run_id = {_lit(run_id)} AND rid = {_lit(rid)} LIMIT 1"""
    ).to_pylist()
    return rows[0] if rows else None


# ---------------------------------------------------------------- compare


def _request_buckets(store: Store, run_id: str, workloads: tuple[str, ...]) -> pd.DataFrame:
    """One run's requests in rollups.BUCKETS buckets (hash of the rid), summed per bucket.

    Resampling buckets of whole requests is the request bootstrap with the requests
    pre-grouped at random: the same expected variance, and a cost independent of the run's
    size. "requests" counts finished requests; the step sums include running ones.
    """
    f = Filters(runs=(run_id,), workloads=workloads)
    runs = _runs(store)
    steps = _select(rollups.partials(store, "req_buckets"), f, runs)
    reqs = _select(rollups.partials(store, "request_buckets"), f, runs)
    cols = ["steps", "committed", "ceiling", "verified"]
    both = (
        steps.groupby("bucket")[cols]
        .sum()
        .join(
            reqs.groupby("bucket")[["requests", "ttft_sum", "ttft_n", "tpot_sum", "tpot_n"]].sum(),
            how="outer",
        )
    )
    return both.fillna(0.0).reset_index()


# metrics that need a measured ceiling (NaN, never compared, for a compact run)
CEILING_METRICS = ("mean ceiling (ceiling / step)", "utilization (committed / ceiling)")
# metric -> (numerator, denominator) bucket columns: every metric is a ratio of sums
COMPARE_METRICS: dict[str, tuple[str, str]] = {
    "accept length (committed / step)": ("committed", "steps"),
    "mean window (verified / step)": ("verified", "steps"),
    "mean ceiling (ceiling / step)": ("ceiling", "steps"),
    "utilization (committed / ceiling)": ("committed", "ceiling"),
    "TTFT s (mean over requests)": ("ttft_sum", "ttft_n"),
    "TPOT s (mean over requests)": ("tpot_sum", "tpot_n"),
}


def _boot_ratios(frame: pd.DataFrame, w: np.ndarray) -> dict[str, np.ndarray]:
    """Every metric under bucket weights w [n_boot, n_buckets] (one matrix product)."""
    cols = sorted({c for pair in COMPARE_METRICS.values() for c in pair})
    sums = w @ frame[cols].to_numpy(dtype=np.float64)
    at = {c: sums[:, i] for i, c in enumerate(cols)}
    with np.errstate(invalid="ignore", divide="ignore"):
        return {m: at[n] / at[d] for m, (n, d) in COMPARE_METRICS.items()}


def compare_runs(
    store: Store,
    run_a: str,
    run_b: str,
    workloads: tuple[str, ...] = (),
    n_boot: int = 400,
    seed: int = 0,
    level: float = 0.95,
) -> pd.DataFrame:
    """Every headline metric of two runs, B - A, with a bootstrap interval over requests.

    Requests of each run are resampled independently (Poisson weights on request buckets),
    so the interval of the difference covers the request-to-request variation of both runs.
    A run whose ceiling is hidden (compact) has no mean ceiling and no utilization: those
    rows are NaN with the reason in ``note``, and no difference is computed for them.
    """
    modes = dict(zip(*(_runs(store)[c] for c in ("run_id", "mode")), strict=True))
    hidden = {r: ceiling_source(modes.get(r)) for r in (run_a, run_b)}
    a = _request_buckets(store, run_a, workloads)
    b = _request_buckets(store, run_b, workloads)
    rng = np.random.default_rng(seed)
    point_a = _boot_ratios(a, np.ones((1, len(a))))
    point_b = _boot_ratios(b, np.ones((1, len(b))))
    boot_a = _boot_ratios(a, rng.poisson(1.0, size=(n_boot, len(a))).astype(np.float64))
    boot_b = _boot_ratios(b, rng.poisson(1.0, size=(n_boot, len(b))).astype(np.float64))
    lo_q, hi_q = (1 - level) / 2, 1 - (1 - level) / 2
    rows = []
    for name in COMPARE_METRICS:
        va = float(point_a[name][0]) if len(a) else np.nan
        vb = float(point_b[name][0]) if len(b) else np.nan
        note = ""
        if name in CEILING_METRICS:
            unknown = [f"{r}: ceiling {src}" + (" (compact: its estimate or companion is on "
                       "the Ceiling page)" if src == HIDDEN_CEILING else "")
                       for r, src in hidden.items() if src != "measured"]  # fmt: skip
            if hidden[run_a] != "measured":
                va = np.nan
            if hidden[run_b] != "measured":
                vb = np.nan
            note = "; ".join(unknown)
        lo = hi = np.nan
        diff = boot_b[name] - boot_a[name] if len(a) and len(b) else np.array([])
        diff = diff[np.isfinite(diff)] if np.isfinite(va) and np.isfinite(vb) else diff[:0]
        if diff.size:
            lo, hi = (float(x) for x in np.quantile(diff, [lo_q, hi_q]))
        rows.append({"metric": name, "a": va, "b": vb, "diff": vb - va, "diff_lo": lo,
                     "diff_hi": hi, "note": note})  # fmt: skip
    na, nb = float(a["requests"].sum()), float(b["requests"].sum())
    rows.append(
        {"metric": "requests", "a": na, "b": nb, "diff": nb - na, "diff_lo": np.nan,
         "diff_hi": np.nan, "note": ""}
    )  # fmt: skip
    return pd.DataFrame(rows)
