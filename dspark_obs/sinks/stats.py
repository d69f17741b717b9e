"""Running totals of every catalog metric, updated once per record batch with array code.

Plain stats, no exporter: the Prometheus collector and the OpenTelemetry callbacks read the
same :class:`Totals`. Each batch costs a few ``np.bincount`` calls over its rows plus a loop
over its distinct label sets (bounded), never a Python loop per row. The one per-request
step is the block-accept estimator of ``compact`` runs, run over a request's rows when the
request finishes (its censored blocks resolve at later steps of the same request).

Censoring follows DESIGN.md (and :func:`dspark_obs.analytics.calibration.wide_labels`): in
``compact`` a position past a fully accepted window is unobserved and counts neither as an
acceptance nor as a rejection; ``cap-accept`` labels every position with
correct_drafts + cap_trim.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dspark_obs.sinks.catalog import (
    CALIBRATION_BINS,
    DEFAULT_MAX_GAMMA,
    METRICS,
    Metric,
    token_buckets,
)
from dspark_obs.validation import RecordError

if TYPE_CHECKING:  # imported where used: the estimator's modules are not light
    from dspark_obs.analytics.estimator_live import RunTail

__all__ = ["Aggregator", "RunInfo", "Totals", "reason_label"]

EPS_PROB = 1e-8
_UNKNOWN = "unknown"
_MAX_WAITING_BATCHES = 256  # batches of a run whose runs row has not arrived yet
# running sums kept per unfinished request
OPEN_SUMS = ("steps", "committed", "verified", "exact_steps", "ceiling", "conf_sum", "conf_n")


@dataclass(frozen=True)
class RunInfo:
    """What a run contributes to labels (from its ``runs`` row)."""

    model: str
    mode: str
    workload: str
    gamma: int
    source: str
    server_address: str | None = None  # the server a collected run came from (config "url")
    server_port: int | None = None


def server_of(config: str | None) -> tuple[str | None, int | None]:
    """(host, port) of the ``url`` a runs row's config names (SGLang collector), else Nones."""
    try:
        url = json.loads(config).get("url") if config else None
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        if parts is None or not parts.hostname:
            return None, None
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except (ValueError, AttributeError):
        return None, None
    return parts.hostname, port


