"""``dspark-obs collect``: attach to a running SGLang DSpark server and record what it emits.

Each poll reads GET /server_info, takes every DP rank's ``dspark_info_record`` and hands the
steps and request-steps it has not stored yet to the one producer interface (FanOut: the
store and the telemetry sinks), tails the block-accept estimator JSONL and merges its fields
(``trimmed_tokens``, ``q_lp``, ``pg``) into the request-steps they belong to, and scrapes
SGLang's own /metrics to reconcile (``sglang:spec_verify_calls_total`` against the stored
request-steps). The first poll with a valid block size writes the ``runs`` row.

Why each rule:

* The ring buffer comes back whole on every call; which records are new, which DP rank a
  reply is, whether the server restarted and which forward_cts were lost are decided from
  the data (:mod:`dspark_obs.sglang.ranks`). A new epoch (restart) gets an offset so its
  steps never meet the old keys. Every row handed to the sinks is new, so the counts in the
  summary and in every sink are of stored rows; nothing is sent twice.
* ``clear`` posts ``dspark_clear_info_records`` after an acknowledged write (not after the
  final read, so the end loses nothing); SGLang offers no atomic read-and-clear, so steps that
  land between a read and its clear are lost and reported as a range by the next read.
* Down, timeouts, truncated or malformed bodies fail the poll (reported, retried with
  backoff); the whole poll is bounded by ``timeout_s`` (a server dripping bytes cannot hold
  it). One record of the wrong types is left out and named; the rest of the poll is stored.
* Estimator lines wait for their step (never dropped); a request-step waits for its line until
  the file has passed its forward_ct or ``hold_s``; a line whose step was already stored
  without it (late) is stored as an amendment (the ``req_step_amends`` table), which the
  ``req_steps`` view merges into the stored row, and counted.
* Epochs, marks and held lines persist in ``<store>/.collector/<run>.json`` after every
  write, so a restarted collector resumes without re-reading into a collision.
* Fleets: :class:`Collector` polls many servers concurrently (a bounded pool), each with its
  own backoff; one shared FanOut takes one write at a time.

One server's poll is :class:`~dspark_obs.sglang.server_collector.ServerCollector`; the
estimator merge is :mod:`dspark_obs.sglang.estimator_merge`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from dspark_obs.fanout import FanOut, RecordSink
from dspark_obs.sglang.fetch import CollectError
from dspark_obs.sglang.server_collector import (
    CollectorOptions,
    CollectorTotals,
    PollReport,
    ServerCollector,
    state_name,
)

__all__ = [
    "CollectError",
    "Collector",
    "CollectorOptions",
    "CollectorTotals",
    "PollReport",
    "ServerCollector",
    "state_name",
]


# ---------------------------------------------------------------- the polling loop


class Collector:
    """Polls servers (a pair, or a fleet) until stopped, concurrently, backing off failures."""

    def __init__(
        self,
        servers: Sequence[CollectorOptions],
        sinks: Sequence[RecordSink],
        *,
        interval_s: float = 1.0,
        max_backoff_s: float = 30.0,
        report: Callable[[str, str], None] | None = None,
        workers: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fan = _LockedFanOut(sinks)
        self.servers = [ServerCollector(o, self.fan, clock) for o in servers]
        self.interval_s = interval_s
        self.max_backoff_s = max_backoff_s
        self.report = report or (lambda run, msg: None)
        self.clock = clock
        self._pool = ThreadPoolExecutor(
            max(1, min(workers, len(self.servers))), thread_name_prefix="collect"
        )
        self._stop = threading.Event()
        self._next: dict[int, float] = {}
        self._backoff: dict[int, float] = {}
        self.up: dict[str, bool] = {}

    def stop(self) -> None:
        self._stop.set()

    def _poll_one(
        self, sc: ServerCollector, final: bool, until: float | None = None
    ) -> PollReport | None:
        try:
            rep = sc.poll(final=final, until=until)
        except CollectError as exc:
            sc.totals.failed_polls += 1
            sc.totals.last_error = str(exc)
            self.up[sc.opts.run_id] = False
            for note in exc.notes:  # found before it failed (a restart, gaps)
                self.report(sc.opts.run_id, note)
            self.report(sc.opts.run_id, f"poll failed: {exc}")
            return None
        self.up[sc.opts.run_id] = True
        for note in rep.notes:
            self.report(sc.opts.run_id, note)
        return rep

    def poll_once(self, final: bool = False) -> list[PollReport | None]:
        """One round over every server (concurrently); a failed server is reported, skipped."""
        return list(self._pool.map(lambda sc: self._poll_one(sc, final), self.servers))

    def run(self, duration_s: float | None = None) -> None:
        """Poll each server every ``interval_s`` (its own backoff on errors) until
        :meth:`stop` or ``duration_s``."""
        end = None if duration_s is None else self.clock() + duration_s
        until = None if end is None else end + 1.0  # no poll outlives the run by more
        while not self._stop.is_set():
            now = self.clock()
            due = [i for i in range(len(self.servers)) if self._next.get(i, 0.0) <= now]
            for i, rep in zip(
                due,
                self._pool.map(lambda i: self._poll_one(self.servers[i], False, until), due),
                strict=True,
            ):
                back = self._backoff.get(i, self.interval_s)
                back = (
                    self.interval_s
                    if rep is not None
                    else min(max(back * 2, 0.5), self.max_backoff_s)
                )
                self._backoff[i] = back
                self._next[i] = self.clock() + back
            nxt = min(self._next.values(), default=self.clock())
            wait = max(0.0, nxt - self.clock())
            if end is not None:
                if self.clock() >= end:
                    break
                wait = min(wait, end - self.clock())
            self._stop.wait(wait)

    def finish(self, attempts: int = 3) -> None:
        """A last poll (retried with backoff, within one poll timeout in all), write whatever
        is held; then close the sinks."""
        pending = list(range(len(self.servers)))
        delay = 0.2
        limit = (
            self.clock() + max(sc.opts.timeout_s for sc in self.servers)
            if self.servers
            else self.clock()
        )
        for _ in range(attempts):
            reps = list(
                self._pool.map(lambda i: self._poll_one(self.servers[i], True, limit), pending)
            )
            pending = [i for i, r in zip(pending, reps, strict=True) if r is None]
            if not pending or self.clock() + delay >= limit:
                break
            time.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)
        for sc in self.servers:
            sc.close()
        self._pool.shutdown(wait=True)
        self.fan.close()


class _LockedFanOut(FanOut):
    """One FanOut shared by the pool's threads: a write (and its error list) at a time."""

    def __init__(self, sinks: Sequence[RecordSink]) -> None:
        super().__init__(sinks)
        self._lock = threading.RLock()

    def emit(self, table: str, rows: Any) -> pa.Table:
        with self._lock:
            return super().emit(table, rows)
