"""Turning rows into the schema's tables and checking them: the one admission path of every
record (``FanOut.emit``, ``Store.write``, the file loaders).

Conversion (:func:`to_table`) types a batch: rows (dicts) or an Arrow table become a table of
the named schema; a value that does not fit its field rejects its row only. Validation
(:func:`validate`, :func:`check`) then applies the rules of ``dspark_obs/rules.py``,
vectorized over whole columns; only failing rows are turned into messages, and a batch with
bad rows keeps its good rows.

Why :class:`ValidatedBatch`: a writer must not check a batch twice (validation is most of an
ingest's CPU), yet must never trust a batch nobody checked. The proof travels in the type:
only :func:`check` makes a ValidatedBatch, and :meth:`Store.write` stores one as it is.

Layering: this module sits above ``schema`` (declarations) and ``rules`` (the checks);
neither imports it.
"""

from __future__ import annotations

import dataclasses
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dspark_obs import rules
from dspark_obs.schema import (
    MAX_RUN_DIR_BYTES,
    SGLANG_STEP_INT_FIELDS,
    STEP_INT_UNSET,
    TABLES,
    run_dir_name,
)

__all__ = [
    "RecordError",
    "SchemaError",
    "ValidatedBatch",
    "check",
    "run_id_problem",
    "to_table",
    "validate",
]


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


_MINT = object()  # only check() holds it


@dataclass(frozen=True)
class ValidatedBatch:
    """Rows :func:`check` accepted: ``data`` is in ``TABLES[table]``'s schema and passed every
    rule. Only :func:`check` makes one (a direct construction raises TypeError), so holding
    one is the proof that a writer need not check it again."""

    table: str
    data: pa.Table
    _mint: object = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._mint is not _MINT:
            raise TypeError("a ValidatedBatch is made only by dspark_obs.validation.check()")

    @property
    def num_rows(self) -> int:
        return self.data.num_rows


_CONTROL = frozenset({"Cc", "Cf", "Co", "Cs"})  # what RE2's \p{C} matches (rules.py)


def run_id_problem(run_id: object, name_max: int = 255) -> str | None:
    """Why ``run_id`` cannot name a run in the store (None: it can).

    Not empty; no control or format characters (they break every line-based surface: logs, CSV,
    Prometheus text); and short enough that the store's longest name for the run fits one
    path component of ``name_max`` bytes (255 on most filesystems): ``run_id=<percent-
    encoded run_id>`` plus the generation suffix the store adds (:data:`MAX_RUN_DIR_BYTES`
    keeps 35 bytes for it).
    """
    if not isinstance(run_id, str):
        return f"must be text, got {type(run_id).__name__}"
    if not run_id:
        return "must not be empty"
    bad = sorted({f"U+{ord(c):04X}" for c in run_id if unicodedata.category(c) in _CONTROL})
    if bad:
        return f"holds control or format characters ({', '.join(bad[:5])})"
    limit = min(MAX_RUN_DIR_BYTES, name_max - (255 - MAX_RUN_DIR_BYTES))
    size = len(run_dir_name(run_id).encode())
    if size > limit:
        return (
            f"too long for the store: {size} bytes as the directory name run_id=<percent-encoded "
            f"id>, at most {limit} ({len(run_id)} characters given)"
        )
    return None


# ---------------------------------------------------------------- conversion


def to_table(
    table: str, rows: Sequence[Mapping[str, Any]] | pa.Table
) -> tuple[pa.Table, list[RecordError]]:
    """Turn rows (dicts) or an Arrow table into a table of the named schema.

    Rows whose values have the wrong type (or, in an Arrow table, a value that does not fit
    the schema's type) are dropped and reported, field by field; the rest are kept. Missing
    optional fields become null (SGLang's int step fields: -1). A column whose type cannot
    hold the field at all (text where a number belongs) is a SchemaError.
    """
    data, errors, _ = _to_table(table, rows)
    return data, errors


