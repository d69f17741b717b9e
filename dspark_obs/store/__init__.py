"""DuckDB-readable store: crash-safe Parquet segments per run, SQL views for readers.

    from dspark_obs.store import Store
    with Store("store") as store:            # a directory, created on first write
        ack = store.write("req_steps", batch)  # durable when it returns: Ack(rows, duplicates,
                                               #   segments, rejected)
    Store("store").query("FROM workload_summary")   # read-only SQL -> pyarrow.Table

Why segments and not one DuckDB file: a DuckDB database opened for writing locks every
other process out, and dashboards and users' own duckdb shells must read while a run is
being written. Every acknowledged write is an immutable Parquet file, atomically renamed
into its run's directory; readers are views over ``read_parquet`` globs, so they never wait.

Writing. ``Store(root)``: each ``write`` is one segment per run in the batch, durable when it
returns (the SGLang collector, which hands over thousands of records per poll, uses this).
``Store(root, flush_rows=50_000, flush_seconds=2.0)``: rows are buffered per table and
written when a threshold is hit (checked on write) or on ``flush()`` / ``close()``; the Ack
those return is the acknowledgement (the embedded engine, which emits a few rows per decode
step, uses this so that segments are not tiny). One writer per (table, run) at a time
(``flock``); a second one gets a StoreError. A key (``schema.KEYS``) is stored at most once:
rows repeated inside a batch or already stored are dropped (counted in ``Ack.duplicates``),
so restarting a killed producer and re-sending everything duplicates nothing. ``write``
stores a ``validation.ValidatedBatch`` (from ``validation.check``) as it is and validates
any pyarrow.Table first; refused rows are in ``Ack.rejected``, the rest is stored.

Reading. ``store.connect()`` gives a fresh DuckDB connection with the views ``runs``,
``steps``, ``req_steps``, ``requests`` and ``workload_summary``; ``store.query(sql)`` runs
read-only SQL (statements that write are refused with QueryRefused). Both are sandboxed by
DuckDB itself (``store/reader.py``: read-only database, no file outside the store, no
network, no extensions, configuration locked). Which files count is one rule for every
reader (``store/segments.py``); ``query``, ``export`` and ``info`` leave out a file that
fails it and say so (a StoreWarning with the rows it declares, ``Store.skipped``);
``dspark-obs store-check [--repair]`` lists damaged or foreign files and moves them to
``<root>/.quarantine/`` (``store/check.py``). From a plain duckdb shell: ``.read
<root>/catalog.sql``, or ``duckdb -readonly <root>/catalog.duckdb``.
``store.export(dir, run_id=None)`` writes one Parquet file per table.

Compaction. ``store.compact()`` merges each finished run's segments into one file and swaps
it in with one symlink rename (no duplicates, no loss, crash-safe). A query in flight at
the instant of a swap can fail to open a replaced file: ``Store.query`` retries it; a
duckdb shell user re-runs it. Compact finished runs, not live ones.
"""

from dspark_obs.store.compaction import Compaction
from dspark_obs.store.guard import QueryRefused
from dspark_obs.store.layout import StoreError, StoreWarning
from dspark_obs.store.partition import Ack
from dspark_obs.store.store import Store

__all__ = ["Ack", "Compaction", "QueryRefused", "Store", "StoreError", "StoreWarning"]
