"""SGLang 0.5.23's per-step dump (GET /server_info -> dspark_info_record) as typed records.

The two record types follow SGLang's field rules: the same names and types, fields at their
default are left out of the JSON (``omit_defaults``), ``forward_ct`` and the ReqDetail ints
and ``draft_tokens`` are required. ``tests/test_sglang_formats.py`` checks these definitions
against the class definitions in the sglang wheel (read with ``ast``, never imported).

One encoder and one decoder: :func:`step_record` renders step and req-step rows as a
DecodeStepRecord (the engine server's ring, tests), :func:`records_to_tables` reads records
back into rows (collector, ``ingest-dump``); :func:`decode_server_info` reads the body around
them.

Reading is the hot path (a full ring buffer is 200,000 steps; at batch 64 with ``reqs`` that
is 12.8 million request rows, about 4 GB of JSON): :func:`decode_server_info` scans the body
once with msgspec and keeps each step record as an undecoded slice (``msgspec.Raw``);
:func:`records_to_tables` turns slices, a chunk at a time, into Arrow tables of the store's
``steps`` and ``req_steps`` schemas with Arrow's JSON reader (chunks in parallel), so no
Python object is ever built per row. Typing stays SGLang's: a record Arrow cannot read, or
one missing what SGLang requires, sends its chunk down a slow path where SGLang's types name
each bad record and the others are kept.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from dspark_obs.schema import (
    REQ_STEPS,
    SGLANG_REQ_INT_FIELDS,
    SGLANG_STEP_FLOAT_FIELDS,
    SGLANG_STEP_INT_FIELDS,
    STEPS,
)

__all__ = [
    "DecodeStepRecord",
    "DumpError",
    "InfoDump",
    "RankDump",
    "ReqDetail",
    "ServerInfo",
    "decode_server_info",
    "records_to_tables",
    "step_record",
]

MAX_RECORDS = 200_000
"""SGLang's ring buffer size (INFO_DUMP_MAX_RECORDS)."""

COMPONENTS = (
    "core",
    "draft_gpu_time",
    "reqs",
    "step_cpu_time",
    "step_gpu_time",
    "target_verify_gpu_time",
)
"""SGLANG_DSPARK_DEBUG_DUMP tokens ("all" enables every one)."""


class DumpError(ValueError):
    """A /server_info body that cannot be read (truncated, not JSON, wrong shape)."""


class ReqDetail(msgspec.Struct, omit_defaults=True, gc=False):
    """One request in one decode step (SGLang's ReqDetail)."""

    req_pool_index: int
    prefix_len: int
    verify_len: int
    acc_len: int
    correct_drafts: int
    cap_trim: int
    bonus_token: int
    draft_tokens: list[int]
    rid: str | None = None
    confidence: list[float] | None = None
    survival: list[float] | None = None


class DecodeStepRecord(msgspec.Struct, omit_defaults=True, gc=False):
    """One decode step of one DP rank (SGLang's DecodeStepRecord)."""

    forward_ct: int
    bs: int = -1
    mode: str = ""
    budget: int | None = None
    lag_steps: int | None = None
    num_running_reqs: int = -1
    num_verify_tokens: int = -1
    verify_tokens_local: int = -1
    verify_tokens_dp_synced: int = -1
    verify_tokens_graph_key: int = -1
    predicted_step_ms: float | None = None
    predicted_theta: float | None = None
    step_cpu_ms: float | None = None
    step_gpu_ms: float | None = None
    draft_gpu_ms: float | None = None
    target_verify_gpu_ms: float | None = None
    reqs: list[ReqDetail] | None = None


class InfoDump(msgspec.Struct):
    """The ``dspark_info_record`` a server writes (records as typed structs)."""

    mode: str
    gamma: int
    verify_num_draft_tokens: int
    components: list[str]
    records: list[DecodeStepRecord]


class RankDump(msgspec.Struct, gc=False):
    """The ``dspark_info_record`` a collector reads: step records left undecoded."""

    mode: str = ""
    gamma: int = 0
    verify_num_draft_tokens: int = 0
    components: list[str] = []
    records: list[msgspec.Raw] = []


class InternalState(msgspec.Struct, gc=False):
    """One DP rank's reply: its dump and its scheduler's ``startup_time`` durations (set once
    per scheduler process, so it tells the ranks of one server apart and a restart from a
    re-read)."""

    dspark_info_record: RankDump | None = None
    startup_time: Any = None


