"""Step records column-wise: a decode step's host arrays -> Arrow ``steps`` / ``req_steps``.

The decode loop already holds every number a step record needs as arrays (verify lengths,
accepted counts, confidences, survival, the estimator terms). Turning them into one Python
dict per request and back into Arrow grows with the batch (``bench/bench_step_records.py``);
this module builds the two tables straight from the arrays instead, many steps at a time,
with no per-request Python objects, and :class:`RecordWorker` does it on a worker thread.

Usage (one builder per run)::

    rec = StepRecordBuilder(run_id, mode="compact", gamma=5, lag_steps=2)
    i = rec.register("rid-7", workload="math", temperature=0.0, top_p=1.0, top_k=-1)
    rec.add(StepArrays(forward_ct=fct, budget=b, num_verify_tokens=n, ts=ts,
                       req=np.array([i, ...]), req_pool_index=..., prefix_len=...,
                       verify_len=..., acc_len=..., correct_drafts=..., cap_trim=...,
                       bonus_token=..., is_last=..., draft_tokens=D, confidence=C,
                       survival=S, censored=M, draft_logprobs=Q, greedy=G, pg=P))
    tables = rec.build()       # {"steps": pa.Table, "req_steps": pa.Table}; buffer emptied
    emit("steps", tables["steps"]); emit("req_steps", tables["req_steps"])

    # or off the decode thread: add per step, flush per hand-over, close at the end
    worker = RecordWorker(rec, fan.emit)
    worker.add(step); worker.flush(then=[("requests", finished_rows)]); worker.close()

The tables have exactly the types of :data:`dspark_obs.schema.STEPS` / ``REQ_STEPS`` and the
same values the row dicts of ``Engine._req_step_row`` produce once validated (the tests check
this field by field on a real engine run), so :func:`dspark_obs.validation.validate` only has its
rules left to check. Every field's meaning is the schema's; the ones that take a rule:

* ``trimmed_tokens`` / ``q_lp``: for a ``censored`` row (a compact window fully accepted with
  drafts cut off), ``draft_tokens[i, verify_len-1:]`` and ``draft_logprobs[i, verify_len-1:]``
  (zeros on ``greedy`` rows: log q of the drafter's argmax at T -> 0); null elsewhere.
* ``pg``: the rows' resolved estimator entries as flat arrays (:class:`PgEntries`), grouped
  by row in row order (each row keeps its entries' order); null for a row without any.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa

from dspark_obs.fanout import DEFAULT_QUEUE_BATCHES, Clock, Lane, LaneStats
from dspark_obs.schema import (
    PG_TYPE,
    REQ_STEPS,
    SGLANG_REQ_INT_FIELDS,
    SGLANG_STEP_FLOAT_FIELDS,
    STEPS,
)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_UNSET = -1  # SGLang's "unset" for int step fields

PG_FIELDS = tuple(PG_TYPE.field(i).name for i in range(PG_TYPE.num_fields))


class StepRecordError(ValueError):
    """Arrays of a step that cannot describe one (mismatched lengths, an unknown request)."""


@dataclass(frozen=True)
class PgEntries:
    """Resolved block-accept estimator entries of one step, flat: entry e belongs to batch
    row ``row[e]`` (see ``censored.resolve``: ``src_fct, k, target_logprob, draft_token,
    realized_token``)."""

    row: np.ndarray
    src_fct: np.ndarray
    k: np.ndarray
    target_logprob: np.ndarray
    draft_token: np.ndarray
    realized_token: np.ndarray

    @staticmethod
    def empty() -> PgEntries:
        z = np.zeros(0, dtype=np.int64)
        return PgEntries(z, z, z, np.zeros(0, dtype=np.float32), z, z)

    @staticmethod
    def from_rows(per_row: Sequence[Sequence[Mapping[str, Any]] | None]) -> PgEntries:
        """From ``censored.resolve``'s entry dicts, one list (or None) per batch row. The
        entries exist only for censored blocks being resolved: a few per step, not per row."""
        rows = [i for i, entries in enumerate(per_row) if entries for _ in entries]
        return PgEntries.from_entries(rows, [e for entries in per_row if entries for e in entries])

    @staticmethod
    def from_entries(rows: Sequence[int], entries: Sequence[Mapping[str, Any]]) -> PgEntries:
        """From ``censored.resolve``'s entry dicts, flat: ``entries[e]`` belongs to batch row
        ``rows[e]``."""
        if not entries:
            return PgEntries.empty()
        cols = {name: [e[name] for e in entries] for name in PG_FIELDS}
        return PgEntries(
            row=np.asarray(rows, dtype=np.int64),
            src_fct=np.asarray(cols["src_fct"], dtype=np.int64),
            k=np.asarray(cols["k"], dtype=np.int64),
            target_logprob=np.asarray(cols["target_logprob"], dtype=np.float64),
            draft_token=np.asarray(cols["draft_token"], dtype=np.int64),
            realized_token=np.asarray(cols["realized_token"], dtype=np.int64),
        )


@dataclass
class StepArrays:
    """One decode step for the running batch (row i = the i-th running request).

    Per-step scalars first (``bs`` is the number of rows), then per-row arrays of length bs,
    then ``[bs, gamma]`` arrays. Step-level floats may be None (null); the SGLang int step
    fields left at -1 are "unset", as in SGLang.
    """

    forward_ct: int
    budget: int
    num_verify_tokens: int
    ts: datetime
    req: np.ndarray  # request index from StepRecordBuilder.register
    req_pool_index: np.ndarray
    prefix_len: np.ndarray  # tokens known before the step, anchor included
    verify_len: np.ndarray
    acc_len: np.ndarray
    correct_drafts: np.ndarray
    cap_trim: np.ndarray  # 0 outside cap-accept
    bonus_token: np.ndarray
    is_last: np.ndarray  # bool
    draft_tokens: np.ndarray  # [bs, gamma]
    confidence: np.ndarray  # [bs, gamma]
    survival: np.ndarray  # [bs, gamma]
    censored: np.ndarray | None = None  # bool [bs]; None: no row censored
    draft_logprobs: np.ndarray | None = None  # [bs, gamma]; read on censored rows only
    greedy: np.ndarray | None = None  # bool [bs]: q_lp of a censored greedy row is 0
    pg: PgEntries | None = None
    predicted_step_ms: float | None = None
    predicted_theta: float | None = None
    step_cpu_ms: float | None = None
    step_gpu_ms: float | None = None
    draft_gpu_ms: float | None = None
    target_verify_gpu_ms: float | None = None
    verify_tokens_dp_synced: int = _UNSET
    verify_tokens_graph_key: int = _UNSET
    verify_tokens_local: int | None = None  # None: num_verify_tokens (one DP rank)

    @property
    def bs(self) -> int:
        return len(self.req)


_ROW_INTS = SGLANG_REQ_INT_FIELDS  # the ReqDetail ints every req_steps row carries
_BLOCKS = ("draft_tokens", "confidence", "survival")
_STEP_FLOATS = SGLANG_STEP_FLOAT_FIELDS  # the step's optional timings


@dataclass
class _Requests:
    """Per-request constants, looked up by index (``take``) instead of copied per row."""

    rid: list[str] = field(default_factory=list)
    workload: list[str | None] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    _arrays: dict[str, pa.Array] | None = None

    def arrays(self, n: int) -> dict[str, pa.Array]:
        """Arrays of (at least) the first ``n`` requests. Reads only entries registered
        before the steps being built were taken, so registering on the decode thread while a
        worker builds is safe."""
        cached = self._arrays
        if cached is None or len(cached["rid"]) < n:
            cached = self._arrays = {
                name: pa.array(getattr(self, name)[:n], type=REQ_STEPS.field(name).type)
                for name in ("rid", "workload", "temperature", "top_p", "top_k")
            }
        return cached


@dataclass(frozen=True)
class TakenSteps:
    """Steps taken from a builder (:meth:`StepRecordBuilder.take`), ready to build anywhere."""

    steps: list[StepArrays]
    requests: int  # requests registered when they were taken


class StepRecordBuilder:
    """Accumulates steps' arrays of one run; :meth:`build` returns their Arrow tables."""

    def __init__(
        self,
        run_id: str,
        *,
        mode: str,
        gamma: int,
        lag_steps: int,
        dp_rank: int = 0,
        source: str = "engine",
    ) -> None:
        self.run_id, self.mode, self.gamma = run_id, mode, gamma
        self.lag_steps, self.dp_rank, self.source = lag_steps, dp_rank, source
        self._requests = _Requests()
        self._steps: list[StepArrays] = []

    def register(
        self,
        rid: str,
        *,
        workload: str | None,
        temperature: float,
        top_p: float,
        top_k: int,
    ) -> int:
        """A request's constants, once; returns the index its rows name in ``StepArrays.req``."""
        r = self._requests
        r.rid.append(rid)
        r.workload.append(workload)
        r.temperature.append(float(temperature))
        r.top_p.append(float(top_p))
        r.top_k.append(int(top_k))
        return len(r.rid) - 1

    def add(self, step: StepArrays) -> None:
        """Queue one step (checked now, so a bad step fails at its source, not at build)."""
        self._check(step)
        self._steps.append(step)

    @property
    def pending_steps(self) -> int:
        return len(self._steps)

    def build(self) -> dict[str, pa.Table]:
        """The queued steps as ``steps`` and ``req_steps`` tables; the queue is emptied."""
        return self.tables(self.take())

    def take(self) -> TakenSteps:
        """Empty the queue (cheap: on the decode thread); :meth:`tables` builds them later."""
        steps, self._steps = self._steps, []
        return TakenSteps(steps, len(self._requests.rid))

    def tables(self, taken: TakenSteps) -> dict[str, pa.Table]:
        """The ``steps`` and ``req_steps`` tables of taken steps (any thread, one at a time)."""
        return {
            "steps": self._steps_table(taken.steps),
            "req_steps": self._req_steps_table(taken.steps, taken.requests),
        }

    # ------------------------------------------------------------------ internals

    def _check(self, s: StepArrays) -> None:
        bs, g = s.bs, self.gamma
        if s.ts.tzinfo is None:
            raise StepRecordError(f"step {s.forward_ct}: ts must be timezone-aware (UTC)")
        for name in (*_ROW_INTS, "is_last"):
            if np.shape(getattr(s, name)) != (bs,):
                raise StepRecordError(f"step {s.forward_ct}: {name} must have shape ({bs},)")
        for name in _BLOCKS:
            if np.shape(getattr(s, name)) != (bs, g):
                raise StepRecordError(f"step {s.forward_ct}: {name} must have shape ({bs}, {g})")
        if bs and (np.min(s.req) < 0 or np.max(s.req) >= len(self._requests.rid)):
            raise StepRecordError(f"step {s.forward_ct}: a request index was never registered")
        for name in ("censored", "greedy"):
            if getattr(s, name) is not None and np.shape(getattr(s, name)) != (bs,):
                raise StepRecordError(f"step {s.forward_ct}: {name} must have shape ({bs},)")
        if s.censored is not None and np.any(s.censored):
            if s.draft_logprobs is None or np.shape(s.draft_logprobs) != (bs, g):
                raise StepRecordError(
                    f"step {s.forward_ct}: censored rows need draft_logprobs of shape ({bs}, {g})"
                )
            w = np.asarray(s.verify_len)[np.asarray(s.censored, dtype=bool)]
            if np.any(w < 1) or np.any(w > g):
                raise StepRecordError(
                    f"step {s.forward_ct}: a censored row needs 1 <= verify_len <= gamma"
                )
        if s.pg is not None and len(s.pg.row) and (s.pg.row.min() < 0 or s.pg.row.max() >= bs):
            raise StepRecordError(
                f"step {s.forward_ct}: a pg entry names a row outside 0..{bs - 1}"
            )

    def _steps_table(self, steps: list[StepArrays]) -> pa.Table:
        n = len(steps)
        ints = {
            "bs": [s.bs for s in steps],
            "budget": [int(s.budget) for s in steps],
            "lag_steps": [self.lag_steps] * n,
            "num_running_reqs": [s.bs for s in steps],
            "num_verify_tokens": [int(s.num_verify_tokens) for s in steps],
            "verify_tokens_local": [
                int(s.num_verify_tokens if s.verify_tokens_local is None else s.verify_tokens_local)
                for s in steps
            ],
            "verify_tokens_dp_synced": [int(s.verify_tokens_dp_synced) for s in steps],
            "verify_tokens_graph_key": [int(s.verify_tokens_graph_key) for s in steps],
        }
        cols: dict[str, pa.Array] = {
            "run_id": _repeat(self.run_id, n, pa.string()),
            "dp_rank": pa.array(np.full(n, self.dp_rank, dtype=np.int32)),
            "forward_ct": pa.array(np.array([s.forward_ct for s in steps], dtype=np.int64)),
            "source": _repeat(self.source, n, pa.string()),
            "mode": _repeat(self.mode, n, pa.string()),
            **{k: pa.array(np.array(v, dtype=np.int64)) for k, v in ints.items()},
            **{
                f: pa.array([_opt_float(getattr(s, f)) for s in steps], type=pa.float64())
                for f in _STEP_FLOATS
            },
            "ts": _timestamps(_step_micros(steps)),
        }
        return pa.Table.from_arrays([cols[f.name] for f in STEPS], schema=STEPS)

    def _req_steps_table(self, steps: list[StepArrays], n_requests: int) -> pa.Table:
        g = self.gamma
        sizes = np.fromiter((len(s.req) for s in steps), dtype=np.int64, count=len(steps))
        n = int(sizes.sum())
        cat = _concat_rows(steps)
        req = cat("req", np.int64)
        reqs = self._requests.arrays(n_requests)
        take = pa.array(req)
        verify_len = cat("verify_len", np.int64)
        censored = (
            np.concatenate([_censored(s) for s in steps]) if steps else np.zeros(0, dtype=bool)
        )
        draft_tokens = _blocks(steps, "draft_tokens", g, np.int32)
        cols: dict[str, pa.Array] = {
            "run_id": _repeat(self.run_id, n, pa.string()),
            "dp_rank": pa.array(np.full(n, self.dp_rank, dtype=np.int32)),
            "forward_ct": pa.array(
                np.repeat(np.array([s.forward_ct for s in steps], dtype=np.int64), sizes)
            ),
            "rid": reqs["rid"].take(take),
            "gamma": pa.array(np.full(n, g, dtype=np.int32)),
            **{f: pa.array(cat(f, np.int64)) for f in _ROW_INTS if f != "verify_len"},
            "verify_len": pa.array(verify_len),
            "draft_tokens": _fixed_lists(draft_tokens, g, pa.int32()),
            "confidence": _fixed_lists(
                _blocks(steps, "confidence", g, np.float32), g, pa.float32()
            ),
            "survival": _fixed_lists(_blocks(steps, "survival", g, np.float32), g, pa.float32()),
            "workload": reqs["workload"].take(take),
            "temperature": reqs["temperature"].take(take),
            "top_p": reqs["top_p"].take(take),
            "top_k": reqs["top_k"].take(take),
            "is_last": pa.array(cat("is_last", np.bool_)),
            **_estimator_tails(steps, draft_tokens, verify_len, censored, g),
            "pg": _pg(steps, sizes),
            "ts": _timestamps(np.repeat(_step_micros(steps), sizes)),
        }
        return pa.Table.from_arrays([cols[f.name] for f in REQ_STEPS], schema=REQ_STEPS)


