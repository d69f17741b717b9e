"""The validation rules of the tables: vectorized checks over whole Arrow batches.

Each rule returns ``(field, mask of the rows that break it, the rule in words)``;
``validation.validate`` turns the masks into one RecordError per rejected row. Every rule is
listed in ``docs/parts/store.md`` ("What is validated"). Integers are clipped at +-2**40
before any derived sum (``correct_drafts + cap_trim``), so nothing wraps near 2**63.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dspark_obs import schema

__all__ = ["Check", "checks"]

Check = tuple[str, np.ndarray, str]  # (field, rows that break the rule, the rule)


def checks(table: str, data: pa.Table) -> list[Check]:
    """Every rule of ``table`` over a batch already in the table's schema."""
    out = [
        (f.name, null(data.column(f.name)), "required field is missing")
        for f in data.schema
        if not f.nullable and data.column(f.name).null_count
    ]
    return out + _run_id_rules(data) + _RULES[table](data) + _value_rules(data, table)


_INT_CLIP = 1 << 40  # far beyond every valid value, far from int64's end: no wrap-around


def _np(col: pa.ChunkedArray | pa.Array, fill: float | int = 0) -> np.ndarray:
    if col.null_count:
        col = pc.fill_null(col, fill)
    return col.to_numpy(zero_copy_only=False)


def _ints(col: pa.ChunkedArray | pa.Array, fill: int) -> np.ndarray:
    """An int column as int64, nulls as ``fill``, clipped so that derived sums cannot wrap."""
    v = _np(col, fill).astype(np.int64, copy=False)
    if v.size and (v.max() > _INT_CLIP or v.min() < -_INT_CLIP):
        v = np.clip(v, -_INT_CLIP, _INT_CLIP)
    return v


