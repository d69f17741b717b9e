"""Small helpers shared by the analytics modules (frame coercion, list columns, bootstrap)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

FrameLike = pd.DataFrame | pa.Table

# Separates run_id and rid inside one request key; neither ever contains a NUL.
_KEY_SEP = "\x00"


def as_frame(data: FrameLike | None, columns: Iterable[str] = ()) -> pd.DataFrame:
    """Accept a DataFrame or an Arrow table (what the store returns) and give a DataFrame."""
    if data is None:
        return pd.DataFrame(columns=list(columns))
    if isinstance(data, pa.Table):
        return data.to_pandas()
    if isinstance(data, pd.DataFrame):
        return data
    raise TypeError(f"expected a pandas DataFrame or a pyarrow Table, got {type(data).__name__}")


def is_missing(value: Any) -> bool:
    """True for None / NaN / pd.NA: the ways a null list cell shows up after to_pandas()."""
    if value is None or value is pd.NA:
        return True
    return isinstance(value, float) and math.isnan(value)


def list_matrix(values: Sequence[Any] | pd.Series, width: int) -> np.ndarray:
    """Stack a column of lists into a float matrix [n, width]; null rows and short lists -> NaN."""
    values = list(values)
    out = np.full((len(values), max(int(width), 0)), np.nan)
    rows = [i for i, v in enumerate(values) if not is_missing(v)]
    if not rows or out.shape[1] == 0:
        return out
    cells = [values[i] for i in rows]
    try:  # one C pass over cells that are already arrays or lists of numbers
        lengths = np.fromiter(map(len, cells), dtype=np.int64, count=len(cells))
        flat = np.concatenate(cells).astype(np.float64, copy=False)
    except (TypeError, ValueError):  # scalars, None inside a list: cell by cell
        cells = [np.asarray(c, dtype=np.float64).ravel() for c in cells]
        lengths = np.fromiter((c.size for c in cells), dtype=np.int64, count=len(cells))
        flat = np.concatenate(cells)
    at_row = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    at_col = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    keep = at_col < out.shape[1]
    out[at_row[keep], at_col[keep]] = flat[keep]
    return out


def column(frame: pd.DataFrame, name: str, default: Any, dtype: Any = np.float64) -> np.ndarray:
    """A column as a numpy array with nulls filled, or a constant array when it is absent."""
    if name not in frame.columns:
        return np.full(len(frame), default, dtype=dtype)
    col = frame[name]
    if dtype is object:
        return np.array([default if is_missing(v) else v for v in col], dtype=object)
    return (
        pd.to_numeric(col, errors="coerce")
        .astype(np.float64)
        .fillna(default)
        .to_numpy()
        .astype(dtype)
    )


def text_column(frame: pd.DataFrame, name: str, default: str) -> np.ndarray:
    """A string column with nulls replaced (workload, run_id): group keys must not be null."""
    if name not in frame.columns:
        return np.full(len(frame), default, dtype=object)
    values = frame[name].to_numpy(dtype=object)
    missing = np.asarray(pd.isna(values), dtype=bool)
    out = values.copy()
    out[missing] = default
    if pd.api.types.infer_dtype(values[~missing], skipna=False) not in ("string", "empty"):
        out = np.array([str(v) for v in out], dtype=object)  # ids stored as numbers, say
    return out


def request_key(run_id: Any, rid: Any) -> str:
    """One string per request: requests are the unit of resampling and of pairing."""
    return f"{run_id}{_KEY_SEP}{rid}"


def request_key_array(run_ids: Any, rids: Any) -> np.ndarray:
    """:func:`request_key` of each (run_id, rid) pair, as one object array (vectorized)."""
    run = np.asarray(run_ids, dtype=object)
    rid = np.asarray(rids, dtype=object)
    try:
        return np.asarray(run + _KEY_SEP + rid, dtype=object)
    except TypeError:  # a non-string id: the scalar form str()s it
        return np.array([request_key(a, b) for a, b in zip(run, rid, strict=True)], dtype=object)


def request_keys(frame: pd.DataFrame) -> np.ndarray:
    return request_key_array(text_column(frame, "run_id", ""), text_column(frame, "rid", ""))


def bootstrap_indices(n_items: int, n_boot: int, seed: int) -> np.ndarray:
    """The resampling plan every bootstrap here uses: draw b picks items idx[b] with replacement.

    One fresh generator per call (seeded), so a group's interval never depends on which
    other groups were computed before it.
    """
    rng = np.random.default_rng(seed)
    return rng.integers(0, n_items, size=(n_boot, n_items))


def bootstrap_weights(n_items: int, n_boot: int, seed: int) -> np.ndarray:
    """How many times each item appears in each draw of :func:`bootstrap_indices`: [n_boot, n]."""
    idx = bootstrap_indices(n_items, n_boot, seed)
    flat = (idx + (np.arange(n_boot) * n_items)[:, None]).ravel()
    return np.bincount(flat, minlength=n_boot * n_items).reshape(n_boot, n_items).astype(np.float64)


def quantile_interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    """Percentile interval of bootstrap replicates (NaN replicates ignored)."""
    s = np.asarray(samples, dtype=np.float64)
    s = s[np.isfinite(s)]
    if s.size == 0:
        return float("nan"), float("nan")
    tail = (1.0 - level) / 2.0
    return float(np.quantile(s, tail)), float(np.quantile(s, 1.0 - tail))


def group_items(frame: pd.DataFrame, by: Sequence[str]) -> list[tuple[dict[str, Any], np.ndarray]]:
    """(group key dict, row positions) per group, sorted by key; by=() gives one group."""
    by = list(by)
    if not by:
        return [({}, np.arange(len(frame)))]
    if len(frame) == 0:
        return []
    out = []
    for key, idx in frame.groupby(by, sort=True, dropna=False).indices.items():
        key = key if isinstance(key, tuple) else (key,)
        out.append((dict(zip(by, key, strict=True)), np.asarray(idx)))
    return out


def mode_of_rows(
    frame: pd.DataFrame, runs: FrameLike | Mapping[str, str] | None, mode: str | None
) -> np.ndarray:
    """Verify mode per row: explicit ``mode`` > runs table > a ``mode`` column > 'compact'.

    Unknown defaults to compact because the compact censoring rule is never wrong, only
    conservative (it drops what cap-accept could have labelled).
    """
    n = len(frame)
    if mode is not None:
        return np.full(n, mode, dtype=object)
    lookup: dict[str, str] = {}
    if isinstance(runs, Mapping):
        lookup = {str(k): str(v) for k, v in runs.items()}
    elif runs is not None:
        rf = as_frame(runs)
        if len(rf) and "run_id" in rf.columns and "mode" in rf.columns:
            lookup = {
                str(r): str(m)
                for r, m in zip(rf["run_id"], rf["mode"], strict=True)
                if not is_missing(m)
            }
    if lookup:
        run = text_column(frame, "run_id", "")
        return np.array([lookup.get(r, "compact") for r in run], dtype=object)
    if "mode" in frame.columns:
        return text_column(frame, "mode", "compact")
    return np.full(n, "compact", dtype=object)


def jsonable(value: Any) -> Any:
    """Turn frames, numpy scalars and NaN into plain JSON values (NaN/inf -> null)."""
    if isinstance(value, pd.DataFrame):
        return [jsonable(r) for r in value.to_dict(orient="records")]
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return [jsonable(v) for v in value.tolist()]
    if isinstance(value, np.bool_ | bool):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        f = float(value)
        return f if math.isfinite(f) else None
    if value is pd.NA or value is None:
        return None
    return value


def markdown_table(frame: pd.DataFrame, floatfmt: str = ".3f") -> str:
    """A GitHub-flavoured Markdown table (pandas' to_markdown needs tabulate, not a dependency)."""
    if frame is None or len(frame.columns) == 0:
        return "_(empty)_"
    cols = [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(" --- " for _ in cols) + "|"]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(format_cell(v, floatfmt) for v in row) + " |")
    if len(frame) == 0:
        lines.append("| " + " | ".join("" for _ in cols) + " |")
    return "\n".join(lines)


def format_cell(value: Any, floatfmt: str = ".3f") -> str:
    if isinstance(value, bool | np.bool_):
        return "yes" if value else "no"
    if is_missing(value):
        return "-"
    if isinstance(value, float | np.floating):
        return format(float(value), floatfmt)
    return str(value).replace("|", "\\|")
