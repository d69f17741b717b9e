"""The Cost model page: measured vs predicted step time, residuals by shape, and the cost
table a run planned with."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from dashboards.streamlit import rollups
from dashboards.streamlit.queries.shared import NO_FILTER, Filters, frame, lit, runs, select
from dspark_obs.cost_table import CostTable, CostTableError
from dspark_obs.store import Store

__all__ = ["MAX_SCATTER_POINTS", "cost_model", "cost_table_of"]

MAX_SCATTER_POINTS = 4000  # cost-model scatter: a deterministic sample of steps


def cost_model(store: Store, f: Filters = NO_FILTER) -> dict[str, pd.DataFrame]:
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
    st = select(rollups.partials(store, "steps"), f, runs(store), workload=False)
    st = st[st["n"] > 0]
    thin = max(1, -(-int(st["n"].sum()) // MAX_SCATTER_POINTS))  # keep ~1/thin of the steps
    by_shape = st.groupby(["run_id", "bs", "num_verify_tokens"], as_index=False).agg(
        steps=("n", "sum"), predicted=("predicted", "sum"), measured=("measured", "sum")
    )
    by_shape["predicted_ms"] = by_shape.pop("predicted") / by_shape["steps"]
    by_shape["measured_ms"] = by_shape.pop("measured") / by_shape["steps"]
    by_shape["residual_ms"] = by_shape["measured_ms"] - by_shape["predicted_ms"]
    points = frame(
        store,
        f"""SELECT run_id, forward_ct, bs, num_verify_tokens, predicted_step_ms AS predicted_ms,
                   {measured} AS measured_ms, {measured} - predicted_step_ms AS residual_ms
            {base} AND hash(run_id, dp_rank, forward_ct) % {thin} = 0
            ORDER BY hash(run_id, dp_rank, forward_ct) LIMIT {MAX_SCATTER_POINTS}""",
    )
    return {"by_shape": by_shape, "points": points}


def cost_table_of(store: Store, run_id: str) -> tuple[pd.DataFrame, str]:
    """The cost table a run planned with (from its config), as rows, and a one-line note."""
    cfg = store.query(f"SELECT config FROM runs WHERE run_id = {lit(run_id)}").column(0)
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