def _floats(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A float column as a float array, nulls as 0.0 (absent values pass range checks)."""
    return _np(col, 0.0)


def null(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    if not col.null_count:
        return np.zeros(len(col), dtype=bool)
    return pc.is_null(col).to_numpy(zero_copy_only=False)


def _lengths(col: pa.ChunkedArray) -> np.ndarray:
    """List lengths, -1 for a null list."""
    return _np(pc.list_value_length(col), -1).astype(np.int64, copy=False)


def _enum(
    data: pa.Table, field: str, allowed: Iterable[str], nullable: bool
) -> Check:
    col = data.column(field)
    ok = pc.is_in(col, value_set=pa.array(list(allowed))).to_numpy(zero_copy_only=False)
    if nullable:
        ok |= null(col)
    return field, ~ok, f"must be one of {list(allowed)}"


def _run_id_rules(data: pa.Table) -> list[Check]:
    """Judged once per distinct run_id (a batch holds one or a few), then mapped to rows."""
    col = data.column("run_id")
    ids = pc.unique(col)
    checks = []
    empty = pc.fill_null(pc.equal(pc.binary_length(ids), 0), False)
    if pc.any(empty).as_py():
        checks.append(("run_id", _rows_with(col, pc.filter(ids, empty)), "must not be empty"))
    nbytes = _np(pc.binary_length(ids), 0)
    if nbytes.size and 3 * int(nbytes.max()) + 8 > schema.MAX_RUN_DIR_BYTES:  # quote(): <= 3x
        too_long = [
            r for r in ids.to_pylist()
            if r is not None and len(schema.run_dir_name(r).encode()) > schema.MAX_RUN_DIR_BYTES
        ]
        if too_long:
            reason = (f"too long for a directory name (at most {schema.MAX_RUN_DIR_BYTES} bytes "
                      "once percent-encoded as run_id=...)")
            checks.append(("run_id", _rows_with(col, pa.array(too_long, pa.string())), reason))
    # Control characters (a newline, NUL, ...): the same rule as validation.run_id_problem.
    control = pc.fill_null(pc.match_substring_regex(ids, r"\p{C}"), False)
    if pc.any(control).as_py():
        checks.append(("run_id", _rows_with(col, pc.filter(ids, control)),
                       "holds control or format characters"))
    return checks


def _rows_with(col: pa.ChunkedArray, values: pa.Array) -> np.ndarray:
    """Rows of ``col`` holding one of ``values``."""
    return pc.is_in(col, value_set=values).to_numpy(zero_copy_only=False)


def _sampling_rules(data: pa.Table) -> list[Check]:
    """temperature >= 0, 0 < top_p <= 1, top_k = -1 (off) or >= 1 (SGLang's conventions)."""
    temp, top_p, top_k = (data.column(f) for f in ("temperature", "top_p", "top_k"))
    t, p, k = _floats(temp), _np(top_p, 1.0).astype(np.float64), _ints(top_k, -1)
    return [
        ("temperature", ~np.isfinite(t) | (t < 0), "must be finite and >= 0"),
        ("top_p", ~np.isfinite(p) | (p <= 0) | (p > 1), "must be in (0, 1]"),
        ("top_k", (k != -1) & (k < 1), "must be -1 (off) or >= 1"),
    ]


def _at_least(data: pa.Table, fields: Iterable[str], low: int) -> list[Check]:
    return [(f, _ints(data.column(f), low) < low, f"must be >= {low}") for f in fields]


def _value_rules(data: pa.Table, table: str) -> list[Check]:
    """Every float field, scalar or inside a list or struct, is finite (nulls inside a list
    are refused too); every token id inside a list is >= 0. Fields a table rule already
    checks value by value are skipped."""
    checks = []
    for field in data.schema:
        if (table, field.name) in _CHECKED_VALUES:
            continue
        t = field.type
        if pa.types.is_timestamp(t):
            v = _np(data.column(field.name).cast(pa.int64()), 0)
            checks.append((field.name, (v < 0) | (v > _MAX_TIMESTAMP[t.unit]),
                           "must be between 1970-01-01 and 9999-12-31"))
        elif pa.types.is_floating(t):
            v = _floats(data.column(field.name))
            checks.append((field.name, ~np.isfinite(v), "must be finite (or absent)"))
        elif pa.types.is_list(t) and data.column(field.name).null_count < data.num_rows:
            bad = _bad_list_rows(data.column(field.name).combine_chunks())
            if bad is not None:
                checks.append((field.name, bad, "every value must be non-null, finite "
                               "(and >= 0 for ints: token ids, counts)"))
    return checks


def _bad_list_rows(arr: pa.ListArray) -> np.ndarray | None:
    flat = pc.list_flatten(arr)
    if len(flat) == 0:
        return None
    bad = _bad_leaf(flat)
    if not bad.any():
        return None
    rows = np.zeros(len(arr), dtype=bool)
    rows[pc.list_parent_indices(arr).to_numpy()[bad]] = True
    return rows


def _bad_leaf(arr: pa.Array) -> np.ndarray:
    t = arr.type
    if pa.types.is_integer(t) and not arr.null_count and pc.min(arr).as_py() >= 0:
        return np.zeros(len(arr), dtype=bool)  # the common case, without a numpy pass
    bad = null(arr)
    if pa.types.is_floating(t):
        bad |= ~np.isfinite(_floats(arr))
    elif pa.types.is_integer(t):
        bad |= _np(arr, 0) < 0
    elif pa.types.is_struct(t):
        for i in range(t.num_fields):
            bad |= _bad_leaf(pc.struct_field(arr, [i]))
    return bad


def _probability_lists(data: pa.Table, field: str, gamma: np.ndarray) -> list[Check]:
    col = data.column(field)
    lengths = _lengths(col)
    checks = [(field, (lengths != -1) & (lengths != gamma), "length must equal gamma")]
    flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
    # two reductions decide a clean column (a NaN or a null, as NaN, fails both bounds)
    if flat.size and not (flat.min() >= 0.0 and flat.max() <= 1.0):
        bad_value = ~((flat >= 0.0) & (flat <= 1.0))
        if bad_value.any():
            row_of = np.repeat(np.arange(data.num_rows), np.maximum(lengths, 0))
            bad_rows = np.zeros(data.num_rows, dtype=bool)
            bad_rows[row_of[bad_value]] = True
            checks.append((field, bad_rows, "every value must be a finite probability in [0, 1]"))
    return checks


# 9999-12-31T23:59:59 UTC, the last instant a Python datetime holds, per timestamp unit.
_MAX_TIMESTAMP = {u: 253_402_300_799 * m for u, m in
                  (("s", 1), ("ms", 10**3), ("us", 10**6), ("ns", 10**9))}
_LOGPROB_SLACK = 1e-6  # float rounding of a log-softmax that is 0 in exact arithmetic


def _window_key_rules(
    data: pa.Table, gamma: np.ndarray, fct: np.ndarray, verify_len: np.ndarray
) -> list[Check]:
    """A request-step's key and window, as stored rows and their amendments both carry them."""
    return [
        ("dp_rank", _ints(data.column("dp_rank"), 0) < 0, "dp_rank must be >= 0"),
        ("forward_ct", fct < 0, "forward_ct must be >= 0"),
        ("gamma", gamma < 1, "gamma must be >= 1"),
        (
            "verify_len",
            (verify_len < 1) | (verify_len > gamma + 1),
            "verify_len must be in 1..gamma+1",
        ),
    ]


def _req_step_rules(data: pa.Table) -> list[Check]:
    gamma = _ints(data.column("gamma"), 0)
    fct = _ints(data.column("forward_ct"), 0)
    verify_len = _ints(data.column("verify_len"), -1)
    acc_len = _ints(data.column("acc_len"), -1)
    correct = _ints(data.column("correct_drafts"), -1)
    cap_trim = _ints(data.column("cap_trim"), 0)
    is_last = data.column("is_last")
    may_cut = _np(is_last, True) | null(is_last)  # unknown -> allow the final-step cut
    draft_len = _lengths(data.column("draft_tokens"))
    checks = [
        *_window_key_rules(data, gamma, fct, verify_len),
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
        ("draft_tokens", (draft_len != -1) & (draft_len != gamma), "length must equal gamma"),
        *_at_least(data, ("req_pool_index", "prefix_len", "bonus_token"), -1),
    ]
    for field in ("confidence", "survival"):
        checks += _probability_lists(data, field, gamma)
    checks += _sampling_rules(data)
    checks += _estimator_rules(data, gamma, verify_len, fct)
    return checks


def _estimator_rules(
    data: pa.Table, gamma: np.ndarray, verify_len: np.ndarray, fct: np.ndarray
) -> list[Check]:
    """trimmed_tokens: the drafts past the window (gamma+1-verify_len of them); q_lp: their
    log-probs (<= 0), one each; pg: k in 1..gamma, src_fct in 0..forward_ct, log-prob <= 0."""
    trimmed, q_lp, pg = (data.column(f) for f in ("trimmed_tokens", "q_lp", "pg"))
    n_trim = _lengths(trimmed)
    checks = [
        (
            "trimmed_tokens",
            (n_trim != -1) & (n_trim != gamma + 1 - verify_len),
            "length must equal gamma+1-verify_len (the drafts past the window)",
        ),
        ("q_lp", _lengths(q_lp) != n_trim, "needs one value per trimmed token"),
    ]
    if q_lp.null_count < data.num_rows:
        flat = _np(pc.list_flatten(q_lp), np.nan)  # a missing log-prob is not one (fails <=)
        parents = pc.list_parent_indices(q_lp.combine_chunks()).to_numpy()
        checks.append(("q_lp", _rows_where(~(flat <= _LOGPROB_SLACK), parents, data.num_rows),
                       "every value must be a finite log-probability (<= 0)"))
    if pg.null_count < data.num_rows:
        arr = pg.combine_chunks()
        items = pc.list_flatten(arr)
        parents = pc.list_parent_indices(arr).to_numpy()
        k = _ints(pc.struct_field(items, "k"), 0)
        src = _ints(pc.struct_field(items, "src_fct"), -1)
        lp = _floats(pc.struct_field(items, "target_logprob"))
        n = data.num_rows
        checks += [
            ("pg", _rows_where((k < 1) | (k > gamma[parents]), parents, n),
             "k must be in 1..gamma"),
            ("pg", _rows_where((src < 0) | (src > fct[parents]), parents, n),
             "src_fct must be in 0..forward_ct"),
            ("pg", _rows_where(~(lp <= _LOGPROB_SLACK), parents, n),
             "target_logprob must be a finite log-probability (<= 0)"),
        ]
    return checks


def _rows_where(bad_items: np.ndarray, parents: np.ndarray, n: int) -> np.ndarray:
    rows = np.zeros(n, dtype=bool)
    rows[parents[bad_items]] = True
    return rows


def _step_rules(data: pa.Table) -> list[Check]:
    checks = [
        ("dp_rank", _ints(data.column("dp_rank"), 0) < 0, "dp_rank must be >= 0"),
        ("forward_ct", _ints(data.column("forward_ct"), 0) < 0, "forward_ct must be >= 0"),
        _enum(data, "mode", schema.MODES, nullable=True),
        _enum(data, "source", schema.SOURCES, nullable=True),
        *_at_least(data, schema.SGLANG_STEP_INT_FIELDS, -1),
    ]
    for f in schema.SGLANG_STEP_FLOAT_FIELDS:
        if f.endswith("_ms"):
            v = _floats(data.column(f))
            checks.append((f, ~np.isfinite(v) | (v < 0), "must be finite and >= 0 (or absent)"))
    return checks


def _run_rules(data: pa.Table) -> list[Check]:
    return [
        _enum(data, "mode", schema.MODES, nullable=False),
        _enum(data, "source", schema.SOURCES, nullable=False),
        ("gamma", _ints(data.column("gamma"), 0) < 1, "gamma must be >= 1"),
        ("dp_size", _ints(data.column("dp_size"), 1) < 1, "must be >= 1"),
        ("lag_steps", _ints(data.column("lag_steps"), 0) < 0, "must be >= 0"),
        *_sampling_rules(data),
    ]


def _amend_rules(data: pa.Table) -> list[Check]:
    """A late estimator line: the row's key, gamma and window, and the same estimator rules
    as an on-time line; it must carry at least one estimator field (else it amends nothing)."""
    gamma = _ints(data.column("gamma"), 0)
    fct = _ints(data.column("forward_ct"), 0)
    verify_len = _ints(data.column("verify_len"), -1)
    empty = np.ones(data.num_rows, dtype=bool)
    for f in schema.AMENDED_FIELDS:
        empty &= null(data.column(f))
    return [
        *_window_key_rules(data, gamma, fct, verify_len),
        ("trimmed_tokens", empty, "an amendment needs trimmed_tokens, q_lp or pg"),
        *_estimator_rules(data, gamma, verify_len, fct),
    ]


def _request_rules(data: pa.Table) -> list[Check]:
    fields = ("dp_rank", "prompt_tokens", "completion_tokens", "max_new_tokens")
    return [
        _enum(data, "finish_reason", ("stop", "length", "abort"), nullable=True),
        *_at_least(data, fields, 0),
        *_sampling_rules(data),
    ]


_RULES = {
    "runs": _run_rules,
    "steps": _step_rules,
    "req_steps": _req_step_rules,
    "requests": _request_rules,
    "req_step_amends": _amend_rules,
}
# Fields whose every value a table rule checks already (skipped by _value_rules).
_CHECKED_VALUES = frozenset(
    {("req_steps", "confidence"), ("req_steps", "survival"), ("req_steps", "q_lp"),
     ("req_step_amends", "q_lp")}
    | {(t, f) for t in ("runs", "req_steps", "requests") for f in ("temperature", "top_p")}
    | {("steps", f) for f in schema.SGLANG_STEP_FLOAT_FIELDS if f.endswith("_ms")}
)