def _to_table(
    table: str, rows: Sequence[Mapping[str, Any]] | pa.Table
) -> tuple[pa.Table, list[RecordError], np.ndarray | None]:
    """:func:`to_table`, plus the caller's row number of each kept row (None: all kept)."""
    schema = _schema(table)
    if isinstance(rows, pa.Table):
        return _conform(table, rows)
    if isinstance(rows, Mapping | str | bytes) or not isinstance(rows, Iterable):
        raise SchemaError(
            f"{table}: expected a list of rows (dicts) or a pyarrow.Table, "
            f"got {type(rows).__name__}"
        )
    rows = list(rows)
    not_rows = [i for i, r in enumerate(rows) if not isinstance(r, Mapping)]
    if not_rows:
        errors = [
            RecordError(table, i, "<row>", rows[i], "a row must be a mapping of field -> value")
            for i in not_rows
        ]
        keep = np.setdiff1d(np.arange(len(rows)), not_rows)
        data, more, kept = _to_table(table, [rows[i] for i in keep])
        errors += [RecordError(e.table, int(keep[e.row]), e.field, e.value, e.reason) for e in more]
        errors.sort(key=lambda e: e.row)
        return data, errors, keep if kept is None else keep[kept]
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
    names = _field_names(table)
    row = {k: v for k, v in row.items() if k in names}  # SGLang adds fields: drop unknown ones
    if table == "steps":
        for f in SGLANG_STEP_INT_FIELDS:
            if row.get(f) is None:
                row[f] = STEP_INT_UNSET
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
        if isinstance(value, bool) and pa.types.is_integer(field.type):
            return RecordError(table, i, field.name, value, f"expected {field.type}, got bool")
        if isinstance(value, str) and not pa.types.is_string(field.type):
            return RecordError(table, i, field.name, value, f"expected {field.type}, got str")
        try:
            pa.array([value], type=field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
            return RecordError(table, i, field.name, value, f"expected {field.type}: {exc}")
    return None


def _conform(table: str, data: pa.Table) -> tuple[pa.Table, list[RecordError], np.ndarray | None]:
    """Cast an Arrow table to the schema: add missing optional columns, reorder, cast.

    A value that does not fit its field's type (2.5 or 2**40 where an int32 belongs) rejects
    its row only; the rows of such a value are found by bisection, so a clean batch costs
    one cast per column.
    """
    schema = _schema(table)
    names = data.column_names
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SchemaError(f"{table}: column(s) {twice} appear more than once")
    missing_required = [f.name for f in schema if not f.nullable and f.name not in names]
    if missing_required:
        raise SchemaError(f"{table}: missing required column(s) {missing_required}")
    bad = np.zeros(data.num_rows, dtype=bool)
    errors: dict[int, RecordError] = {}
    wrong_kind: set[str] = set()  # columns whose every non-null value rejects its row
    for field in schema:
        if field.name not in names or data.column(field.name).type == field.type:
            continue
        col = data.column(field.name)
        arr = col.combine_chunks()
        if pa.types.is_dictionary(arr.type):  # e.g. a pandas categorical
            arr = arr.dictionary_decode()
        if not _castable(arr.type, field.type) and not _parses(arr.type, field.type):
            wrong_kind.add(field.name)
            reason = f"expected {field.type}, got {arr.type}"
            for i in np.flatnonzero(arr.is_valid().to_numpy(zero_copy_only=False)):
                if not bad[i]:
                    bad[i] = True
                    errors[i] = RecordError(table, int(i), field.name, _value(arr, i), reason)
            continue
        if _parses(arr.type, field.type) and pa.types.is_integer(field.type):
            # Arrow also reads "0x10" as 16: an int written as text must be decimal digits.
            digits = pc.match_substring_regex(arr, r"^[+-]?[0-9]+$")
            for i in np.flatnonzero(~pc.fill_null(digits, True).to_numpy(zero_copy_only=False)):
                if not bad[i]:
                    bad[i] = True
                    reason = f"not a {field.type} number"
                    errors[i] = RecordError(table, int(i), field.name, _value(arr, i), reason)
            arr = pc.if_else(pc.fill_null(digits, True), arr, pa.scalar(None, arr.type))
        try:
            arr.cast(field.type, safe=not _coarser_time(arr.type, field.type))
            continue
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            pass
        except pa.ArrowNotImplementedError as exc:
            raise SchemaError(
                f"{table}.{field.name}: cannot cast {col.type} to {field.type}: {exc}"
            ) from None
        text = pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)
        reason = f"not a {field.type} number" if text else f"does not fit {field.type}"
        for i in _uncastable(arr, field.type, 0):
            if not bad[i]:
                bad[i] = True
                errors[i] = RecordError(table, i, field.name, _value(arr, i), reason)
    kept = None
    if bad.any():
        kept = np.flatnonzero(~bad)
        data = data.filter(pa.array(~bad))
    cols = []
    for field in schema:
        if field.name in wrong_kind:  # only its null values are left
            col = pa.nulls(data.num_rows, type=field.type)
        elif field.name in names:
            col = data.column(field.name)
            if pa.types.is_dictionary(col.type) and _parses(col.type.value_type, field.type):
                col = col.cast(col.type.value_type)
            if col.type != field.type:
                col = col.cast(field.type, safe=not _coarser_time(col.type, field.type))
        elif table == "steps" and field.name in SGLANG_STEP_INT_FIELDS:
            col = pa.array(np.full(data.num_rows, STEP_INT_UNSET, dtype=np.int64))
        else:
            col = pa.nulls(data.num_rows, type=field.type)
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=schema), sorted(errors.values(), key=_row), kept