class ServerInfo(msgspec.Struct, gc=False):
    """The parts of GET /server_info the collector needs; everything else is skipped.

    SGLang 0.5.23 sends ``startup_time`` as a dict of start-up durations (``{"load_weight",
    "kv_cache_allocation", "scheduler_e2e", "cuda_graph": {...}, "tokenizer_e2e"}``, built by
    ``build_engine_startup_time``), not a timestamp; older servers and tools sent a float.
    Either is kept as sent: it identifies one server process, it never dates anything.
    """

    internal_states: list[InternalState] = []
    startup_time: Any = None
    version: str | None = None
    model_path: str | None = None
    served_model_name: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_algorithm: str | None = None

    @property
    def dumps(self) -> list[RankDump | None]:
        """One entry per reply (None where the rank has no dump enabled), in reply order."""
        return [s.dspark_info_record for s in self.internal_states]

    @property
    def identity(self) -> str:
        """This server process: its startup durations and version, as canonical JSON."""
        return fingerprint({"startup_time": self.startup_time, "version": self.version})


def fingerprint(value: Any) -> str:
    """Canonical JSON of a decoded value (sorted keys), for equality across polls."""
    return msgspec.json.encode(value, order="sorted").decode()


def _round4(values: Sequence[float] | None) -> list[float] | None:
    return None if values is None else [round(float(v), 4) for v in values]


def _opt_float(v: Any, digits: int | None = None) -> float | None:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return round(float(v), digits) if digits is not None else float(v)


def step_record(
    step: Mapping[str, Any], reqs: Sequence[Mapping[str, Any]], components: frozenset[str]
) -> DecodeStepRecord:
    """A step row and its req-step rows (the store's names) as SGLang's DecodeStepRecord, with
    the enabled dump ``components`` only: the one encoder of the step dump (the engine server's
    ring; tests render rows with it). Confidence and survival are rounded to 4 decimals, as
    SGLang rounds them; :func:`records_to_tables` is the decoder."""
    rec = DecodeStepRecord(forward_ct=int(step["forward_ct"]))
    if "core" in components:
        rec.bs = int(step["bs"])
        rec.mode = str(step["mode"])
        rec.budget = int(step["budget"])
        rec.lag_steps = int(step["lag_steps"])
        rec.num_running_reqs = int(step["num_running_reqs"])
        rec.num_verify_tokens = int(step["num_verify_tokens"])
        rec.verify_tokens_local = int(step["verify_tokens_local"])
        rec.predicted_step_ms = _opt_float(step.get("predicted_step_ms"))
        rec.predicted_theta = _opt_float(step.get("predicted_theta"))
    if "step_cpu_time" in components and step.get("step_cpu_ms") is not None:
        rec.step_cpu_ms = round(float(step["step_cpu_ms"]), 4)
    if "draft_gpu_time" in components:
        rec.draft_gpu_ms = _opt_float(step.get("draft_gpu_ms"), 4)
    if "target_verify_gpu_time" in components:
        rec.target_verify_gpu_ms = _opt_float(step.get("target_verify_gpu_ms"), 4)
    if "reqs" in components:
        rec.reqs = [
            ReqDetail(
                **{f: int(r[f]) for f in SGLANG_REQ_INT_FIELDS},
                draft_tokens=[int(t) for t in r["draft_tokens"]],
                rid=r["rid"],
                confidence=_round4(r.get("confidence")),
                survival=_round4(r.get("survival")),
            )
            for r in reqs
        ]
    return rec


_DECODER = msgspec.json.Decoder(ServerInfo)


def decode_server_info(body: bytes | memoryview) -> ServerInfo:
    """Parse a /server_info body; a truncated or malformed body raises DumpError."""
    try:
        return _DECODER.decode(body)
    except msgspec.DecodeError as exc:
        raise DumpError(f"/server_info body is not a valid server_info JSON: {exc}") from None


# Types the Arrow JSON reader parses into; absent fields come back null.
_REQ_TYPE = pa.struct(
    [
        *[(f, pa.int64()) for f in SGLANG_REQ_INT_FIELDS],
        ("draft_tokens", pa.list_(pa.int32())),
        ("rid", pa.string()),
        ("confidence", pa.list_(pa.float32())),
        ("survival", pa.list_(pa.float32())),
    ]
)
_RECORD_SCHEMA = pa.schema(
    [
        ("forward_ct", pa.int64()),
        ("mode", pa.string()),
        *[(f, pa.int64()) for f in SGLANG_STEP_INT_FIELDS],
        *[(f, pa.float64()) for f in SGLANG_STEP_FLOAT_FIELDS],
        ("reqs", pa.list_(_REQ_TYPE)),
    ]
)
_PARSE = pa_json.ParseOptions(explicit_schema=_RECORD_SCHEMA, unexpected_field_behavior="ignore")
_PARSE_NL = pa_json.ParseOptions(
    explicit_schema=_RECORD_SCHEMA, unexpected_field_behavior="ignore", newlines_in_values=True
)
_READ = pa_json.ReadOptions(block_size=1 << 24, use_threads=False)


