"""Which rows of a batch are new: a key (``schema.KEYS``) is stored at most once.

A batch is first reduced to the first row of each key (vectorized), then rows whose key a
partition already stores are dropped. Step-keyed tables (``forward_ct`` in the key) find the
stored keys through each segment's per-rank forward_ct ranges (kept in its footer under
:data:`RANGES_KEY`) and its row-group statistics, so a batch of new steps costs no read at
all and an overlapping one reads only the key columns of the row groups it overlaps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = [
    "RANGES_KEY",
    "anti_join",
    "dedupe_in_batch",
    "merge_ranges",
    "read_keys",
    "step_ranges",
]

RANGES_KEY = b"dspark_obs.fct_ranges"  # footer metadata: {dp_rank: [min_fct, max_fct]}
DP_SHIFT = 40  # (dp_rank << 40) | forward_ct packs a step key into one int64


def step_ranges(batch: pa.Table) -> dict[int, tuple[int, int]]:
    """Per dp_rank: (min, max) forward_ct of the batch."""
    if batch.num_rows == 0:  # a valid empty segment
        return {}
    dp = batch.column("dp_rank").to_numpy()
    fct = batch.column("forward_ct").to_numpy()
    if dp.min() == dp.max():
        return {int(dp[0]): (int(fct.min()), int(fct.max()))}
    out = {}
    for d in np.unique(dp):
        f = fct[dp == d]
        out[int(d)] = (int(f.min()), int(f.max()))
    return out


def dedupe_in_batch(batch: pa.Table, key_cols: tuple[str, ...]) -> pa.Table:
    """Keep the first row of each key (vectorized; no per-row Python)."""
    n = batch.num_rows
    if n <= 1:
        return batch
    if not key_cols:
        return batch.slice(0, 1)
    if "forward_ct" in key_cols:
        dp = batch.column("dp_rank").to_numpy().astype(np.int64)
        fct = batch.column("forward_ct").to_numpy()
        packable = dp.min() >= 0 and dp.max() < (1 << 22)
        if packable and fct.min() >= 0 and fct.max() < (1 << DP_SHIFT):
            step = (dp << DP_SHIFT) | fct
            diff = np.diff(step)
            if "rid" not in key_cols:
                if (diff > 0).all():
                    return batch
                key = step
            else:
                rid = pc.dictionary_encode(batch.column("rid").combine_chunks())
                codes = rid.indices.to_numpy().astype(np.int64)
                # Number the steps 0..G-1 (cheap when sorted), then (step, rid) fits one int64.
                if (diff >= 0).all():
                    group = np.concatenate(([0], np.cumsum(diff != 0)))
                else:
                    group = pd.factorize(step)[0].astype(np.int64)
                key = group * len(rid.dictionary) + codes
            dup = pd.Index(key).duplicated(keep="first")
            return batch.filter(pa.array(~dup)) if dup.any() else batch
    # General (small tables, odd values): hash group-by on the key columns.
    idx = pa.array(np.arange(n, dtype=np.int64))
    first = (
        batch.select(list(key_cols))
        .append_column("__i", idx)
        .group_by(list(key_cols), use_threads=False)
        .aggregate([("__i", "min")])
        .column("__i_min")
        .to_numpy()
    )
    if len(first) == n:
        return batch
    return batch.take(pa.array(np.sort(first)))


def anti_join(batch: pa.Table, stored: pa.Table, key_cols: tuple[str, ...]) -> pa.Table:
    """Rows of ``batch`` whose key is not in ``stored`` (batch order kept)."""
    cols = list(key_cols)
    left = batch.select(cols).append_column("__i", pa.array(np.arange(batch.num_rows)))
    right = stored.select(cols).cast(left.select(cols).schema)
    keep = left.join(right, keys=cols, join_type="left anti").column("__i").to_numpy()
    if len(keep) == batch.num_rows:
        return batch
    return batch.take(pa.array(np.sort(keep)))


def merge_ranges(all_ranges: list[dict[int, tuple[int, int]]]) -> dict[int, tuple[int, int]]:
    out: dict[int, tuple[int, int]] = {}
    for ranges in all_ranges:
        for d, (lo, hi) in ranges.items():
            a, b = out.get(d, (lo, hi))
            out[d] = (min(a, lo), max(b, hi))
    return out


def read_keys(
    paths: list[Path], ranges: dict[int, tuple[int, int]], key_cols: tuple[str, ...]
) -> pa.Table:
    """Key columns of the row groups whose (dp_rank, forward_ct) statistics overlap ``ranges``
    (a compacted segment is read a row group at a time, not whole).

    Those row groups are decoded whole, every column: a replayed row is dropped as stored only
    when its stored copy reads back, since damage in a non-key page would otherwise surface at
    compaction, after the replayed copy was already dropped (its row lost)."""
    parts = []
    for path in paths:
        pf = pq.ParquetFile(path)
        md = pf.metadata
        leaf = {md.schema.column(i).path: i for i in range(md.num_columns)}
        groups = []
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            fs, ds = rg.column(leaf["forward_ct"]).statistics, rg.column(leaf["dp_rank"]).statistics
            if fs is None or ds is None or not (fs.has_min_max and ds.has_min_max):
                groups.append(g)
                continue
            if any(
                ds.min <= d <= ds.max and fs.min <= hi and lo <= fs.max
                for d, (lo, hi) in ranges.items()
            ):
                groups.append(g)
        if groups:
            parts.append(pf.read_row_groups(groups).select(list(key_cols)))
    if not parts:
        return pa.table({c: pa.array([], pa.int64()) for c in key_cols})
    return pa.concat_tables(parts, promote_options="permissive")
