"""One saved SGLang step dump (a /server_info body, or one ``dspark_info_record``) into the
store, with its ``runs`` row.

Why the runs row matters: analytics read a run's mode from it. Without one, a cap-accept dump
was taken for compact, and calibration then treated every position past the window as
unobserved, dropping the positions cap-accept did verify. The collector uses the same row.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from dspark_obs.fanout import FanOut
from dspark_obs.schema import MODES
from dspark_obs.sglang.records import (
    DumpError,
    RankDump,
    ServerInfo,
    decode_server_info,
    records_to_tables,
)

__all__ = ["IngestResult", "as_server_info", "ingest_dump", "record_lag_steps", "run_row"]


def run_row(
    info: ServerInfo,
    run_id: str,
    *,
    companion_of: str | None = None,
    workload: str | None = None,
    temperature: float | None = None,
    config: Mapping[str, Any] | None = None,
    lag_steps: int | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """The ``runs`` row of a server: its mode, gamma, model and drafter, source sglang.

    ``started_at`` is when it was first seen (``now``): SGLang's ``startup_time`` is a dict
    of durations, not a date, and is kept as sent in ``config``. ``lag_steps`` defaults to
    the relay lag the step records carry.
    """
    dump = next((d for d in info.dumps if d is not None), None)
    if dump is None:
        raise DumpError("no dspark_info_record in this /server_info")
    if dump.mode not in MODES:
        raise DumpError(f"dspark_info_record.mode={dump.mode!r}; expected one of {list(MODES)}")
    if not isinstance(dump.gamma, int) or dump.gamma < 1:
        raise DumpError(
            f"dspark_info_record.gamma={dump.gamma!r}; expected an int >= 1 "
            "(the server has not reported its block size yet)"
        )
    cfg = {
        "version": info.version,
        "components": dump.components,
        "verify_num_draft_tokens": dump.verify_num_draft_tokens,
        "startup_time": info.startup_time,
        **(config or {}),
    }
    if lag_steps is None:
        lag_steps = record_lag_steps(dump)
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
        "lag_steps": lag_steps,
        "dp_size": len(info.dumps),
        "started_at": now or datetime.now(tz=UTC),
        "config": json.dumps(cfg, sort_keys=True, default=str),
    }


class _Lag(msgspec.Struct):
    lag_steps: int | None = None


def record_lag_steps(dump: RankDump) -> int | None:
    """The relay lag the newest step record carries (SGLang puts it on every core record)."""
    for raw in reversed(dump.records[-8:]):
        try:
            lag = msgspec.json.decode(raw, type=_Lag).lag_steps
        except msgspec.DecodeError:
            continue
        if lag is not None and 0 <= lag < 2**31:
            return lag
    return None


class IngestResult(msgspec.Struct):
    run: dict[str, Any]
    steps: int = 0
    req_steps: int = 0
    already_stored: int = 0  # step rows of this dump the store already held
    rejected: int = 0
    errors: list[str] = []


def as_server_info(body: bytes | Mapping[str, Any]) -> ServerInfo:
    """A /server_info body, or one bare ``dspark_info_record`` (bytes or parsed)."""
    if not isinstance(body, bytes | bytearray | memoryview):
        if "records" in body and "internal_states" not in body:
            body = {"internal_states": [{"dspark_info_record": body}]}
        return decode_server_info(msgspec.json.encode(body))
    info = decode_server_info(body)  # one scan; a bare record has no internal_states
    if not info.internal_states:
        wrapped = b'{"internal_states":[{"dspark_info_record":' + bytes(body) + b"}]}"
        bare = decode_server_info(wrapped)
        if bare.dumps and bare.dumps[0] is not None and bare.dumps[0].mode:
            return bare
    return info


def ingest_dump(
    body: bytes | Mapping[str, Any],
    run_id: str,
    fan: FanOut,
    *,
    companion_of: str | None = None,
    workloads: Mapping[str, str] | None = None,
    model: str | None = None,
    drafter: str | None = None,
    stored: Callable[[str], set[tuple[int, int]]] | None = None,
) -> IngestResult:
    """Store a /server_info body (bytes or parsed) or one bare ``dspark_info_record``.

    ``stored(run_id)`` gives the ``(dp_rank, forward_ct)`` keys already stored: those steps
    (and their request-steps) are not handed to the sinks again, so every count is of rows
    newly stored. A record of the wrong types is left out and named in ``errors``.
    """
    info = as_server_info(body)
    if model or drafter:
        info.model_path = model or info.model_path
        info.speculative_draft_model_path = drafter or info.speculative_draft_model_path
    row = run_row(info, run_id, companion_of=companion_of)
    known = stored(run_id) if stored is not None else set()
    if not known:
        fan.emit("runs", [row])
    out = IngestResult(run=row)
    before = len(fan.errors)
    for dp_rank, dump in enumerate(info.dumps):
        if not isinstance(dump, RankDump):
            continue
        for tables in records_to_tables(
            dump.records,
            run_id=run_id,
            dp_rank=dp_rank,
            gamma=int(dump.gamma),
            mode=dump.mode or None,
            workloads=workloads,
        ):
            out.errors += [f"internal_states[{dp_rank}].{e}" for e in tables.errors]
            steps, reqs = tables.steps, tables.req_steps
            if known:
                seen = pa.array([f for d, f in known if d == dp_rank], pa.int64())
                keep_s = pc.invert(pc.is_in(steps["forward_ct"], value_set=seen))
                keep_r = pc.invert(pc.is_in(reqs["forward_ct"], value_set=seen))
                out.already_stored += steps.num_rows - (pc.sum(keep_s).as_py() or 0)
                steps, reqs = steps.filter(keep_s), reqs.filter(keep_r)
            out.steps += fan.emit("steps", steps).num_rows
            out.req_steps += fan.emit("req_steps", reqs).num_rows
    out.rejected = len(fan.errors) - before
    return out