@dataclass
class Tables:
    """Step rows and request-step rows of one chunk, in the store's schemas, and the records
    of the chunk that were left out (``"records[i]: why"``)."""

    steps: pa.Table
    req_steps: pa.Table
    errors: list[str] = field(default_factory=list)


def records_to_tables(
    records: Sequence[msgspec.Raw | bytes],
    *,
    run_id: str,
    dp_rank: int,
    gamma: int,
    mode: str | None,
    fct_offset: int = 0,
    workloads: Mapping[str, str] | None = None,
    chunk: int = 4096,
    workers: int | None = None,
) -> Iterator[Tables]:
    """Raw DecodeStepRecord JSON slices -> ``steps`` / ``req_steps`` tables, chunk by chunk.

    ``fct_offset`` is added to every forward_ct (a restarted server counts from 0 again);
    ``mode`` fills records that leave it out; ``workloads`` labels request rows by rid. A
    record that is not a JSON object of SGLang's types is left out and named in
    ``Tables.errors``; the other records of its chunk are kept.

    Chunks are parsed ``workers`` at a time (default: one per core), each by a single-threaded
    Arrow reader, while the caller stores the chunk before: Arrow's own threads split only a
    chunk's blocks and leave the cores idle while a chunk is stored (a full ring is ~40 s of
    parse and store CPU, so this overlap is most of what two cores can win). Tables come out
    in record order; at most ``workers + 1`` chunks are in memory.
    """
    starts = range(0, len(records), chunk)
    labels = _Labels(run_id, dp_rank, gamma, mode, fct_offset, workloads)

    def parse(start: int) -> Tables:
        part = list(records[start : start + chunk])
        return _chunk_tables(part, start, labels)

    n_workers = max(1, min(workers or os.cpu_count() or 1, len(starts)))
    if n_workers == 1:
        yield from map(parse, starts)
        return
    with ThreadPoolExecutor(n_workers, thread_name_prefix="dump-parse") as pool:
        pending: deque[Future[Tables]] = deque()
        for start in starts:  # at most n_workers + 1 chunks in flight: memory stays bounded
            pending.append(pool.submit(parse, start))
            if len(pending) > n_workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


@dataclass(frozen=True)
class _Labels:
    """What every row of one rank's records is labelled with (see records_to_tables)."""

    run_id: str
    dp_rank: int
    gamma: int
    mode: str | None
    fct_offset: int
    workloads: Mapping[str, str] | None


def _chunk_tables(part: list[msgspec.Raw | bytes], start: int, labels: _Labels) -> Tables:
    """One chunk's tables; a bad record is found (the slow path), named and left out."""
    errors: list[str] = []
    raw = _read_chunk(part)
    if raw is None:
        raw = _read_good_records(part, start, errors)
    return Tables(*_tables(raw, labels), errors)


def _read_good_records(
    part: Sequence[msgspec.Raw | bytes], start: int, errors: list[str]
) -> pa.Table:
    """The slow path of a chunk with a bad record: SGLang's own types name what is wrong with
    each record; a record they accept that Arrow still cannot hold (an int past int64) is read
    alone and named too. Every good record of the chunk is kept."""
    good: list[int] = []
    for i, r in enumerate(part):
        try:
            msgspec.json.decode(r, type=DecodeStepRecord)
        except msgspec.DecodeError as err:
            errors.append(f"records[{start + i}]: {err}")
        else:
            good.append(i)
    whole = _read_chunk([part[i] for i in good]) if good else _empty_records()
    if whole is not None:
        return whole
    tables = []
    for i in good:
        one = _read_chunk([part[i]])
        if one is None:
            errors.append(
                f"records[{start + i}]: a value outside the store's types (an int past int64?)"
            )
        else:
            tables.append(one)
    return pa.concat_tables(tables) if tables else _empty_records()


def _empty_records() -> pa.Table:
    return _RECORD_SCHEMA.empty_table()


# ReqDetail fields SGLang requires (no default): Arrow reads a missing one, or a JSON null, as
# null, so a null here sends the chunk down the slow path where SGLang's types name it.
_REQUIRED_REQ_FIELDS = (*SGLANG_REQ_INT_FIELDS, "draft_tokens")
_LIST_REQ_FIELDS = ("draft_tokens", "confidence", "survival")


