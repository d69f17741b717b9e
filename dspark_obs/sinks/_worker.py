"""A background fold: the caller's thread only enqueues batches; one worker thread folds them.

Shared by the Prometheus and OpenTelemetry sinks so the decode loop never waits for
aggregation, an estimator pass, or an exporter. The queue is bounded (a :class:`Lane`): a
fold that falls behind makes the writer wait, counted in :attr:`FoldWorker.stats`, rather
than letting memory grow without limit or dropping a batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pyarrow as pa

from dspark_obs.fanout import DEFAULT_QUEUE_BATCHES, Clock, Lane, LaneStats


class FoldWorker:
    """Calls ``fold(table, batch)`` for each written batch, on a worker thread when
    ``background`` (else inline). Failures are kept in ``errors``, never raised into a run."""

    def __init__(
        self,
        fold: Callable[[str, pa.Table], None],
        background: bool,
        name: str,
        capacity: int = DEFAULT_QUEUE_BATCHES,
        clock: Clock = time.perf_counter,
    ):
        self._fold = fold
        self.errors: list[str] = []
        self.cpu_seconds = 0.0  # CPU time spent folding (thread time): the sink's own cost
        self._lane: Lane | None = Lane(name, self._run, capacity, clock) if background else None
        self._name = name

    @property
    def stats(self) -> LaneStats | None:
        """The queue's counters (backpressure included); None when folding inline."""
        return None if self._lane is None else self._lane.stats

    def write(self, table: str, batch: pa.Table) -> None:
        if self._lane is None:
            self._run(table, batch)
        else:
            self._lane.put(table, batch, rows=batch.num_rows)

    def flush(self) -> None:
        """Wait until every batch written so far has been folded in."""
        if self._lane is not None:
            self._lane.drain()

    def close(self) -> None:
        if self._lane is not None:
            self._lane.close(timeout=10)
        self._lane = None

    def _run(self, table: str, batch: pa.Table) -> None:
        t0 = time.thread_time()
        try:
            self._fold(table, batch)
        except Exception as exc:  # noqa: BLE001 - telemetry must never stop a run
            self.errors.append(f"{table}: {type(exc).__name__}: {exc}")
        self.cpu_seconds += time.thread_time() - t0