class Totals:
    """Counter values and histogram buckets keyed by (metric name, label values)."""

    def __init__(self, max_gamma: int = DEFAULT_MAX_GAMMA) -> None:
        self.metrics: dict[str, Metric] = {m.name: m for m in METRICS}
        self.buckets: dict[str, np.ndarray] = {
            m.name: np.asarray(m.buckets or token_buckets(max_gamma), dtype=np.float64)
            for m in METRICS
            if m.kind == "histogram"
        }
        self.counters: dict[str, dict[tuple[str, ...], float]] = {
            m.name: {} for m in METRICS if m.kind == "counter"
        }
        # per histogram: labels -> (counts per bucket incl. +Inf, non-cumulative; sum)
        self.histograms: dict[str, dict[tuple[str, ...], list]] = {n: {} for n in self.buckets}

    def add(self, name: str, codes: np.ndarray, keys: Sequence[tuple], weights=None) -> None:
        """Add per-group sums of ``weights`` (1 per row when None) to a counter."""
        if codes.size == 0:
            return
        sums = np.bincount(codes, weights=weights, minlength=len(keys))
        present = np.bincount(codes, minlength=len(keys)) > 0  # a series exists, even at 0
        series = self.counters[name]
        for g in np.flatnonzero(present).tolist():
            series[keys[g]] = series.get(keys[g], 0.0) + float(sums[g])

    def add_flat(self, name: str, flat: np.ndarray, keys: Sequence[tuple], extra: Sequence,
                 weights=None) -> None:  # fmt: skip
        """Counters with extra labels: ``flat`` = group * len(extra) + extra index."""
        if flat.size == 0:
            return
        width = len(extra)
        sums = np.bincount(flat, weights=weights, minlength=len(keys) * width)
        present = np.bincount(flat, minlength=len(keys) * width)
        series = self.counters[name]
        for i in np.flatnonzero(present).tolist():
            key = (*keys[i // width], *extra[i % width])
            series[key] = series.get(key, 0.0) + float(sums[i])

    def observe(self, name: str, codes: np.ndarray, keys: Sequence[tuple], values) -> None:
        """Observe one value per row into a histogram, vectorized per batch."""
        values = np.asarray(values, dtype=np.float64)
        ok = np.isfinite(values)
        codes, values = codes[ok], values[ok]
        if codes.size == 0:
            return
        edges = self.buckets[name]
        nb = edges.size + 1
        idx = np.searchsorted(edges, values, side="left")  # first le >= value
        counts = np.bincount(codes * nb + idx, minlength=len(keys) * nb).reshape(-1, nb)
        sums = np.bincount(codes, weights=values, minlength=len(keys))
        series = self.histograms[name]
        for g in np.flatnonzero(counts.sum(axis=1)).tolist():
            cur = series.get(keys[g])
            if cur is None:
                series[keys[g]] = [counts[g].astype(np.float64), float(sums[g])]
            else:
                cur[0] += counts[g]
                cur[1] += float(sums[g])

    def counter_value(self, name: str, **labels: str) -> float:
        """Sum of a counter over every series matching the given labels (tests, summaries)."""
        names = self.metrics[name].labels
        total = 0.0
        for key, v in self.counters[name].items():
            d = dict(zip(names, key, strict=True))
            if all(d.get(k) == str(x) for k, x in labels.items()):
                total += v
        return total

    def copy(self) -> Totals:
        out = Totals.__new__(Totals)
        out.metrics, out.buckets = self.metrics, self.buckets
        out.counters = {n: dict(s) for n, s in self.counters.items()}
        out.histograms = {
            n: {k: [v[0].copy(), v[1]] for k, v in s.items()} for n, s in self.histograms.items()
        }
        return out


def reason_label(error: RecordError) -> str:
    """A bounded reason label: field and the message up to its first colon (no values)."""
    return f"{error.field}: {error.reason.split(':')[0]}"[:120]


def _groups(columns: Sequence[np.ndarray]) -> tuple[np.ndarray, list[tuple[str, ...]]]:
    """Integer group code per row and the label tuple of each code (labels as strings)."""
    n = len(columns[0]) if columns else 0
    if n == 0:
        return np.zeros(0, dtype=np.int64), []
    uniques, combined = [], np.zeros(n, dtype=np.int64)
    for col in columns:
        u, inv = np.unique(np.asarray(col).astype(str), return_inverse=True)
        uniques.append(u)
        combined = combined * len(u) + inv.ravel()
    present, codes = np.unique(combined, return_inverse=True)
    keys = []
    for c in present.tolist():
        parts = []
        for u in reversed(uniques):
            c, i = divmod(c, len(u))
            parts.append(str(u[i]))
        keys.append(tuple(reversed(parts)))
    return codes.ravel().astype(np.int64), keys


def _np(col: pa.ChunkedArray, fill) -> np.ndarray:
    if isinstance(fill, float) and not pa.types.is_floating(col.type):
        col = col.cast(pa.float64())  # NaN for null needs a float column
    return pc.fill_null(col, fill).to_numpy(zero_copy_only=False)


def _text(col: pa.ChunkedArray, fill: str) -> np.ndarray:
    return np.asarray(pc.fill_null(col.cast(pa.string()), fill).to_numpy(zero_copy_only=False))


def _list_matrix(col: pa.ChunkedArray, width: int) -> np.ndarray:
    """A list<float> column as [n, width] float64; null rows and missing cells NaN."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    n = len(arr)
    out = np.full((n, width), np.nan)
    if n == 0 or width == 0:
        return out
    lengths = _np(pc.list_value_length(arr), 0).astype(np.int64)
    flat = pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(np.float64)
    rows = np.repeat(np.arange(n), lengths)
    starts = np.cumsum(lengths) - lengths
    cols = np.arange(flat.size) - np.repeat(starts, lengths)
    keep = cols < width
    out[rows[keep], cols[keep]] = flat[keep]
    return out


def _runs_in_order(finished: Sequence[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """(run, its requests in finishing order) for each run, runs in first-seen order."""
    out: dict[str, list[str]] = {}
    for run, rid in finished:
        out.setdefault(run, []).append(rid)
    return list(out.items())


class Aggregator:
    """Feeds record batches into :class:`Totals`; thread-safe; read with :meth:`snapshot`.

    ``on_finished`` callbacks get a DataFrame of finished requests (one row each, with the
    request's step aggregates and estimated ceiling), e.g. for one OpenTelemetry span per
    request. They and the estimator sums run at most every ``finalize_interval_s`` (one
    estimator pass covers many requests) and on :meth:`finalize`.
    """

    def __init__(
        self,
        max_gamma: int = DEFAULT_MAX_GAMMA,
        estimator: bool = True,
        finalize_interval_s: float = 2.0,
    ) -> None:
        self.totals = Totals(max_gamma)
        self.runs: dict[str, RunInfo] = {}
        self.estimator = estimator
        self.on_finished: list[Callable[[pd.DataFrame], None]] = []
        self._lock = threading.Lock()
        self._waiting: dict[str, list[tuple[str, pa.Table]]] = {}
        self._open: dict[tuple[str, str], np.ndarray] = {}  # (run_id, rid) -> OPEN_SUMS
        self._compact_rows: list[pa.Table] = []  # req_steps of unfinished compact requests
        self._finished: list[tuple] = []  # finished requests awaiting the estimator pass
        self._tails: dict[str, RunTail] = {}  # run_id -> its estimator tail model state
        self.finalize_interval_s = finalize_interval_s
        self._last_finalize = time.monotonic()

    # ---------------------------------------------------------------- public

    def update(self, table: str, batch: pa.Table) -> None:
        """Add one validated batch of a schema table."""
        if batch.num_rows == 0:
            return
        with self._lock:
            if table == "runs":
                self._runs(batch)
                return
            run_ids = _text(batch.column("run_id"), "")
            known = np.isin(run_ids, list(self.runs)) if self.runs else np.zeros(len(run_ids), bool)
            if not known.all():
                self._wait(table, batch.filter(pa.array(~known)), run_ids[~known])
                batch = batch.filter(pa.array(known))
            if batch.num_rows:
                self._dispatch(table, batch)

    def reject(self, errors: Iterable[RecordError]) -> None:
        """Count rows refused by validation, by table and reason."""
        errors = list(errors)
        if not errors:
            return
        with self._lock:
            codes, keys = _groups(
                [np.array([e.table for e in errors]), np.array([reason_label(e) for e in errors])]
            )
            self.totals.add("dspark_records_rejected_total", codes, keys)

    def finalize(self) -> None:
        """Run the pending estimator pass and request callbacks now (flush, close, tests)."""
        with self._lock:
            self._finalize(force=True)

    def snapshot(self) -> Totals:
        """A consistent copy of every total (running the estimator pass first when due)."""
        with self._lock:
            self._finalize(force=False)
            return self.totals.copy()

    # ---------------------------------------------------------------- tables

    def _runs(self, batch: pa.Table) -> None:
        cols = {c: batch.column(c).to_pylist() for c in ("run_id", "model", "mode", "workload",
                                                          "gamma", "source", "config")}  # fmt: skip
        for i, run_id in enumerate(cols["run_id"]):
            self.runs[run_id] = RunInfo(
                model=cols["model"][i] or _UNKNOWN,
                mode=cols["mode"][i],
                workload=cols["workload"][i] or _UNKNOWN,
                gamma=int(cols["gamma"][i]),
                source=cols["source"][i],
                **dict(
                    zip(
                        ("server_address", "server_port"), server_of(cols["config"][i]), strict=True
                    )
                ),
            )
            for table, part in self._waiting.pop(run_id, []):
                self._dispatch(table, part)

    def _wait(self, table: str, batch: pa.Table, run_ids: np.ndarray) -> None:
        """Hold rows of runs not seen yet (their labels need the runs row)."""
        for run_id in np.unique(run_ids).tolist():
            part = batch.filter(pc.equal(batch.column("run_id"), run_id))
            queue = self._waiting.setdefault(run_id, [])
            queue.append((table, part))
            if len(queue) > _MAX_WAITING_BATCHES:  # no runs row coming: label it unknown
                self.runs[run_id] = RunInfo(_UNKNOWN, "compact", _UNKNOWN, 0, _UNKNOWN)
                for t, p in self._waiting.pop(run_id):
                    self._dispatch(t, p)

    def _dispatch(self, table: str, batch: pa.Table) -> None:
        if table == "steps":
            self._steps(batch)
        elif table == "req_steps":
            self._req_steps(batch)
        elif table == "requests":
            self._requests(batch)

    def _run_labels(self, run_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        uniq, inv = np.unique(run_ids, return_inverse=True)
        info = [self.runs[r] for r in uniq.tolist()]
        model = np.array([i.model for i in info], dtype=object)[inv]
        mode = np.array([i.mode for i in info], dtype=object)[inv]
        workload = np.array([i.workload for i in info], dtype=object)[inv]
        return model, mode, workload

    def _steps(self, b: pa.Table) -> None:
        t = self.totals
        model, mode, _ = self._run_labels(_text(b.column("run_id"), ""))
        codes, keys = _groups([model, mode, _np(b.column("dp_rank"), 0)])
        t.add("dspark_steps_total", codes, keys)
        bs = _np(b.column("bs"), -1).astype(np.float64)
        t.add("dspark_step_requests_total", codes, keys, np.maximum(bs, 0.0))
        budget = _np(b.column("budget"), -1).astype(np.float64)
        t.add("dspark_step_budget_tokens_total", codes, keys, np.maximum(budget, 0.0))
        gpu = _np(b.column("step_gpu_ms"), np.nan).astype(np.float64)
        cpu = _np(b.column("step_cpu_ms"), np.nan).astype(np.float64)
        measured = np.where(np.isfinite(gpu) & (gpu >= 0), gpu, cpu) / 1000.0
        t.observe("dspark_step_seconds", codes, keys, measured)
        pred = _np(b.column("predicted_step_ms"), np.nan).astype(np.float64) / 1000.0
        both = np.isfinite(pred) & np.isfinite(measured)
        c = codes[both]
        t.add("dspark_step_predicted_steps_total", c, keys)
        t.add("dspark_step_predicted_seconds_total", c, keys, pred[both])
        t.add("dspark_step_measured_seconds_total", c, keys, measured[both])
        t.add("dspark_step_prediction_abs_error_seconds_total", c, keys,
              np.abs(measured[both] - pred[both]))  # fmt: skip

    def _req_steps(self, b: pa.Table) -> None:
        t = self.totals
        run_id = _text(b.column("run_id"), "")
        model, mode, run_workload = self._run_labels(run_id)
        workload = _text(b.column("workload"), "")
        workload = np.where(workload == "", run_workload, workload)
        dp = _np(b.column("dp_rank"), 0)
        codes, keys = _groups([model, mode, workload, dp])

        g = _np(b.column("gamma"), 0).astype(np.int64)
        window = _np(b.column("verify_len"), 1).astype(np.int64)
        cd = _np(b.column("correct_drafts"), 0).astype(np.int64)
        acc = _np(b.column("acc_len"), 0).astype(np.float64)
        trim = _np(b.column("cap_trim"), 0).astype(np.int64)
        trim = np.maximum(trim, 0)
        v = window - 1  # drafts verified
        t.add("dspark_req_steps_total", codes, keys)
        t.add("dspark_committed_tokens_total", codes, keys, acc)
        t.add("dspark_verified_tokens_total", codes, keys, window.astype(np.float64))
        t.add("dspark_drafted_tokens_total", codes, keys, g.astype(np.float64))
        t.add("dspark_accepted_drafts_total", codes, keys, cd.astype(np.float64))
        t.add("dspark_spec_decode_num_drafts_total", codes, keys)
        t.add("dspark_spec_decode_num_draft_tokens_total", codes, keys, g.astype(np.float64))
        t.add("dspark_spec_decode_num_accepted_tokens_total", codes, keys, cd.astype(np.float64))
        t.observe("dspark_verify_window_tokens", codes, keys, window)
        t.observe("dspark_committed_per_step_tokens", codes, keys, acc)

        # positions: censoring-aware labels, as analytics.calibration.wide_labels
        width = int(g.max())
        pos = np.arange(1, width + 1)[None, :]
        valid = pos <= g[:, None]
        full_view = mode == "cap-accept"
        full = np.where(full_view, cd + trim, cd)
        seen = (cd[:, None] < v[:, None]) | (pos <= v[:, None])
        observed = valid & (full_view[:, None] | seen)
        accepted = observed & (pos <= full[:, None])
        censored = valid & ~observed
        labels = [(str(j),) for j in range(1, width + 1)]
        flat = codes[:, None] * width + (pos - 1)
        t.add_flat("dspark_position_drafted_total", flat[valid], keys, labels)
        t.add_flat("dspark_position_observed_total", flat[observed], keys, labels)
        t.add_flat("dspark_position_accepted_total", flat[observed], keys, labels,
                   accepted[observed].astype(np.float64))  # fmt: skip
        t.add_flat("dspark_position_censored_total", flat[valid], keys, labels,
                   censored[valid].astype(np.float64))  # fmt: skip
        t.add_flat("dspark_spec_decode_num_accepted_tokens_per_pos_total", flat[valid], keys,
                   labels, (pos <= cd[:, None])[valid].astype(np.float64))  # fmt: skip

        # calibration: S_j (or the running product of c_j) against the prefix label
        surv = _list_matrix(b.column("survival"), width)
        conf = _list_matrix(b.column("confidence"), width)
        with np.errstate(invalid="ignore"):
            surv = np.where(np.isnan(surv), np.cumprod(conf, axis=1), surv)
        scored = observed & np.isfinite(surv)
        p = np.clip(surv[scored], EPS_PROB, 1.0 - EPS_PROB)
        bins = np.clip((p * CALIBRATION_BINS).astype(np.int64), 0, CALIBRATION_BINS - 1)
        cal = flat[scored] * CALIBRATION_BINS + bins
        pb = [(str(j), str(k)) for j in range(1, width + 1) for k in range(CALIBRATION_BINS)]
        t.add_flat("dspark_calibration_observations_total", cal, keys, pb)
        t.add_flat("dspark_calibration_predicted_probability_total", cal, keys, pb, p)
        t.add_flat("dspark_calibration_accepted_total", cal, keys, pb,
                   accepted[scored].astype(np.float64))  # fmt: skip

        # ceiling: exact where the whole block was verified
        exact = (mode == "cap-accept") | (mode == "static")
        ce = codes[exact]
        ceiling = acc + trim
        t.add("dspark_ceiling_steps_total", ce, keys)
        t.add("dspark_ceiling_committed_tokens_total", ce, keys, acc[exact])
        t.add("dspark_ceiling_tokens_total", ce, keys, ceiling[exact])
        t.add("dspark_cap_trim_tokens_total", ce, keys, trim[exact].astype(np.float64))
        t.observe("dspark_ceiling_per_step_tokens", ce, keys, ceiling[exact])
        compact = mode == "compact"
        t.add("dspark_window_fully_accepted_total", codes[compact], keys,
              ((cd == v) & (v < g))[compact].astype(np.float64))  # fmt: skip

        # per-request running sums (request accept length, spans): one loop per request
        valid_conf = valid & np.isfinite(conf)
        per_row = np.column_stack(
            [
                np.ones(len(acc)),
                acc,
                window.astype(np.float64),
                exact.astype(np.float64),
                np.where(exact, ceiling, 0.0),
                np.where(valid_conf, conf, 0.0).sum(axis=1),
                valid_conf.sum(axis=1).astype(np.float64),
            ]
        )
        req_codes, req_keys = _groups([run_id, _text(b.column("rid"), "")])
        sums = np.zeros((len(req_keys), per_row.shape[1]))
        np.add.at(sums, req_codes, per_row)
        for key, row in zip(req_keys, sums, strict=True):
            cur = self._open.get(key)
            self._open[key] = row if cur is None else cur + row
        if self.estimator and compact.any():
            self._compact_rows.append(b.filter(pa.array(compact)))

    def _requests(self, b: pa.Table) -> None:
        t = self.totals
        run_id = _text(b.column("run_id"), "")
        model, mode, run_workload = self._run_labels(run_id)
        workload = _text(b.column("workload"), "")
        workload = np.where(workload == "", run_workload, workload)
        codes, keys = _groups([model, mode, workload])
        reason = _text(b.column("finish_reason"), _UNKNOWN)
        rc, rk = _groups([model, mode, workload, reason])
        t.add("dspark_requests_total", rc, rk)
        prompt = _np(b.column("prompt_tokens"), 0).astype(np.float64)
        completion = _np(b.column("completion_tokens"), 0).astype(np.float64)
        t.add("dspark_prompt_tokens_total", codes, keys, prompt)
        t.add("dspark_completion_tokens_total", codes, keys, completion)
        arrival = _np(b.column("arrival_time"), np.nan).astype(np.float64)
        first = _np(b.column("first_token_time"), np.nan).astype(np.float64)
        finish = _np(b.column("finish_time"), np.nan).astype(np.float64)
        ttft = first - arrival
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(completion > 1, (finish - first) / (completion - 1), np.nan)
        e2e = finish - arrival
        t.observe("dspark_time_to_first_token_seconds", codes, keys, ttft)
        t.observe("dspark_time_per_output_token_seconds", codes, keys, tpot)
        t.observe("dspark_request_duration_seconds", codes, keys, e2e)

        rid = _text(b.column("rid"), "")
        empty = np.full(len(OPEN_SUMS), np.nan)  # a request finished without verify steps
        sums = np.array(
            [self._open.pop(k, empty) for k in zip(run_id.tolist(), rid.tolist(), strict=True)]
        ).reshape(len(rid), len(OPEN_SUMS))
        per_req = dict(zip(OPEN_SUMS, sums.T, strict=True))
        with np.errstate(invalid="ignore", divide="ignore"):
            accept_len = per_req["committed"] / per_req["steps"]
        dpc, dpk = _groups([model, mode, workload, _np(b.column("dp_rank"), 0)])
        t.observe("dspark_request_accept_length_tokens", dpc, dpk, accept_len)
        self._finished.append((b, model, mode, workload, per_req))
        self._finalize(force=False)

    def _finalize(self, force: bool) -> None:
        """Estimator sums and on_finished callbacks for the requests finished since the last
        pass; at most every ``finalize_interval_s`` unless forced (one estimator call then
        covers many requests)."""
        if not self._finished:
            return
        now = time.monotonic()
        if not force and now - self._last_finalize < self.finalize_interval_s:
            return
        self._last_finalize = now
        done, self._finished = self._finished, []
        b = pa.concat_tables([d[0] for d in done])
        model, mode, workload = (np.concatenate([d[i] for d in done]) for i in (1, 2, 3))
        per_req = {k: np.concatenate([d[4][k] for d in done]) for k in OPEN_SUMS}
        run_id, rid = _text(b.column("run_id"), ""), _text(b.column("rid"), "")
        estimated = self._estimate(b, run_id, rid, mode)
        if self.on_finished:
            frame = b.to_pandas()
            frame["model"], frame["mode"], frame["workload"] = model, mode, workload
            info = [self.runs[r] for r in run_id.tolist()]
            frame["source"] = [i.source for i in info]
            frame["server_address"] = [i.server_address for i in info]
            frame["server_port"] = [i.server_port for i in info]
            for c, col in per_req.items():
                frame[c] = col
            for i, col in enumerate(("estimated_ceiling", "estimated_ceiling_lo",
                                     "estimated_ceiling_hi")):  # fmt: skip
                frame[col] = estimated[:, i]
            for callback in self.on_finished:
                callback(frame)

    def _estimate(
        self, b: pa.Table, run_id: np.ndarray, rid: np.ndarray, mode: np.ndarray
    ) -> np.ndarray:
        """Block-accept estimator sums for finished compact requests; per request the mean
        ceiling per step [point, lo, hi] (NaN for other modes): [n_requests, 3].

        The same estimator as the store views and the report (:func:`estimate_blocks`,
        ``tail="auto"``); each run's tail model is a :class:`RunTail` (refit at fixed points
        of the run's request count on its finished requests' observations), and the point
        series carries the model's name as its ``tail`` label. lo / hi (SGLang's bracket)
        do not depend on it.
        """
        out = np.full((len(rid), 3), np.nan)
        compact = mode == "compact"
        if not (self.estimator and compact.any() and self._compact_rows):
            return out
        from dspark_obs.analytics.estimator import estimate_blocks
        from dspark_obs.analytics.estimator_live import RunTail

        rows = pa.concat_tables(self._compact_rows)
        key = pc.binary_join_element_wise(rows.column("run_id"), rows.column("rid"), "\x1f")
        done = pa.array([f"{a}\x1f{r}" for a, r in zip(run_id[compact], rid[compact], strict=True)])
        mine = pc.is_in(key, value_set=done)
        rows, rest = rows.filter(mine), rows.filter(pc.invert(mine))
        self._compact_rows = [rest] if rest.num_rows else []
        if rows.num_rows == 0:
            return out
        order = pc.sort_indices(rows, [("run_id", "ascending"), ("rid", "ascending"),
                                       ("forward_ct", "ascending")])  # fmt: skip
        rows = rows.take(order)
        r_run = _text(rows.column("run_id"), "")
        r_rid = _text(rows.column("rid"), "")
        requests = b.filter(pa.array(compact)).to_pandas()
        n = rows.num_rows
        committed, lo, point, hi = (np.zeros(n) for _ in range(4))
        tail = np.empty(n, dtype=object)
        finished = [(a, r) for a, r in zip(run_id[compact], rid[compact], strict=True)]
        for run, rids in _runs_in_order(finished):
            state = self._tails.setdefault(run, RunTail())
            for segment in state.segments(rids):
                at = np.flatnonzero((r_run == run) & np.isin(r_rid, segment))
                if at.size == 0:
                    state.finished += len(segment)
                    continue
                part = rows.take(pa.array(at))
                gamma = int(pc.max(part.column("gamma")).as_py())
                est = estimate_blocks(
                    part, requests=requests, tail="auto", mode="compact",
                    tail_model=state.model(gamma),
                )  # fmt: skip
                blk = est.blocks  # sorted as the rows already are: block i is row at[i]
                if not np.array_equal(
                    blk["forward_ct"].to_numpy(), _np(part.column("forward_ct"), -1)
                ):
                    raise AssertionError(f"run {run!r}: estimator blocks out of row order")
                for col, dst in (("committed", committed), ("lo", lo), ("point", point),
                                 ("hi", hi)):  # fmt: skip
                    dst[at] = blk[col].to_numpy(np.float64)
                tail[at] = est.tail_model.name
                state.add(est.observations, len(segment))
        model, r_mode, run_workload = self._run_labels(r_run)
        workload = _text(rows.column("workload"), "")
        workload = np.where(workload == "", run_workload, workload)
        labels = [model, r_mode, workload, _np(rows.column("dp_rank"), 0)]
        codes, keys = _groups(labels)
        t = self.totals
        t.add("dspark_estimator_blocks_total", codes, keys)
        t.add("dspark_estimator_committed_tokens_total", codes, keys, committed)
        t.add("dspark_estimator_lo_tokens_total", codes, keys, lo)
        t.add("dspark_estimator_hi_tokens_total", codes, keys, hi)
        tc, tk = _groups([*labels, tail])
        t.add("dspark_estimator_point_tokens_total", tc, tk, point)
        # mean point ceiling per step of each finished request (for its span)
        rc, rk = _groups([r_run, _text(rows.column("rid"), "")])
        n = np.bincount(rc)
        means = np.column_stack([np.bincount(rc, weights=w) / n for w in (point, lo, hi)])
        lookup = dict(zip(rk, means.tolist(), strict=True))
        nan3 = [np.nan] * 3
        return np.array(
            [lookup.get((a, r), nan3) for a, r in zip(run_id.tolist(), rid.tolist(), strict=True)],
            dtype=np.float64,
        ).reshape(len(rid), 3)