Emit = Callable[[str, Any], Any]


class RecordWorker:
    """Builds and emits a run's step records on one worker thread, off the decode loop.

    The decode thread calls :meth:`add` per step (a reference is kept; no copy, so hand it
    arrays the loop will not overwrite) and :meth:`flush` at each hand-over; the worker
    builds the tables and calls ``emit("steps", ...)``, ``emit("req_steps", ...)``, then
    ``emit`` for each ``(table, rows)`` of ``then`` (e.g. the ``requests`` rows of requests
    that finished in those steps), in that order. The queue holds ``capacity`` hand-overs;
    a full one makes the decode thread wait, counted in :attr:`stats`. A failure in the
    worker (a bad batch, a sink's error) is raised from the next flush / drain / close.
    """

    def __init__(
        self,
        builder: StepRecordBuilder,
        emit: Emit,
        capacity: int = DEFAULT_QUEUE_BATCHES,
        clock: Clock = time.perf_counter,
    ) -> None:
        self.builder = builder
        self._emit = emit
        self._lane = Lane("records", self._build_and_emit, capacity, clock)

    @property
    def stats(self) -> LaneStats:
        return self._lane.stats

    def add(self, step: StepArrays) -> None:
        self.builder.add(step)

    def flush(self, then: Sequence[tuple[str, Any]] = ()) -> None:
        """Hand the steps added so far (and ``then``) to the worker."""
        self._raise_failed()
        taken = self.builder.take()
        rows = sum(s.bs for s in taken.steps)
        if taken.steps or then:
            self._lane.put(taken, list(then), rows=rows)

    def drain(self) -> None:
        """Return once everything flushed so far was built and emitted."""
        self._lane.drain()
        self._raise_failed()

    def close(self) -> None:
        """Flush what is left, drain, join the worker. Idempotent."""
        try:
            if self.builder.pending_steps:
                self.flush()
        finally:
            self._lane.close()
        self._raise_failed()

    def _build_and_emit(self, taken: TakenSteps, then: list[tuple[str, Any]]) -> None:
        if taken.steps:
            tables = self.builder.tables(taken)
            self._emit("steps", tables["steps"])
            self._emit("req_steps", tables["req_steps"])
        for table, rows in then:
            self._emit(table, rows)

    def _raise_failed(self) -> None:
        if self._lane.error is not None:
            raise self._lane.error


