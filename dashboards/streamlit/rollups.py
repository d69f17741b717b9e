"""Per-segment rollups: the dashboard's all-runs aggregates without rescanning the store.

Why: the store is a directory of immutable Parquet segments (a segment never changes once
renamed into place; compaction writes new files and retires old ones). So a small partial
aggregate of each segment, computed once, stays true forever: a page rerun only aggregates
the segments that appeared since the last one, and then adds up a few hundred tiny frames.
Over 10 million req-step rows a full-store query then costs milliseconds instead of a scan
(bench/bench_dashboard_queries.py measures both).

Partials are sums and counts (decomposable); latency quantiles are not here: the pages read
exact ones from the requests table (queries.exact_latency), never a binned estimate. Segments
that vanished (compacted) drop out of the cache on the next listing. Each segment is read through
``Store.query`` (read-only, confined to the store).
"""

from __future__ import annotations

import glob
import threading
from pathlib import Path

import pandas as pd

from dspark_obs.store import Store
from dspark_obs.store.layout import PLACEHOLDER_DIR, segment_glob

__all__ = ["BUCKETS", "partials"]

BUCKETS = 200  # request buckets for bootstrap intervals (whole requests, hash of the rid)

# table -> SQL over one segment ({src}); every column is a sum, count, min, max or xor
_PARTIAL_SQL = {
    "runs": """
        SELECT run_id, mode, source, model, workload, gamma, temperature, started_at,
               companion_of
        FROM {src}""",
    "req_steps": """
        SELECT run_id, coalesce(workload, 'unknown') AS workload, verify_len,
               count(*) AS n, sum(acc_len)::BIGINT AS committed,
               sum(acc_len + coalesce(cap_trim, 0))::BIGINT AS ceiling, max(ts) AS last_ts
        FROM {src} GROUP BY ALL""",
    "requests": """
        SELECT run_id, coalesce(workload, 'unknown') AS workload, count(*) AS n,
               sum(completion_tokens)::BIGINT AS tokens, min(arrival_time) AS t0,
               max(finish_time) AS t1, bit_xor(hash(rid, output_tokens)) AS out_hash
        FROM {src} GROUP BY ALL""",
    # bootstrap buckets of requests (hash of the rid): the Compare page's intervals
    "req_buckets": f"""
        SELECT run_id, coalesce(workload, 'unknown') AS workload,
               hash(rid) % {BUCKETS} AS bucket, count(*)::DOUBLE AS steps,
               sum(acc_len)::DOUBLE AS committed,
               sum(acc_len + coalesce(cap_trim, 0))::DOUBLE AS ceiling,
               sum(verify_len)::DOUBLE AS verified
        FROM {{src}} GROUP BY ALL""",
    "request_buckets": f"""
        SELECT run_id, coalesce(workload, 'unknown') AS workload,
               hash(rid) % {BUCKETS} AS bucket, count(*) AS requests,
               coalesce(sum(ttft), 0) AS ttft_sum, count(ttft)::DOUBLE AS ttft_n,
               coalesce(sum(tpot), 0) AS tpot_sum, count(tpot)::DOUBLE AS tpot_n
        FROM (SELECT *, first_token_time - arrival_time AS ttft,
                     CASE WHEN completion_tokens > 1 THEN (finish_time - first_token_time)
                          / (completion_tokens - 1) END AS tpot
              FROM {{src}})
        GROUP BY ALL""",
    "steps": """
        SELECT run_id, bs, num_verify_tokens, count(*) AS steps_all,
               count(*) FILTER (WHERE ok) AS n,
               sum(predicted_step_ms) FILTER (WHERE ok) AS predicted,
               sum(m) FILTER (WHERE ok) AS measured
        FROM (SELECT *, coalesce(nullif(step_gpu_ms, -1), step_cpu_ms) AS m,
                     coalesce(predicted_step_ms >= 0 AND m IS NOT NULL, false) AS ok
              FROM {src})
        GROUP BY ALL""",
}
_SOURCE_TABLE = {  # kind -> the table whose segments it summarizes
    "runs": "runs",
    "req_steps": "req_steps",
    "req_buckets": "req_steps",
    "requests": "requests",
    "request_buckets": "requests",
    "steps": "steps",
}

_lock = threading.Lock()
_cache: dict[tuple[str, str], dict[str, pd.DataFrame]] = {}  # (root, kind) -> path -> partial
_joined: dict[tuple[str, str], tuple[tuple[str, ...], pd.DataFrame]] = {}  # last concatenation


def _segments(root: Path, table: str) -> list[str]:
    return sorted(p for p in glob.glob(segment_glob(root, table)) if PLACEHOLDER_DIR not in p)


def _read(store: Store, kind: str, path: str) -> pd.DataFrame:
    quoted = "'" + path.replace("'", "''") + "'"
    src = f"read_parquet({quoted}, hive_partitioning = true, hive_types = {{'run_id': VARCHAR}})"
    return store.query(_PARTIAL_SQL[kind].format(src=src)).to_pandas()


def partials(store: Store, kind: str) -> pd.DataFrame:
    """The partial aggregates of every current segment of ``kind``'s table, concatenated.

    kind: runs | req_steps | req_buckets | requests | request_buckets | steps. New segments
    are read once; segments that vanished between two listings (compaction, or renamed away
    mid-listing) are skipped.
    """
    root = Path(store.root).resolve()
    paths = _segments(root, _SOURCE_TABLE[kind])
    key = (str(root), kind)
    with _lock:
        known = dict(_cache.get(key, {}))
        last = _joined.get(key)
    if last is not None and last[0] == tuple(paths):
        return last[1]  # nothing new since the last call
    fresh = {}
    for p in paths:
        if p in known:
            fresh[p] = known[p]
            continue
        try:
            fresh[p] = _read(store, kind, p)
        except Exception as exc:  # a segment compacted away between glob and read
            if Path(p).exists():
                raise
            del exc
    with _lock:
        _cache[key] = fresh  # vanished segments drop out here
    frames = [f for f in fresh.values() if len(f)]
    out = (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(columns=_columns(store, kind))
    )
    with _lock:
        _joined[key] = (tuple(fresh), out)
    return out


def _columns(store: Store, kind: str) -> list[str]:
    sql = _PARTIAL_SQL[kind].format(src=_SOURCE_TABLE[kind]) + " LIMIT 0"
    return store.query(sql).schema.names
