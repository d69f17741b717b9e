"""The record types every producer emits and every consumer reads.

Four tables, each an Arrow schema:

* ``runs``      one row per run (mode, gamma, model, drafter, sampling, companion link).
* ``steps``     one row per decode step per DP rank: a superset of SGLang 0.5.23's
                ``DecodeStepRecord`` (same field names, same meaning, -1 / null when unset).
* ``req_steps`` one row per request per step: a superset of SGLang's ``ReqDetail`` plus the
                block-accept estimator fields SGLang writes to its JSONL (``trimmed_tokens``,
                ``q_lp``, ``pg``).
* ``requests``  one row per finished request (prompt, output, finish reason, timings).

Validation is vectorized (Arrow compute over whole batches); only failing rows are turned
into messages. A batch with bad rows keeps its good rows: :func:`validate` returns both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SOURCES = ("engine", "sglang")
MODES = ("static", "compact", "cap-accept")

# --- SGLang 0.5.23 DecodeStepRecord: every field, same names. -1 means "unset" for ints.
SGLANG_STEP_INT_FIELDS = (
    "bs",
    "budget",
    "lag_steps",
    "num_running_reqs",
    "num_verify_tokens",
    "verify_tokens_local",
    "verify_tokens_dp_synced",
    "verify_tokens_graph_key",
)
SGLANG_STEP_FLOAT_FIELDS = (
    "predicted_step_ms",
    "predicted_theta",
    "step_cpu_ms",
    "step_gpu_ms",
    "draft_gpu_ms",
    "target_verify_gpu_ms",
)
# --- SGLang 0.5.23 ReqDetail.
SGLANG_REQ_INT_FIELDS = (
    "req_pool_index",
    "prefix_len",
    "verify_len",
    "acc_len",
    "correct_drafts",
    "cap_trim",
    "bonus_token",
)

PG_TYPE = pa.struct(
    [
        ("src_fct", pa.int64()),  # forward_ct of the step whose block was censored
        ("k", pa.int32()),  # 1-based draft position in that block (SGLang): verify_len..gamma
        ("target_logprob", pa.float32()),  # target log-prob of the trimmed draft token
        ("draft_token", pa.int32()),
        ("realized_token", pa.int32()),
    ]
)

RUNS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("mode", pa.string(), nullable=False),
        pa.field("gamma", pa.int32(), nullable=False),
        ("model", pa.string()),
        ("drafter", pa.string()),
        ("workload", pa.string()),  # a single workload label, or "mixed"
        ("temperature", pa.float32()),
        ("top_p", pa.float32()),
        ("top_k", pa.int32()),
        ("seed", pa.int64()),
        ("companion_of", pa.string()),  # the compact run a cap-accept run shadows
        ("lag_steps", pa.int32()),
        ("dp_size", pa.int32()),
        ("started_at", pa.timestamp("us", tz="UTC")),
        ("config", pa.string()),  # JSON: everything else (cost table path, STS, host...)
    ]
)

STEPS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("dp_rank", pa.int32(), nullable=False),
        pa.field("forward_ct", pa.int64(), nullable=False),
        ("source", pa.string()),
        ("mode", pa.string()),
        *[(f, pa.int64()) for f in SGLANG_STEP_INT_FIELDS],
        *[(f, pa.float64()) for f in SGLANG_STEP_FLOAT_FIELDS],
        ("ts", pa.timestamp("us", tz="UTC")),
    ]
)

REQ_STEPS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("dp_rank", pa.int32(), nullable=False),
        pa.field("forward_ct", pa.int64(), nullable=False),
        pa.field("rid", pa.string(), nullable=False),
        pa.field("gamma", pa.int32(), nullable=False),
        *[(f, pa.int64()) for f in SGLANG_REQ_INT_FIELDS],
        ("draft_tokens", pa.list_(pa.int32())),
        ("confidence", pa.list_(pa.float32())),
        ("survival", pa.list_(pa.float32())),
        ("workload", pa.string()),
        ("temperature", pa.float32()),
        ("top_p", pa.float32()),
        ("top_k", pa.int32()),
        ("is_last", pa.bool_()),  # the request's final step (EOS / length may cut acc_len)
        # Block-accept estimator fields, SGLang JSONL names (null when not censored).
        ("trimmed_tokens", pa.list_(pa.int32())),
        ("q_lp", pa.list_(pa.float32())),
        ("pg", pa.list_(PG_TYPE)),
        ("ts", pa.timestamp("us", tz="UTC")),
    ]
)

REQUESTS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("rid", pa.string(), nullable=False),
        ("dp_rank", pa.int32()),
        ("workload", pa.string()),
        ("prompt", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("output_tokens", pa.list_(pa.int32())),
        ("completion_tokens", pa.int64()),
        ("finish_reason", pa.string()),  # "stop" (EOS) | "length" | "abort"
        ("max_new_tokens", pa.int64()),
        ("temperature", pa.float32()),
        ("top_p", pa.float32()),
        ("top_k", pa.int32()),
        ("seed", pa.int64()),
        # Wall-clock seconds since the epoch. TTFT = first_token_time - arrival_time;
        # TPOT = (finish_time - first_token_time) / (completion_tokens - 1), TTFT excluded.
        ("arrival_time", pa.float64()),
        ("first_token_time", pa.float64()),
        ("finish_time", pa.float64()),
    ]
)

TABLES: dict[str, pa.Schema] = {
    "runs": RUNS,
    "steps": STEPS,
    "req_steps": REQ_STEPS,
    "requests": REQUESTS,
}

# Idempotency keys: a row with the same key is the same fact, ingested at most once.
KEYS: dict[str, tuple[str, ...]] = {
    "runs": ("run_id",),
    "steps": ("run_id", "dp_rank", "forward_ct"),
    "req_steps": ("run_id", "dp_rank", "forward_ct", "rid"),
    "requests": ("run_id", "rid"),
}

_STEP_INT_DEFAULT = -1


class SchemaError(ValueError):
    """A batch cannot be read at all (unknown table, missing required column)."""


@dataclass(frozen=True)
class RecordError:
    """One rejected row: which table, which row of the batch, which field, what value, why."""

    table: str
    row: int
    field: str
    value: Any
    reason: str

    def __str__(self) -> str:
        return f"{self.table}[{self.row}].{self.field}={self.value!r}: {self.reason}"


# ---------------------------------------------------------------- building batches


def to_table(
    table: str, rows: Sequence[Mapping[str, Any]] | pa.Table
) -> tuple[pa.Table, list[RecordError]]:
    """Turn rows (dicts) or an Arrow table into a table of the named schema.

    Rows whose values have the wrong type are dropped and reported, field by field; the
    rest are kept. Missing optional fields become null (SGLang's int step fields: -1).
    """
    data, errors, _ = _to_table(table, rows)
    return data, errors


def _to_table(
    table: str, rows: Sequence[Mapping[str, Any]] | pa.Table
) -> tuple[pa.Table, list[RecordError], np.ndarray | None]:
    """:func:`to_table`, plus the caller's row number of each kept row (None: all kept)."""
    schema = _schema(table)
    if isinstance(rows, pa.Table):
        return _conform(table, rows), [], None
    rows = [_fill_defaults(table, r) for r in rows]
    if not _has_fractional_int(schema, rows):  # pyarrow would silently truncate 2.5 -> 2
        try:
            return pa.Table.from_pylist(rows, schema=schema), [], None
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            pass
    # Slow path, only for a batch that holds a bad row: find the bad rows one by one.
    good, kept, errors = [], [], []
    for i, row in enumerate(rows):
        err = _row_type_error(table, schema, i, row)
        if err is None:
            good.append(row)
            kept.append(i)
        else:
            errors.append(err)
    return pa.Table.from_pylist(good, schema=schema), errors, np.asarray(kept, dtype=np.int64)


def _fill_defaults(table: str, row: Mapping[str, Any]) -> dict[str, Any]:
    row = dict(row)
    if table == "steps":
        for f in SGLANG_STEP_INT_FIELDS:
            if row.get(f) is None:
                row[f] = _STEP_INT_DEFAULT
    unknown = set(row) - set(_schema(table).names)
    for f in unknown:  # SGLang adds fields over time; keep what we know, drop the rest
        del row[f]
    return row


def _is_int_field(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or (pa.types.is_list(t) and pa.types.is_integer(t.value_type))


def _fractional(value: Any) -> bool:
    """A float with a fraction where an int (or a list of ints) belongs."""
    if isinstance(value, float):
        return not value.is_integer()
    if isinstance(value, list | tuple):
        return any(isinstance(x, float) and not x.is_integer() for x in value)
    return False


def _has_fractional_int(schema: pa.Schema, rows: Sequence[Mapping[str, Any]]) -> bool:
    for field in schema:
        if not _is_int_field(field.type):
            continue
        col = [row.get(field.name) for row in rows]
        if pa.types.is_list(field.type):
            col = [x for v in col if isinstance(v, list | tuple) for x in v]
        if any(issubclass(t, float) for t in set(map(type, col))) and any(map(_fractional, col)):
            return True
    return False


def _row_type_error(
    table: str, schema: pa.Schema, i: int, row: Mapping[str, Any]
) -> RecordError | None:
    for field in schema:
        value = row.get(field.name)
        if value is None:
            if not field.nullable:
                return RecordError(table, i, field.name, None, "required field is missing")
            continue
        if _is_int_field(field.type) and _fractional(value):
            reason = f"expected {field.type}, got a fraction"
            return RecordError(table, i, field.name, value, reason)
        try:
            pa.array([value], type=field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
            return RecordError(table, i, field.name, value, f"expected {field.type}: {exc}")
        if isinstance(value, bool) and pa.types.is_integer(field.type):
            return RecordError(table, i, field.name, value, f"expected {field.type}, got bool")
        if isinstance(value, str) and not pa.types.is_string(field.type):
            return RecordError(table, i, field.name, value, f"expected {field.type}, got str")
    return None


def _conform(table: str, data: pa.Table) -> pa.Table:
    """Cast an Arrow table to the schema: add missing optional columns, reorder, cast."""
    schema = _schema(table)
    missing_required = [
        f.name for f in schema if not f.nullable and f.name not in data.column_names
    ]
    if missing_required:
        raise SchemaError(f"{table}: missing required column(s) {missing_required}")
    cols = []
    for field in schema:
        if field.name in data.column_names:
            col = data.column(field.name)
            if col.type != field.type:
                try:
                    col = col.cast(field.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    raise SchemaError(
                        f"{table}.{field.name}: cannot cast {col.type} to {field.type}: {exc}"
                    ) from exc
        elif table == "steps" and field.name in SGLANG_STEP_INT_FIELDS:
            col = pa.array(np.full(data.num_rows, _STEP_INT_DEFAULT, dtype=np.int64))
        else:
            col = pa.nulls(data.num_rows, type=field.type)
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=schema)


def _schema(table: str) -> pa.Schema:
    try:
        return TABLES[table]
    except KeyError:
        raise SchemaError(f"unknown table {table!r}; expected one of {sorted(TABLES)}") from None


# ---------------------------------------------------------------- validation


def validate(
    table: str, rows: Sequence[Mapping[str, Any]] | pa.Table
) -> tuple[pa.Table, list[RecordError]]:
    """Type-check and rule-check a batch. Returns (valid rows, one error per rejected row)."""
    data, errors, kept = _to_table(table, rows)
    # from_pylist and casts do not enforce nullable=False: a missing key must be caught here.
    checks = [
        (f.name, _null(data.column(f.name)), "required field is missing")
        for f in data.schema
        if not f.nullable and data.column(f.name).null_count
    ]
    checks += _RULES[table](data)
    bad = np.zeros(data.num_rows, dtype=bool)
    rule_errors: dict[int, RecordError] = {}
    for field, mask, reason in checks:
        mask = np.asarray(mask, dtype=bool)
        new = mask & ~bad
        if new.any():
            col = data.column(field)
            for i in np.flatnonzero(new):
                # Row numbers refer to the batch the caller gave, even after type errors.
                row = int(i) if kept is None else int(kept[i])
                rule_errors[row] = RecordError(table, row, field, col[int(i)].as_py(), reason)
            bad |= mask
    if not bad.any():
        return data, errors
    errors.extend(rule_errors.values())
    errors.sort(key=lambda e: e.row)
    return data.filter(pa.array(~bad)), errors


def _np(col: pa.ChunkedArray | pa.Array, fill: float | int = 0) -> np.ndarray:
    return pc.fill_null(col, fill).to_numpy(zero_copy_only=False)


def _null(col: pa.ChunkedArray) -> np.ndarray:
    return pc.is_null(col).to_numpy(zero_copy_only=False)


def _enum(
    data: pa.Table, field: str, allowed: Iterable[str], nullable: bool
) -> tuple[str, np.ndarray, str]:
    col = data.column(field)
    ok = pc.is_in(col, value_set=pa.array(list(allowed))).to_numpy(zero_copy_only=False)
    if nullable:
        ok |= _null(col)
    return field, ~ok, f"must be one of {list(allowed)}"


def _probability_lists(
    data: pa.Table, field: str, gamma: np.ndarray
) -> list[tuple[str, np.ndarray, str]]:
    col = data.column(field)
    null = _null(col)
    lengths = _np(pc.list_value_length(col), 0)
    checks = [(field, ~null & (lengths != gamma), "length must equal gamma")]
    flat = pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(np.float64)
    if flat.size:
        bad_value = ~np.isfinite(flat) | (flat < 0.0) | (flat > 1.0)
        if bad_value.any():
            row_of = np.repeat(np.arange(data.num_rows), lengths)
            bad_rows = np.zeros(data.num_rows, dtype=bool)
            bad_rows[row_of[bad_value]] = True
            checks.append((field, bad_rows, "every value must be a finite probability in [0, 1]"))
    return checks


def _req_step_rules(data: pa.Table) -> list[tuple[str, np.ndarray, str]]:
    gamma = _np(data.column("gamma"))
    verify_len = _np(data.column("verify_len"), -1)
    acc_len = _np(data.column("acc_len"), -1)
    correct = _np(data.column("correct_drafts"), -1)
    cap_trim = _np(data.column("cap_trim"), 0)
    is_last = data.column("is_last")
    may_cut = _np(is_last, True) | _null(is_last)  # unknown -> allow the final-step cut
    draft_len = _np(pc.list_value_length(data.column("draft_tokens")), -1)
    no_drafts = _null(data.column("draft_tokens"))
    checks = [
        ("gamma", gamma < 1, "gamma must be >= 1"),
        (
            "verify_len",
            (verify_len < 1) | (verify_len > gamma + 1),
            "verify_len must be in 1..gamma+1",
        ),
        (
            "correct_drafts",
            (correct < 0) | (correct > np.maximum(verify_len - 1, 0)),
            "correct_drafts must be in 0..verify_len-1",
        ),
        (
            "acc_len",
            (acc_len > correct + 1) | (acc_len < 1) | ((acc_len != correct + 1) & ~may_cut),
            "acc_len must equal correct_drafts+1 (smaller only on a request's final step)",
        ),
        (
            "cap_trim",
            (cap_trim < 0) | (correct + cap_trim > gamma),
            "cap_trim must be in 0..gamma-correct_drafts",
        ),
        ("draft_tokens", ~no_drafts & (draft_len != gamma), "length must equal gamma"),
    ]
    for field in ("confidence", "survival"):
        checks += _probability_lists(data, field, gamma)
    for field in ("temperature", "top_p"):
        v = _np(data.column(field), 0.0).astype(np.float64)
        checks.append((field, ~np.isfinite(v) | (v < 0), "must be finite and >= 0"))
    return checks


def _step_rules(data: pa.Table) -> list[tuple[str, np.ndarray, str]]:
    checks = [
        ("forward_ct", _np(data.column("forward_ct")) < 0, "forward_ct must be >= 0"),
        _enum(data, "mode", MODES, nullable=True),
        _enum(data, "source", SOURCES, nullable=True),
    ]
    for f in SGLANG_STEP_FLOAT_FIELDS:
        v = _np(data.column(f), 0.0)
        checks.append((f, ~np.isfinite(v), "must be finite (or absent)"))
    return checks


def _run_rules(data: pa.Table) -> list[tuple[str, np.ndarray, str]]:
    temp = _np(data.column("temperature"), 0.0).astype(np.float64)
    return [
        _enum(data, "mode", MODES, nullable=False),
        _enum(data, "source", SOURCES, nullable=False),
        ("gamma", _np(data.column("gamma")) < 1, "gamma must be >= 1"),
        ("temperature", ~np.isfinite(temp) | (temp < 0), "must be finite and >= 0"),
    ]


def _request_rules(data: pa.Table) -> list[tuple[str, np.ndarray, str]]:
    checks = [_enum(data, "finish_reason", ("stop", "length", "abort"), nullable=True)]
    for f in ("arrival_time", "first_token_time", "finish_time"):
        v = _np(data.column(f), 0.0)
        checks.append((f, ~np.isfinite(v), "must be finite (or absent)"))
    return checks


_RULES = {
    "runs": _run_rules,
    "steps": _step_rules,
    "req_steps": _req_step_rules,
    "requests": _request_rules,
}


# ---------------------------------------------------------------- SGLang round trip


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
        if v is not None and v != _STEP_INT_DEFAULT:
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
