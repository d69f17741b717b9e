"""The child of a :class:`~dspark_obs.sinks.process.SinkProcess`: the store and the telemetry
sinks, fed from the pipe on stdin, answering on stdout (``python -m`` this module).

Every batch is handled in order: the store first (a segment, durable before the answer),
then Prometheus and OpenTelemetry. The store's failure goes back with the answer (the
parent stops its producer); telemetry errors go back with each flush. When the parent goes
away, even killed, the pipe closes: what it sent is stored and exported, then this exits.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from dspark_obs.fanout import LaneStats
from dspark_obs.sinks.telemetry import open_telemetry
from dspark_obs.store import Store

_STOP = ("stop",)


class _Child:
    """The child's side: the store and the telemetry sinks, fed from the pipe."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from dspark_obs.sinks.backpressure import LaneCollector

        self.lanes: list[LaneStats] = []
        self.store = None if spec["store"] is None else Store(spec["store"])
        self.store_failure: str | None = None
        self.sinks, self.server = open_telemetry(
            spec["metrics_port"],
            spec["otlp_endpoint"],
            spec["host"],
            background=False,  # this process has nothing else to do: fold as batches come
            export_interval_s=spec["export_interval_s"],
        )
        if self.server is not None:
            self.sinks[0].registry.register(LaneCollector(lambda: self.lanes))

    def errors(self) -> list[str]:
        return [e for sink in self.sinks for e in sink.errors]

    def handle(self, message: tuple) -> tuple[str, Any, str | None] | None:
        kind = message[0]
        if kind == "write":
            _, table, batch, lanes = message
            self._follow(lanes)
            failed = self._stored(lambda store: store.write(table, batch))
            for sink in self.sinks:
                sink.write(table, batch)
            return ("ack", None, failed)
        if kind == "rejected":
            for sink in self.sinks:
                sink.rejected(message[1])
            return ("ack", None, None)
        if kind in ("flush", "close"):
            self._follow(message[1])
            closing = kind == "close"
            failed = self._stored(lambda store: store.close() if closing else store.flush())
            for sink in self.sinks:
                sink.close() if closing else sink.flush()
            if closing and self.server is not None:
                self.server.close()
            return ("done", self.errors(), failed)
        raise ValueError(f"unknown message {kind!r}")

    def _follow(self, lanes: list[LaneStats] | None) -> None:
        if lanes is not None:
            self.lanes = lanes

    def _stored(self, call: Callable[[Store], Any]) -> str | None:
        """Run ``call`` on the store; the failure's text when it raised. After a failure the
        store takes nothing more (the parent stops the run), as a FanOut's failed sink."""
        if self.store is None:
            return None
        if self.store_failure is not None:
            return self.store_failure
        try:
            call(self.store)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            self.store_failure = f"{type(exc).__name__}: {exc}"
            return self.store_failure
        return None


def _serve(inbox: Connection, outbox: Connection) -> None:
    """Read messages on a thread of their own (the pipe never fills while a write runs),
    handle them in order on this one, answer each while the parent listens."""
    try:
        child = _Child(inbox.recv())
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        outbox.send(("failed", type(exc).__name__, str(exc)))
        return
    outbox.send(("ready", None if child.server is None else child.server.url))
    messages: queue.SimpleQueue[tuple] = queue.SimpleQueue()

    def read() -> None:
        try:
            while True:
                messages.put(inbox.recv())
        except (EOFError, OSError):
            messages.put(_STOP)

    threading.Thread(target=read, name="dspark-obs-sinks-reader", daemon=True).start()
    answering = True
    while (message := messages.get()) is not _STOP:
        reply = child.handle(message)
        if reply is not None and answering:
            try:
                outbox.send(reply)
            except OSError:  # the parent died: still store everything it sent
                answering = False
        if message[0] == "close":
            return
    child.handle(("close", None))  # the parent went away: store and export what came


def main() -> None:
    out_fd = os.dup(1)
    os.dup2(2, 1)  # a stray print must not corrupt the pipe: stdout goes to stderr
    _serve(Connection(0, writable=False), Connection(out_fd, readable=False))


if __name__ == "__main__":
    main()
