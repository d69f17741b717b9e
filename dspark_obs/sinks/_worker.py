"""A background fold: the caller's thread only enqueues batches; one worker thread folds them.

Shared by the Prometheus and OpenTelemetry sinks so the decode loop never waits for
aggregation, an estimator pass, or an exporter.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import pyarrow as pa

_STOP = object()


class FoldWorker:
    """Calls ``fold(table, batch)`` for each written batch, on a worker thread when
    ``background`` (else inline). Failures are kept in ``errors``, never raised into a run."""

    def __init__(self, fold: Callable[[str, pa.Table], None], background: bool, name: str):
        self._fold = fold
        self.errors: list[str] = []
        self.cpu_seconds = 0.0  # CPU time spent folding (thread time): the sink's own cost
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._drain, name=name, daemon=True)
            self._thread.start()

    def write(self, table: str, batch: pa.Table) -> None:
        if self._queue is None:
            self._run(table, batch)
        else:
            self._queue.put((table, batch))

    def flush(self) -> None:
        """Wait until every batch written so far has been folded in."""
        if self._queue is not None and self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        self.flush()
        if self._queue is not None and self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout=10)
        self._queue = None

    def _run(self, table: str, batch: pa.Table) -> None:
        t0 = time.thread_time()
        try:
            self._fold(table, batch)
        except Exception as exc:  # noqa: BLE001 - telemetry must never stop a run
            self.errors.append(f"{table}: {type(exc).__name__}: {exc}")
        self.cpu_seconds += time.thread_time() - t0

    def _drain(self) -> None:
        q = self._queue
        assert q is not None
        while True:
            item = q.get()
            try:
                if item is _STOP:
                    return
                self._run(*item)
            finally:
                q.task_done()
