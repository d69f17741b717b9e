"""The Windows page: the verify-window histogram per workload, its spread over a run's steps,
and the planner's budget per step."""

from __future__ import annotations

import pandas as pd

from dashboards.streamlit import rollups
from dashboards.streamlit.queries.shared import NO_FILTER, Filters, frame, runs, select
from dspark_obs.store import Store

__all__ = ["MAX_STEP_BUCKETS", "budget_per_step", "window_histogram", "window_per_step"]

MAX_STEP_BUCKETS = 120  # per-step charts: at most this many columns, whatever the run length


def window_histogram(store: Store, f: Filters = NO_FILTER) -> pd.DataFrame:
    """Verify-window histogram per run and workload: req-steps at each verify_len, and share."""
    rs = select(rollups.partials(store, "req_steps"), f, runs(store))
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


def window_per_step(store: Store, f: Filters = NO_FILTER) -> pd.DataFrame:
    """How windows are spread over a run's steps (the SGLang study's Figure 4 view).

    Steps are grouped into at most MAX_STEP_BUCKETS buckets of ``step_width`` decode steps;
    per bucket and verify_len: how many req-steps chose that window.
    """
    width = _step_width(store, f, "req_steps", "workload")
    return frame(
        store,
        f"""SELECT run_id, (forward_ct // {width}) * {width} AS step, verify_len,
                   count(*) AS req_steps, {width} AS step_width
            FROM req_steps WHERE {f.where()} GROUP BY ALL ORDER BY ALL""",
    )


def budget_per_step(store: Store, f: Filters = NO_FILTER) -> pd.DataFrame:
    """Per step bucket: the planner's budget (extra verify tokens), verify tokens, batch size.

    Budgets belong to batch steps (SGLang's -1 = unset excluded), so no workload filter.
    """
    width = _step_width(store, f, "steps", None)
    return frame(
        store,
        f"""SELECT run_id, (forward_ct // {width}) * {width} AS step,
                   avg(budget) FILTER (WHERE budget >= 0) AS budget,
                   avg(num_verify_tokens) FILTER (WHERE num_verify_tokens >= 0) AS verify_tokens,
                   avg(bs) FILTER (WHERE bs >= 0) AS batch_size, {width} AS step_width
            FROM steps WHERE {f.where(workload_col=None)} GROUP BY ALL ORDER BY ALL""",
    )
