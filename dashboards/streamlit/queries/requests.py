"""The Requests page: one request step by step (window, committed, confidence, survival) and
its stored row (prompt, output token ids, timings)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from dashboards.streamlit.queries.shared import NO_FILTER, Filters, frame, lit
from dspark_obs.store import Store

__all__ = ["request_detail", "request_list", "request_steps"]

_REQUEST_TIMES = """
    first_token_time - arrival_time AS ttft_s,
    (finish_time - first_token_time) / greatest(completion_tokens - 1, 1) AS tpot_s,
    finish_time - arrival_time AS e2e_s
"""


def request_list(store: Store, f: Filters = NO_FILTER, limit: int = 500) -> pd.DataFrame:
    """Requests to pick from (newest runs first): run, rid, workload, tokens, finish reason."""
    return frame(
        store,
        f"""SELECT run_id, rid, coalesce(workload, 'unknown') AS workload, completion_tokens,
                   finish_reason, {_REQUEST_TIMES}
            FROM requests WHERE {f.where()} ORDER BY run_id, rid LIMIT {int(limit)}""",
    )


def request_steps(store: Store, run_id: str, rid: str) -> pd.DataFrame:
    """One request's steps: window, committed, cap_trim, confidence and survival per draft."""
    return frame(
        store,
        f"""SELECT forward_ct, prefix_len, verify_len, acc_len, correct_drafts, cap_trim, gamma,
                   confidence, survival, draft_tokens, bonus_token, is_last
            FROM req_steps WHERE run_id = {lit(run_id)} AND rid = {lit(rid)}
            ORDER BY dp_rank, forward_ct""",
    )


def request_detail(store: Store, run_id: str, rid: str) -> dict[str, Any] | None:
    """The request's row (prompt text, output token ids, timings) or None."""
    rows = store.query(
        f"""SELECT *, {_REQUEST_TIMES} FROM requests
            WHERE run_id = {lit(run_id)} AND rid = {lit(rid)} LIMIT 1"""
    ).to_pylist()
    return rows[0] if rows else None