# ---------------------------------------------------------------------- column helpers


def _micros(ts: datetime) -> int:
    """Microseconds since the epoch, exact (what Arrow stores for timestamp("us"))."""
    return (ts - _EPOCH) // _US


def _step_micros(steps: list[StepArrays]) -> np.ndarray:
    return np.fromiter((_micros(s.ts) for s in steps), dtype=np.int64, count=len(steps))


def _timestamps(us: np.ndarray) -> pa.Array:
    return pa.array(us, type=pa.int64()).cast(pa.timestamp("us", tz="UTC"))


def _opt_float(v: float | None) -> float | None:
    return None if v is None else float(v)


def _repeat(value: str, n: int, typ: pa.DataType) -> pa.Array:
    return pa.repeat(pa.scalar(value, type=typ), n)


def _concat_rows(steps: list[StepArrays]) -> Any:
    def cat(name: str, dtype: type) -> np.ndarray:
        if not steps:
            return np.zeros(0, dtype=dtype)
        return np.concatenate([getattr(s, name) for s in steps]).astype(dtype, copy=False)

    return cat


def _blocks(steps: list[StepArrays], name: str, g: int, dtype: type) -> np.ndarray:
    """The steps' ``[bs, g]`` arrays stacked (one concatenate, one cast)."""
    if not steps:
        return np.zeros((0, g), dtype=dtype)
    return np.concatenate([getattr(s, name) for s in steps]).astype(dtype, copy=False)