def _read_chunk(part: Sequence[msgspec.Raw | bytes]) -> pa.Table | None:
    """Arrow's JSON reader over one chunk of records; None if any record does not parse, or
    leaves out (or nulls) what SGLang's types require.

    Arrow refuses a string, bool or fraction where the schema says int and a string where it
    says float; it does not enforce required fields or non-null list items, checked here on
    the columns. One tolerance remains: an explicit ``null`` for a step field that SGLang gives a
    non-null default (``bs``, ``mode``, ``num_running_reqs``...) reads as absent (-1 / the
    dump's mode), as SGLang itself never writes null there (it leaves defaults out)."""
    text = b"\n".join(part)
    for opts in (_PARSE, _PARSE_NL):  # compact JSON has no raw newline in a record; pretty may
        try:
            raw = pa_json.read_json(pa.BufferReader(text), read_options=_READ, parse_options=opts)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            continue
        if raw.num_rows == len(part) and not raw.column("forward_ct").null_count:
            return raw if _required_present(raw) else None
    return None


def _required_present(raw: pa.Table) -> bool:
    reqs = raw.column("reqs")
    if not reqs.null_count and not any(len(c) for c in reqs.chunks):
        return True
    flat = pc.list_flatten(reqs)
    if flat.null_count:
        return False
    for chunk in flat.chunks:
        if any(chunk.field(f).null_count for f in _REQUIRED_REQ_FIELDS):
            return False
        if any(pc.list_flatten(chunk.field(f)).null_count for f in _LIST_REQ_FIELDS):
            return False
    return True


def _tables(raw: pa.Table, labels: _Labels) -> tuple[pa.Table, pa.Table]:
    """The parsed records as the store's two tables, column by column (no copy of the reqs
    column: it is most of the data, so it is flattened chunk by chunk as Arrow read it)."""
    run_id, dp_rank, gamma, mode, fct_offset, workloads = (
        labels.run_id,
        labels.dp_rank,
        labels.gamma,
        labels.mode,
        labels.fct_offset,
        labels.workloads,
    )
    n = raw.num_rows
    fct = pc.add(raw.column("forward_ct"), fct_offset) if fct_offset else raw.column("forward_ct")
    rec_mode = pc.if_else(pc.equal(raw.column("mode"), ""), None, raw.column("mode"))
    if mode is not None:
        rec_mode = pc.fill_null(rec_mode, mode)
    cols: dict[str, pa.ChunkedArray | pa.Array] = {
        "run_id": _repeat(run_id, n),
        "dp_rank": pa.array(np.full(n, dp_rank, dtype=np.int32)),
        "forward_ct": fct,
        "source": _repeat("sglang", n),
        "mode": rec_mode,
    }
    for f in SGLANG_STEP_INT_FIELDS:
        cols[f] = pc.fill_null(raw.column(f), -1)
    for f in SGLANG_STEP_FLOAT_FIELDS:
        cols[f] = raw.column(f)
    steps = _table(STEPS, cols, n)

    reqs = raw.column("reqs")
    lengths = pc.fill_null(pc.list_value_length(reqs), 0).to_numpy()
    flat = pc.list_flatten(reqs)
    m = len(flat)
    rcols: dict[str, pa.Array | pa.ChunkedArray] = {}
    if m:
        rid = pc.struct_field(flat, "rid")
        if rid.null_count:  # SGLang leaves rid out when it has none: key by pool slot
            pool = pc.cast(pc.struct_field(flat, "req_pool_index"), pa.string())
            rid = pc.fill_null(rid, pc.binary_join_element_wise("pool", pool, ""))
        rcols = {
            "run_id": _repeat(run_id, m),
            "dp_rank": pa.array(np.full(m, dp_rank, dtype=np.int32)),
            "forward_ct": pa.array(np.repeat(fct.to_numpy(), lengths)),
            "rid": rid,
            "gamma": pa.array(np.full(m, gamma, dtype=np.int32)),
        }
        for f in (*SGLANG_REQ_INT_FIELDS, *_LIST_REQ_FIELDS):
            rcols[f] = pc.struct_field(flat, f)
        if workloads:
            keys = pa.array(list(workloads), pa.string())
            values = pa.array(list(workloads.values()), pa.string())
            rcols["workload"] = pc.take(values, pc.index_in(rid, value_set=keys))
    return steps, _table(REQ_STEPS, rcols, m)


def _table(schema: pa.Schema, cols: Mapping[str, pa.Array | pa.ChunkedArray], n: int) -> pa.Table:
    """A table of ``schema``: the columns given, nulls for the others."""
    return pa.table(
        {f.name: cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in schema}, schema
    )


def _repeat(value: str, n: int) -> pa.Array:
    """One string n times, built in Arrow (no Python list of n references)."""
    return pa.repeat(pa.scalar(value, pa.string()), n)
