"""The Compare page: two runs side by side, every headline metric with B - A and a bootstrap
interval over requests; the store's workload summary of both; runs stored by ``bench``."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

from dashboards.streamlit import rollups
from dashboards.streamlit.queries.shared import (
    HIDDEN_CEILING,
    Filters,
    ceiling_source,
    frame,
    runs,
    select,
)
from dspark_obs.store import Store

__all__ = [
    "CEILING_METRICS",
    "COMPARE_METRICS",
    "bench_runs",
    "compare_runs",
    "workload_summary",
]


def _request_buckets(store: Store, run_id: str, workloads: tuple[str, ...]) -> pd.DataFrame:
    """One run's requests in rollups.BUCKETS buckets (hash of the rid), summed per bucket.

    Resampling buckets of whole requests is the request bootstrap with the requests
    pre-grouped at random: the same expected variance, and a cost independent of the run's
    size. "requests" counts finished requests; the step sums include running ones.
    """
    f = Filters(runs=(run_id,), workloads=workloads)
    all_runs = runs(store)
    steps = select(rollups.partials(store, "req_buckets"), f, all_runs)
    reqs = select(rollups.partials(store, "request_buckets"), f, all_runs)
    cols = ["steps", "committed", "ceiling", "verified"]
    both = (
        steps.groupby("bucket")[cols]
        .sum()
        .join(
            reqs.groupby("bucket")[["requests", "ttft_sum", "ttft_n", "tpot_sum", "tpot_n"]].sum(),
            how="outer",
        )
    )
    return both.fillna(0.0).reset_index()


# metrics that need a measured ceiling (NaN, never compared, for a compact run)
CEILING_METRICS = ("mean ceiling (ceiling / step)", "utilization (committed / ceiling)")
# metric -> (numerator, denominator) bucket columns: every metric is a ratio of sums
COMPARE_METRICS: dict[str, tuple[str, str]] = {
    "accept length (committed / step)": ("committed", "steps"),
    "mean window (verified / step)": ("verified", "steps"),
    "mean ceiling (ceiling / step)": ("ceiling", "steps"),
    "utilization (committed / ceiling)": ("committed", "ceiling"),
    "TTFT s (mean over requests)": ("ttft_sum", "ttft_n"),
    "TPOT s (mean over requests)": ("tpot_sum", "tpot_n"),
}


def _boot_ratios(buckets: pd.DataFrame, w: np.ndarray) -> dict[str, np.ndarray]:
    """Every metric under bucket weights w [n_boot, n_buckets] (one matrix product)."""
    cols = sorted({c for pair in COMPARE_METRICS.values() for c in pair})
    sums = w @ buckets[cols].to_numpy(dtype=np.float64)
    at = {c: sums[:, i] for i, c in enumerate(cols)}
    with np.errstate(invalid="ignore", divide="ignore"):
        return {m: at[n] / at[d] for m, (n, d) in COMPARE_METRICS.items()}


def compare_runs(
    store: Store,
    run_a: str,
    run_b: str,
    workloads: tuple[str, ...] = (),
    n_boot: int = 400,
    seed: int = 0,
    level: float = 0.95,
) -> pd.DataFrame:
    """Every headline metric of two runs, B - A, with a bootstrap interval over requests.

    Requests of each run are resampled independently (Poisson weights on request buckets),
    so the interval of the difference covers the request-to-request variation of both runs.
    A run whose ceiling is hidden (compact) has no mean ceiling and no utilization: those
    rows are NaN with the reason in ``note``, and no difference is computed for them.
    """
    modes = dict(zip(*(runs(store)[c] for c in ("run_id", "mode")), strict=True))
    hidden = {r: ceiling_source(modes.get(r)) for r in (run_a, run_b)}
    a = _request_buckets(store, run_a, workloads)
    b = _request_buckets(store, run_b, workloads)
    rng = np.random.default_rng(seed)
    point_a = _boot_ratios(a, np.ones((1, len(a))))
    point_b = _boot_ratios(b, np.ones((1, len(b))))
    boot_a = _boot_ratios(a, rng.poisson(1.0, size=(n_boot, len(a))).astype(np.float64))
    boot_b = _boot_ratios(b, rng.poisson(1.0, size=(n_boot, len(b))).astype(np.float64))
    lo_q, hi_q = (1 - level) / 2, 1 - (1 - level) / 2
    rows = []
    for name in COMPARE_METRICS:
        va = float(point_a[name][0]) if len(a) else np.nan
        vb = float(point_b[name][0]) if len(b) else np.nan
        note = ""
        if name in CEILING_METRICS:
            unknown = [f"{r}: ceiling {src}" + (" (compact: its estimate or companion is on "
                       "the Ceiling page)" if src == HIDDEN_CEILING else "")
                       for r, src in hidden.items() if src != "measured"]  # fmt: skip
            if hidden[run_a] != "measured":
                va = np.nan
            if hidden[run_b] != "measured":
                vb = np.nan
            note = "; ".join(unknown)
        lo = hi = np.nan
        diff = boot_b[name] - boot_a[name] if len(a) and len(b) else np.array([])
        diff = diff[np.isfinite(diff)] if np.isfinite(va) and np.isfinite(vb) else diff[:0]
        if diff.size:
            lo, hi = (float(x) for x in np.quantile(diff, [lo_q, hi_q]))
        rows.append({"metric": name, "a": va, "b": vb, "diff": vb - va, "diff_lo": lo,
                     "diff_hi": hi, "note": note})  # fmt: skip
    na, nb = float(a["requests"].sum()), float(b["requests"].sum())
    rows.append(
        {"metric": "requests", "a": na, "b": nb, "diff": nb - na, "diff_lo": np.nan,
         "diff_hi": np.nan, "note": ""}
    )  # fmt: skip
    return pd.DataFrame(rows)


def workload_summary(
    store: Store, run_ids: tuple[str, ...], workloads: tuple[str, ...] = ()
) -> pd.DataFrame:
    """The store's ``workload_summary`` view for some runs (and workloads), as it stands.

    The view is the one definition of the per-workload figures (a compact run's ceiling
    columns NULL, ``ceiling_source`` hidden); the filter on ``run_id`` reaches the runs' own
    partitions, so the cost is that of the runs asked for, not of the store.
    """
    where = Filters(runs=run_ids, workloads=workloads).where()
    return frame(store, f"FROM workload_summary WHERE {where} ORDER BY run_id, workload")


def bench_runs(store: Store) -> pd.DataFrame:
    """Runs stored by ``dspark-obs bench`` (source bench): the summary its config holds."""
    rows = store.query(
        "SELECT run_id, mode, model, started_at, config FROM runs WHERE source = 'bench' "
        "ORDER BY started_at DESC NULLS LAST"
    ).to_pylist()
    out = []
    for r in rows:
        try:
            cfg = json.loads(r.pop("config") or "{}")
        except json.JSONDecodeError:
            cfg = {}
        summ = cfg.get("summary") or {}

        def dist(name: str, key: str, summ: dict = summ) -> Any:
            value = summ.get(name)
            return value.get(key) if isinstance(value, dict) else None

        out.append(
            {
                **r,
                "url": cfg.get("url"),
                "completed": summ.get("completed"),
                "failed": summ.get("failed"),
                "output_tok_per_s": summ.get("output_throughput"),
                "ttft_median_ms": dist("ttft_ms", "median"),
                "ttft_p99_ms": dist("ttft_ms", "p99"),
                "tpot_median_ms": dist("tpot_ms", "median"),
                "accept_length": summ.get("accept_length_pooled"),
            }
        )
    cols = ["run_id", "mode", "model", "started_at", "url", "completed", "failed",
            "output_tok_per_s", "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms",
            "accept_length"]  # fmt: skip
    return pd.DataFrame(out, columns=cols)