def _fixed_lists(block: np.ndarray, g: int, typ: pa.DataType) -> pa.Array:
    """A ``[n, g]`` array as n lists of g values (the schema's list type)."""
    n = block.shape[0]
    offsets = pa.array(np.arange(0, (n + 1) * g, g, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(block.reshape(-1), type=typ))


def _censored(s: StepArrays) -> np.ndarray:
    if s.censored is None:
        return np.zeros(len(s.req), dtype=bool)
    return np.asarray(s.censored, dtype=bool)


def _q_lp(steps: list[StepArrays], g: int) -> np.ndarray:
    """Per row the draft log-probs a censored row stores (greedy rows: zeros)."""
    lp = np.concatenate([
        np.zeros((len(s.req), g), dtype=np.float32) if s.draft_logprobs is None
        else s.draft_logprobs
        for s in steps
    ]).astype(np.float32)  # fmt: skip
    greedy = np.concatenate([
        np.zeros(len(s.req), dtype=bool) if s.greedy is None else s.greedy for s in steps
    ]).astype(bool)  # fmt: skip
    lp[greedy] = 0.0
    return lp


def _estimator_tails(
    steps: list[StepArrays], drafts: np.ndarray, verify_len: np.ndarray, censored: np.ndarray,
    g: int,
) -> dict[str, pa.Array]:  # fmt: skip
    """``trimmed_tokens`` and ``q_lp``: the censored rows' tails, null elsewhere."""
    if not censored.any():
        n = len(censored)
        return {"trimmed_tokens": pa.nulls(n, pa.list_(pa.int32())),
                "q_lp": pa.nulls(n, pa.list_(pa.float32()))}  # fmt: skip
    return {
        "trimmed_tokens": _tails(drafts, verify_len, censored, pa.int32()),
        "q_lp": _tails(_q_lp(steps, g), verify_len, censored, pa.float32()),
    }


def _tails(
    block: np.ndarray, verify_len: np.ndarray, keep: np.ndarray, typ: pa.DataType
) -> pa.Array:
    """Row i: ``block[i, verify_len[i]-1:]`` where ``keep[i]``, else null."""
    n, g = block.shape
    start = np.where(keep, verify_len - 1, g)
    lengths = g - start
    take = np.arange(g)[None, :] >= start[:, None]  # row-major: each row's tail, in order
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(
        pa.array(offsets), pa.array(block[take], type=typ), mask=pa.array(~keep)
    )


def _pg(steps: list[StepArrays], sizes: np.ndarray) -> pa.Array:
    """The ragged ``pg`` column: each row's entries in order, null where a row has none."""
    n = int(sizes.sum())
    base = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(sizes) else np.zeros(0, np.int64)
    parts = [
        (b, s.pg) for b, s in zip(base, steps, strict=True) if s.pg is not None and len(s.pg.row)
    ]
    if not parts:
        return pa.nulls(n, type=pa.list_(PG_TYPE))
    rows = np.concatenate([b + p.row for b, p in parts])
    order = np.argsort(rows, kind="stable")  # group by row, keep each row's own order
    fields = {
        name: np.concatenate([getattr(p, name) for _, p in parts])[order] for name in PG_FIELDS
    }
    values = pa.StructArray.from_arrays(
        [pa.array(fields[f.name], type=f.type) for f in PG_TYPE], fields=list(PG_TYPE)
    )
    counts = np.bincount(rows, minlength=n)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=pa.array(counts == 0))
