"""SGLang's step records as dict rows and back, for round-trip tests of the schema.

``steps_from_sglang`` splits one ``dspark_info_record`` (GET /server_info) into step and
req-step rows; ``step_to_sglang`` / ``req_to_sglang`` render rows as SGLang's
``DecodeStepRecord`` / ``ReqDetail`` dicts. The collector's own decoder is
``dspark_obs.sglang.records`` (msgspec, columnar); these plain versions only let tests hold
the schema's field names and defaults to SGLang's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from dspark_obs.schema import (
    SGLANG_REQ_INT_FIELDS,
    SGLANG_STEP_FLOAT_FIELDS,
    SGLANG_STEP_INT_FIELDS,
    STEP_INT_UNSET,
)

__all__ = ["req_to_sglang", "step_to_sglang", "steps_from_sglang"]


def steps_from_sglang(
    dump: Mapping[str, Any], run_id: str, dp_rank: int = 0
) -> tuple[list[dict], list[dict]]:
    """Split one ``dspark_info_record`` (from GET /server_info) into step rows and req-step rows."""
    gamma = int(dump["gamma"])
    steps, req_steps = [], []
    for rec in dump.get("records", []):
        step = {k: v for k, v in rec.items() if k != "reqs"}
        step.update(run_id=run_id, dp_rank=dp_rank, source="sglang")
        step.setdefault("mode", dump.get("mode"))
        steps.append(step)
        for i, req in enumerate(rec.get("reqs") or []):
            row = dict(req)
            row.update(run_id=run_id, dp_rank=dp_rank, forward_ct=rec["forward_ct"], gamma=gamma)
            row.setdefault("rid", f"pool{req.get('req_pool_index', i)}")
            req_steps.append(row)
    return steps, req_steps


def step_to_sglang(
    step: Mapping[str, Any], reqs: Sequence[Mapping[str, Any]] | None = None
) -> dict:
    """Render a step row (and its req-step rows) as SGLang's DecodeStepRecord dict.

    Fields at their default (-1, null) are left out, as SGLang leaves them out.
    """
    out: dict[str, Any] = {"forward_ct": int(step["forward_ct"])}
    if step.get("mode") is not None:
        out["mode"] = step["mode"]
    for f in SGLANG_STEP_INT_FIELDS:
        v = step.get(f)
        if v is not None and v != STEP_INT_UNSET:
            out[f] = int(v)
    for f in SGLANG_STEP_FLOAT_FIELDS:
        v = step.get(f)
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            out[f] = float(v)
    if reqs is not None:
        out["reqs"] = [req_to_sglang(r) for r in reqs]
    return out


def req_to_sglang(row: Mapping[str, Any]) -> dict:
    """Render a req-step row as SGLang's ReqDetail dict (confidence rounded to 4 decimals)."""
    out: dict[str, Any] = {f: int(row[f]) for f in SGLANG_REQ_INT_FIELDS if row.get(f) is not None}
    out["draft_tokens"] = [int(t) for t in row.get("draft_tokens") or []]
    if row.get("rid") is not None:
        out["rid"] = row["rid"]
    for f in ("confidence", "survival"):
        if row.get(f) is not None:
            out[f] = [round(float(x), 4) for x in row[f]]
    return out
