"""The Overview page: the newest run's ceiling first (measured, measured by its companion, or
estimated with its interval), then every run at a glance and exact latency quantiles.

All-runs figures are added up from per-segment rollups (rollups.py), so their cost does not
grow with the store; latency quantiles are exact, from the requests table (one row per
request); one run's ceiling is SQL on its partition and the project's own analytics.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from dashboards.streamlit import rollups
from dashboards.streamlit.queries.calibration import confidence_rows
from dashboards.streamlit.queries.ceiling import block_estimate
from dashboards.streamlit.queries.shared import (
    MEASURED_CEILING_MODES,
    NO_FILTER,
    Filters,
    frame,
    lit,
    runs,
    runs_of,
    select,
)
from dspark_obs.analytics import calibration_table, position_labels
from dspark_obs.store import Store

__all__ = [
    "LATENCY_QUANTILES",
    "RunCeiling",
    "accept_by_workload",
    "exact_latency",
    "latency",
    "run_ceiling",
    "run_table",
    "step_totals",
]

LATENCY_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def _qname(q: float) -> str:
    return f"p{round(100 * q):02d}"


def step_totals(
    store: Store, f: Filters = NO_FILTER, by: tuple[str, ...] = ("run_id",)
) -> pd.DataFrame:
    """Req-steps, committed and verified tokens per group (run_id, workload), from the rollups;
    accept length and mean window as ratios of those sums, and the newest record's time."""
    rs = select(rollups.partials(store, "req_steps"), f, runs(store))
    g = rs.assign(verified=rs["verify_len"] * rs["n"]).groupby(list(by)).agg(
        req_steps=("n", "sum"), committed=("committed", "sum"), verified=("verified", "sum"),
        last_record=("last_ts", "max"),
    )  # fmt: skip
    g["accept_length"] = g["committed"] / g["req_steps"]
    g["mean_window"] = g["verified"] / g["req_steps"]
    return g


def accept_by_workload(store: Store, f: Filters = NO_FILTER) -> pd.DataFrame:
    """Accept length (committed / req-step) and mean window per run and workload."""
    return step_totals(store, f, ("run_id", "workload")).reset_index()


def _xor(values: pd.Series) -> int:
    return int(np.bitwise_xor.reduce(values.to_numpy(dtype=np.uint64))) if len(values) else 0


def run_table(store: Store, f: Filters = NO_FILTER) -> pd.DataFrame:
    """One row per run: mode, requests, tokens/s, accept length, windows, TTFT/TPOT, companion.

    tokens/s = completion tokens / (last finish - first arrival): the run's throughput.
    TTFT / TPOT quantiles are exact (DuckDB's quantile_cont over the stored requests).
    companion_status: none | partial (n/m finished) | identical | diverged: the companion has
    finished as many requests and an equal xor of hash(rid, output tokens), or not.
    """
    all_runs = runs(store)
    steps = step_totals(store, f)
    rq = select(rollups.partials(store, "requests"), f, all_runs)
    reqs = rq.groupby("run_id").agg(
        requests=("n", "sum"), tokens=("tokens", "sum"), t0=("t0", "min"), t1=("t1", "max"),
    )  # fmt: skip
    reqs["tokens_per_s"] = reqs["tokens"] / (reqs["t1"] - reqs["t0"]).where(lambda d: d > 0)
    all_rq = rollups.partials(store, "requests")
    sig = all_rq.groupby("run_id").agg(n=("n", "sum"), out_hash=("out_hash", _xor))
    lat = exact_latency(store, f, ("run_id",), (0.5, 0.95))
    ttft = lat[lat["metric"] == "ttft_s"]
    tpot = lat[lat["metric"] == "tpot_s"]
    out = all_runs.set_index("run_id")
    out = out.join(reqs[["requests", "tokens", "tokens_per_s"]])
    out = out.join(steps[["accept_length", "mean_window", "req_steps", "last_record"]])
    out = out.join(
        ttft.set_index("run_id")[["p50", "p95"]].rename(
            columns={"p50": "ttft_p50_s", "p95": "ttft_p95_s"}
        )
    )
    out = out.join(tpot.set_index("run_id")[["p50"]].rename(columns={"p50": "tpot_p50_s"}))
    companion = all_runs.dropna(subset=["companion_of"]).drop_duplicates("companion_of")
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
    out = select(out, replace(f, workloads=()), all_runs)
    if f.workloads:  # runs with no row of the selected workloads drop out
        out = out[out["run_id"].isin(set(steps.index) | set(rq["run_id"]))]
    return out.reset_index(drop=True)


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
    out = frame(store, sql)
    if len(out) == 0:
        return pd.DataFrame(columns=[*by, "metric", "n", *names])
    quant = pd.DataFrame(out.pop("q").tolist(), columns=names, index=out.index)
    return pd.concat([out, quant], axis=1)


