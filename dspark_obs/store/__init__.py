"""DuckDB-readable store: crash-safe Parquet segments per run, views for SQL readers.

    from dspark_obs.store import Store
    with Store("store") as store:          # a directory, created on first write
        store.write("req_steps", batch)     # durable when it returns (an Ack)
    Store("store").query("FROM workload_summary")   # read-only SQL -> pyarrow.Table
"""

from dspark_obs.store.guard import QueryRefused
from dspark_obs.store.layout import StoreError
from dspark_obs.store.store import Ack, Compaction, Store

__all__ = ["Ack", "Compaction", "QueryRefused", "Store", "StoreError"]
