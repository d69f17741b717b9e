"""Per-segment rollups: the dashboard's all-runs aggregates without rescanning the store.

Why: the store is a directory of immutable Parquet segments (a segment never changes once
renamed into place; compaction writes new files and retires old ones). So a small partial
aggregate of each segment, computed once, stays true forever: a page rerun only aggregates
the segments that appeared since the last one, and then adds up a few hundred tiny frames.
Over 10 million req-step rows a full-store query then costs milliseconds instead of a scan
(bench/bench_dashboard_queries.py measures both).

Partials are sums and counts (decomposable); latency quantiles are not here: the pages read
exact ones from the requests table (queries.exact_latency), never a binned estimate. The
segments come from the store's own listing (``Store.segments``: the one file-acceptance rule
of every read path), so a damaged or foreign file is left out and named, as ``query`` does:
a StoreWarning, and the frame's ``attrs["skipped"]``. Each segment is read through
``Store.query_segment`` (read-only, confined to the store); segments that vanished
(compacted) drop out of the cache on the next listing.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pandas as pd

from dspark_obs.store import Store, StoreWarning
from dspark_obs.store.segments import Skipped, summary

__all__ = ["BUCKETS", "partials"]

BUCKETS = 200  # request buckets for bootstrap intervals (whole requests, hash of the rid)

# table -> SQL over one segment ({src}); every column is a sum, count, min, max or xor
_PARTIAL_SQL = {
    "runs": """
        SELECT run_id, mode, source, model, workload, gamma, temperature, started_at,
               companion_of
        FROM {segment}""",
    "req_steps": """
        SELECT run_id, coalesce(workload, 'unknown') AS workload, verify_len,
               count(*) AS n, sum(acc_len)::BIGINT AS committed,
               sum(acc_len + coalesce(cap_trim, 0))::BIGINT AS ceiling, max(ts) AS last_ts
        FROM {segment} GROUP BY ALL""",
    "requests": """
        SELECT run_id, coalesce(workload, 'unknown') AS workload, count(*) AS n,
               sum(completion_tokens)::BIGINT AS tokens, min(arrival_time) AS t0,
               max(finish_time) AS t1, bit_xor(hash(rid, output_tokens)) AS out_hash
        FROM {segment} GROUP BY ALL""",
    # bootstrap buckets of requests (hash of the rid): the Compare page's intervals
    "req_buckets": f"""
        SELECT run_id, coalesce(workload, 'unknown') AS workload,
               hash(rid) % {BUCKETS} AS bucket, count(*)::DOUBLE AS steps,
               sum(acc_len)::DOUBLE AS committed,
               sum(acc_len + coalesce(cap_trim, 0))::DOUBLE AS ceiling,
               sum(verify_len)::DOUBLE AS verified
        FROM {{segment}} GROUP BY ALL""",
    "request_buckets": f"""
        SELECT run_id, coalesce(workload, 'unknown') AS workload,
               hash(rid) % {BUCKETS} AS bucket, count(*) AS requests,
               coalesce(sum(ttft), 0) AS ttft_sum, count(ttft)::DOUBLE AS ttft_n,
               coalesce(sum(tpot), 0) AS tpot_sum, count(tpot)::DOUBLE AS tpot_n
        FROM (SELECT *, first_token_time - arrival_time AS ttft,
                     CASE WHEN completion_tokens > 1 THEN (finish_time - first_token_time)
                          / (completion_tokens - 1) END AS tpot
              FROM {{segment}})
        GROUP BY ALL""",
    "steps": """
        SELECT run_id, bs, num_verify_tokens, count(*) AS steps_all,
               count(*) FILTER (WHERE ok) AS n,
               sum(predicted_step_ms) FILTER (WHERE ok) AS predicted,
               sum(m) FILTER (WHERE ok) AS measured
        FROM (SELECT *, coalesce(nullif(step_gpu_ms, -1), step_cpu_ms) AS m,
                     coalesce(predicted_step_ms >= 0 AND m IS NOT NULL, false) AS ok
              FROM {segment})
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


def partials(store: Store, kind: str) -> pd.DataFrame:
    """The partial aggregates of every current segment of ``kind``'s table, concatenated.

    kind: runs | req_steps | req_buckets | requests | request_buckets | steps. New segments
    are read once; segments that vanished between two listings (compaction) are skipped.
    Files the store's acceptance rule leaves out are named in a StoreWarning and listed in
    the result's ``attrs["skipped"]`` (:class:`~dspark_obs.store.segments.Skipped`).
    """
    root = Path(store.root).resolve()
    table = _SOURCE_TABLE[kind]
    listing = store.segments(table)
    paths = sorted(listing.files)
    key = (str(root), kind)
    with _lock:
        known = dict(_cache.get(key, {}))
        last = _joined.get(key)
    if last is not None and last[0] == tuple(paths):
        return _named(last[1], listing.skipped)  # nothing new since the last call
    fresh = {}
    for p in paths:
        if p in known:
            fresh[p] = known[p]
            continue
        part = store.query_segment(table, p, _PARTIAL_SQL[kind])
        if part is not None:  # None: compacted away (or found damaged) since the listing
            fresh[p] = part.to_pandas()
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
    return _named(out, listing.skipped)


def _named(frame: pd.DataFrame, skipped: tuple[Skipped, ...]) -> pd.DataFrame:
    """The frame with what was left out attached (and warned about); a copy when anything
    was, so the cached frame never carries a stale list."""
    if not skipped:
        if frame.attrs.get("skipped"):
            frame = frame.copy()
            frame.attrs["skipped"] = ()
        return frame
    warnings.warn(summary(skipped), StoreWarning, stacklevel=3)
    frame = frame.copy()
    frame.attrs["skipped"] = skipped
    return frame


def _columns(store: Store, kind: str) -> list[str]:
    sql = _PARTIAL_SQL[kind].format(segment=_SOURCE_TABLE[kind]) + " LIMIT 0"
    return store.query(sql).schema.names
