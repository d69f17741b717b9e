"""The one producer interface: producers hand validated Arrow batches to a ``RecordSink``.

Producers (the embedded engine, the SGLang collector) never import a concrete sink; sinks
(the store, Prometheus, OpenTelemetry) never import a producer. ``FanOut`` joins them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import pyarrow as pa

from dspark_obs.schema import RecordError, validate


class RecordSink(Protocol):
    """Anything that consumes record batches of the four tables in dspark_obs.schema."""

    def write(self, table: str, batch: pa.Table) -> None: ...

    def close(self) -> None: ...


class FanOut:
    """Validate once, then hand the same valid batch to every sink.

    Rejected rows are kept in ``errors`` (and never reach a sink); valid rows of the same
    batch are written.
    """

    def __init__(self, sinks: Iterable[RecordSink]):
        self.sinks = list(sinks)
        self.errors: list[RecordError] = []

    def emit(self, table: str, rows: Sequence[Mapping[str, Any]] | pa.Table) -> pa.Table:
        batch, errors = validate(table, rows)
        self.errors.extend(errors)
        if errors:  # sinks that count rejections (telemetry) define rejected(errors)
            for sink in self.sinks:
                if hasattr(sink, "rejected"):
                    sink.rejected(errors)
        if batch.num_rows:
            for sink in self.sinks:
                sink.write(table, batch)
        return batch

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class MemorySink:
    """Keeps every batch in memory; for tests and for small in-process analyses."""

    def __init__(self) -> None:
        self.batches: dict[str, list[pa.Table]] = {}

    def write(self, table: str, batch: pa.Table) -> None:
        self.batches.setdefault(table, []).append(batch)

    def table(self, table: str) -> pa.Table | None:
        parts = self.batches.get(table)
        return pa.concat_tables(parts) if parts else None

    def close(self) -> None:
        pass