def _row(e: RecordError) -> int:
    return e.row


def _value(col: pa.ChunkedArray | pa.Array, i: int) -> Any:
    """Row ``i``'s value for a message (a timestamp Python cannot hold: its raw int)."""
    try:
        return col[i].as_py()
    except (OverflowError, ValueError, pa.ArrowException):
        item = col.slice(i, 1)
        if pa.types.is_timestamp(item.type):
            return f"{item.cast(pa.int64())[0].as_py()} ({item.type.unit} since the epoch)"
        return "<unreadable value>"


def _castable(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether a column of type ``src`` may hold values of ``dst`` (then cast value by
    value). Numbers stay numbers (text, bools and dates never become numbers), lists stay
    lists, structs stay structs."""
    t = pa.types
    if t.is_null(src) or src == dst:
        return True
    if t.is_dictionary(src):  # e.g. a pandas categorical
        return _castable(src.value_type, dst)
    if t.is_integer(dst) or t.is_floating(dst):
        return t.is_integer(src) or t.is_floating(src)
    if t.is_boolean(dst):
        return t.is_boolean(src)
    if t.is_string(dst) or t.is_large_string(dst):
        return t.is_string(src) or t.is_large_string(src)
    if t.is_timestamp(dst):
        return t.is_timestamp(src) or t.is_integer(src)
    if t.is_list(dst):
        return (t.is_list(src) or t.is_large_list(src)) and _castable(
            src.value_type, dst.value_type
        )
    if t.is_struct(dst):
        if not t.is_struct(src):
            return False
        have = {src.field(i).name: src.field(i).type for i in range(src.num_fields)}
        want = {dst.field(i).name: dst.field(i).type for i in range(dst.num_fields)}
        return set(have) <= set(want) and all(_castable(have[k], want[k]) for k in have)
    return False


def _parses(src: pa.DataType, dst: pa.DataType) -> bool:
    """Text where a number belongs: each value is parsed (Arrow's strict cast: "4" is 4;
    "x", "4.5" for an int, "" reject their row), as one bad value rejects only its row."""
    text = pa.types.is_string(src) or pa.types.is_large_string(src)
    return text and (pa.types.is_integer(dst) or pa.types.is_floating(dst))


def _coarser_time(src: pa.DataType, dst: pa.DataType) -> bool:
    """ns -> us timestamps (pandas' default): dropping sub-microsecond digits is no error."""
    return pa.types.is_timestamp(src) and pa.types.is_timestamp(dst)


def _uncastable(arr: pa.Array, typ: pa.DataType, offset: int) -> list[int]:
    """Row numbers (from ``offset``) of the values of ``arr`` that do not cast to ``typ``."""
    try:
        arr.cast(typ)
        return []
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        if len(arr) == 1:
            return [offset]
    mid = len(arr) // 2
    return _uncastable(arr.slice(0, mid), typ, offset) + _uncastable(
        arr.slice(mid), typ, offset + mid
    )


_FIELD_NAMES: dict[str, frozenset[str]] = {}


def _field_names(table: str) -> frozenset[str]:
    """A table's column names as a set (row filtering runs once per row of every batch)."""
    names = _FIELD_NAMES.get(table)
    if names is None:
        names = _FIELD_NAMES[table] = frozenset(_schema(table).names)
    return names


def _schema(table: str) -> pa.Schema:
    try:
        return TABLES[table]
    except (KeyError, TypeError):
        raise SchemaError(f"unknown table {table!r}; expected one of {sorted(TABLES)}") from None


# ---------------------------------------------------------------- validation


def validate(
    table: str, rows: Sequence[Mapping[str, Any]] | pa.Table
) -> tuple[pa.Table, list[RecordError]]:
    """Type-check and rule-check a batch. Returns (valid rows, one error per rejected row).

    Every rule is listed in the README ("What is validated"). :func:`check` returns the same
    rows as a :class:`ValidatedBatch` (what a writer may store without checking again).
    """
    data, errors, kept = _to_table(table, rows)
    # from_pylist and casts do not enforce nullable=False: rules.checks catches a missing key.
    checks = rules.checks(table, data)
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
                rule_errors[row] = RecordError(table, row, field, _value(col, int(i)), reason)
            bad |= mask
    if bad.any():
        errors.extend(rule_errors.values())
        errors.sort(key=_row)
        data = data.filter(pa.array(~bad))
    return data, errors


def check(
    table: str, rows: Sequence[Mapping[str, Any]] | pa.Table
) -> tuple[ValidatedBatch, list[RecordError]]:
    """:func:`validate`, with the valid rows as a :class:`ValidatedBatch`."""
    data, errors = validate(table, rows)
    return ValidatedBatch(table, data, _MINT), errors
