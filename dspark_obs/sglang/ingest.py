"""One saved SGLang step dump (a /server_info body, or one ``dspark_info_record``) into the
store, with its ``runs`` row.

Why the runs row matters: analytics read a run's mode from it. Without one, a cap-accept dump
was taken for compact, and calibration then treated every position past the window as
unobserved, dropping the positions cap-accept did verify. The collector uses the same row.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import msgspec

from dspark_obs.fanout import FanOut
from dspark_obs.schema import MODES
from dspark_obs.sglang.records import (
    DumpError,
    RankDump,
    ServerInfo,
    decode_server_info,
    records_to_tables,
)

__all__ = ["IngestResult", "ingest_dump", "run_row"]


def run_row(
    info: ServerInfo,
    run_id: str,
    *,
    companion_of: str | None = None,
    workload: str | None = None,
    temperature: float | None = None,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``runs`` row of a server: its mode, gamma, model and drafter, source sglang."""
    dump = next((d for d in info.dumps if d is not None), None)
    if dump is None:
        raise DumpError("no dspark_info_record in this /server_info")
    if dump.mode not in MODES:
        raise DumpError(f"dspark_info_record.mode={dump.mode!r}; expected one of {list(MODES)}")
    cfg = {"version": info.version, "components": dump.components,
           "verify_num_draft_tokens": dump.verify_num_draft_tokens,
           "startup_time": info.startup_time, **(config or {})}
    return {
        "run_id": run_id,
        "source": "sglang",
        "mode": dump.mode,
        "gamma": int(dump.gamma),
        "model": info.model_path or info.served_model_name,
        "drafter": info.speculative_draft_model_path,
        "workload": workload,
        "temperature": temperature,
        "companion_of": companion_of,
        "dp_size": len(info.dumps),
        "started_at": datetime.fromtimestamp(info.startup_time or time.time(), tz=UTC),
        "config": json.dumps(cfg, sort_keys=True, default=str),
    }


class IngestResult(msgspec.Struct):
    run: dict[str, Any]
    steps: int = 0
    req_steps: int = 0
    rejected: int = 0


def ingest_dump(
    body: bytes | Mapping[str, Any],
    run_id: str,
    fan: FanOut,
    *,
    companion_of: str | None = None,
    workloads: Mapping[str, str] | None = None,
    model: str | None = None,
    drafter: str | None = None,
) -> IngestResult:
    """Store a /server_info body (bytes or parsed) or one bare ``dspark_info_record``."""
    if not isinstance(body, bytes | bytearray | memoryview):
        if "records" in body and "internal_states" not in body:  # a bare dspark_info_record
            body = {"internal_states": [{"dspark_info_record": body}]}
        body = msgspec.json.encode(body)
    info = decode_server_info(body)
    if model or drafter:
        info.model_path = model or info.model_path
        info.speculative_draft_model_path = drafter or info.speculative_draft_model_path
    row = run_row(info, run_id, companion_of=companion_of)
    fan.emit("runs", [row])
    out = IngestResult(run=row)
    before = len(fan.errors)
    for dp_rank, dump in enumerate(info.dumps):
        if not isinstance(dump, RankDump):
            continue
        for tables in records_to_tables(dump.records, run_id=run_id, dp_rank=dp_rank,
                                        gamma=int(dump.gamma), mode=dump.mode or None,
                                        workloads=workloads):
            out.steps += fan.emit("steps", tables.steps).num_rows
            out.req_steps += fan.emit("req_steps", tables.req_steps).num_rows
    out.rejected = len(fan.errors) - before
    return out