def latency(store: Store, f: Filters = NO_FILTER) -> pd.DataFrame:
    """TTFT and TPOT (TTFT excluded, as SGLang's bench_serving) per run and workload:
    exact p05, p25, p50, p75, p95 from the stored requests (long format)."""
    cols = ["run_id", "workload", "n", *map(_qname, LATENCY_QUANTILES), "metric"]
    return exact_latency(store, f, ("run_id", "workload"))[cols]


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
        f"sum(verify_len) AS verified FROM req_steps WHERE run_id = {lit(run_id)}"
    ).to_pylist()[0]
    return {k: float(v) if v is not None else np.nan for k, v in row.items()}


def _measure(out: RunCeiling, sums: dict[str, float], source: str) -> None:
    """Fill the ceiling figures from a run that verified whole blocks (no interval: exact)."""
    out.source = source
    ceiling = sums["committed"] + sums["trim"]
    out.ceiling = out.ceiling_lo = out.ceiling_hi = ceiling / sums["n"]
    out.utilization = out.utilization_lo = out.utilization_hi = (
        sums["committed"] / ceiling if ceiling > 0 else np.nan
    )
    out.tokens_left = out.tokens_left_lo = out.tokens_left_hi = sums["trim"]


def _estimate(out: RunCeiling, store: Store, n_boot: int) -> None:
    """Fill the ceiling figures from the block-accept estimator, with its 95% interval."""
    est, _ = block_estimate(store, out.run_id)
    if est is None:
        return
    out.problems += list(est.problems)
    summ = est.summary((), n_boot=n_boot)
    if len(summ) == 0:
        return
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


def run_ceiling(store: Store, run_id: str, n_boot: int = 200) -> RunCeiling:
    """Committed vs ceiling for one run, the ceiling measured, or estimated with its interval."""
    all_runs = runs(store)
    me = all_runs[all_runs["run_id"] == run_id]
    mode = me["mode"].iloc[0] if len(me) else None
    own = _step_sums(store, run_id)
    out = RunCeiling(run_id, mode if isinstance(mode, str) else None, "unknown")
    if not own["n"]:
        out.problems.append("no req_steps rows yet")
        return out
    out.committed = own["committed"] / own["n"]
    out.mean_window = own["verified"] / own["n"]
    is_comp = (all_runs["companion_of"] == run_id) & (all_runs["mode"] == "cap-accept")
    measured_by = run_id if mode in MEASURED_CEILING_MODES else None
    if measured_by is None and is_comp.any():
        measured_by = sorted(all_runs.loc[is_comp, "run_id"])[0]
    if measured_by is not None:
        sums = own if measured_by == run_id else _step_sums(store, measured_by)
        if sums["n"]:
            source = "measured" if measured_by == run_id else f"measured by {measured_by}"
            _measure(out, sums, source)
    elif mode == "compact":
        _estimate(out, store, n_boot)
    cal = confidence_rows(store, run_id)
    if len(cal):
        table = calibration_table(position_labels(cal, runs=runs_of(store, [run_id])), by=())
        if len(table):
            out.ece, out.ece_n = float(table["ece"].iloc[0]), int(table["n"].iloc[0])
    return out
