"""The Ceiling page: committed vs ceiling measured by cap-accept runs, and the block-accept
estimator on a compact run alone, judged against its companion."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd

from dashboards.streamlit import rollups
from dashboards.streamlit.queries import shared
from dspark_obs.analytics import BlockEstimate, estimate_blocks, validate_estimator
from dspark_obs.analytics.estimator_cells import sampling_kind, validation_cell
from dspark_obs.store import Store

__all__ = ["CeilingEstimate", "block_estimate", "ceiling_by_workload", "ceiling_estimate"]

# the req_steps columns the estimator reads
_EST_COLUMNS = (
    "run_id, dp_rank, forward_ct, rid, gamma, prefix_len, verify_len, acc_len, correct_drafts, "
    "cap_trim, bonus_token, draft_tokens, confidence, survival, workload, temperature, top_p, "
    "top_k, is_last, trimmed_tokens, q_lp, pg"
)


def ceiling_by_workload(store: Store, f: shared.Filters = shared.NO_FILTER) -> pd.DataFrame:
    """Committed vs ceiling per workload, measured by cap-accept runs (the ceiling's truth).

    A cap-accept run commits what its compact run commits, and its cap_trim says what a
    full-block verify would have added: ceiling = acc_len + cap_trim. Rows are labelled with
    the compact run they shadow (``run_id``) and the cap-accept run that measured it; a
    filter on either run selects the pair.
    """
    all_runs = shared.runs(store)
    caps = all_runs[all_runs["mode"] == "cap-accept"]
    shadow = dict(zip(caps["run_id"], caps["companion_of"].fillna(caps["run_id"]), strict=True))
    rs = rollups.partials(store, "req_steps")
    by_workload = shared.Filters(workloads=f.workloads)
    rs = shared.select(rs[rs["run_id"].isin(shadow)], by_workload, all_runs)
    if f.runs or f.modes:
        pick = set(shared.select(all_runs, replace(f, workloads=()), all_runs)["run_id"])
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


def estimator_rows(store: Store, run_id: str) -> pd.DataFrame:
    """A run's req-steps with every column the block-accept estimator reads."""
    where = f"run_id = {shared.lit(run_id)}"
    return shared.frame(store, f"SELECT {_EST_COLUMNS} FROM req_steps WHERE {where}")


def block_estimate(
    store: Store, run_id: str, runs_frame: pd.DataFrame | None = None
) -> tuple[BlockEstimate | None, pd.DataFrame]:
    """The block-accept estimator over one run's rows (its finished requests too), or None
    when the run has no req-step row yet. Returns (estimate, rows)."""
    rows = estimator_rows(store, run_id)
    if len(rows) == 0:
        return None, rows
    reqs = shared.frame(store, f"FROM requests WHERE run_id = {shared.lit(run_id)}")
    runs_frame = shared.runs_of(store, [run_id]) if runs_frame is None else runs_frame
    return estimate_blocks(rows, reqs if len(reqs) else None, runs=runs_frame), rows


@dataclass
class CeilingEstimate:
    """The block-accept estimator on a compact run alone, beside its companion's truth."""

    run_id: str
    summary: pd.DataFrame  # per workload: mean_lo, mean_mid, mean_hi, mean_point, CIs ...
    validation: pd.DataFrame  # per workload vs the companion (empty without one)
    problems: list[str] = field(default_factory=list)
    tail: dict[str, Any] = field(default_factory=dict)  # tail model used + its validation cell


def ceiling_estimate(store: Store, run_id: str, n_boot: int = 200) -> CeilingEstimate:
    """Estimator [lo, point, hi] per workload for a compact run, validated on its companion."""
    comp = (
        store.query(f"SELECT run_id FROM runs WHERE companion_of = {shared.lit(run_id)} LIMIT 1")
        .column(0)
        .to_pylist()
    )
    est, rows = block_estimate(store, run_id, shared.runs_of(store, [run_id, *comp]))
    if est is None:
        return CeilingEstimate(run_id, pd.DataFrame(), pd.DataFrame(), ["no req_steps rows"])
    summary = est.summary(("workload",), n_boot=n_boot)
    validation = pd.DataFrame()
    if comp:
        cap = estimator_rows(store, comp[0])
        if len(cap):
            validation = validate_estimator(summary, cap, by=("workload",), n_boot=n_boot)
    tail = est.tail_model.describe() if est.tail_model is not None else {}
    tail["validation_cell"] = validation_cell(
        float(est.blocks["censored"].mean()), sampling_kind(rows)
    )
    return CeilingEstimate(run_id, summary, validation, list(est.problems), tail)
