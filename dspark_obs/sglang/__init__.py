"""SGLang integration: speak SGLang 0.5.23's DSpark surfaces in both directions.

* :mod:`~dspark_obs.sglang.collector` attaches to a running server (step dump, estimator
  JSONL, /metrics) and stores what it emits; :mod:`~dspark_obs.sglang.ranks` decides from
  the data which DP rank a reply is, what is new, restarts and lost ranges;
  :mod:`~dspark_obs.sglang.fleet` reads ``--targets`` files and exposes per-target counters;
  :func:`ingest_dump` stores a saved dump.
* :mod:`~dspark_obs.sglang.engine_server` serves the embedded engine with SGLang's HTTP API.
* :mod:`~dspark_obs.sglang.drive` sends one seeded workload to a server and its companion.
* :mod:`~dspark_obs.sglang.profiles` builds the launch command lines of both servers.
* :mod:`~dspark_obs.sglang.records` holds the DecodeStepRecord / ReqDetail types and the fast
  parser; :mod:`~dspark_obs.sglang.files` the SPS profiler's step records.

Nothing here imports sglang (it needs CUDA): the project talks to it over HTTP and files.
"""

from importlib import import_module
from typing import Any

_HOME = {
    "Collector": "collector",
    "CollectorOptions": "collector",
    "ServerCollector": "collector",
    "ingest_dump": "ingest",
    "run_row": "ingest",
    "LaunchProfile": "profiles",
    "server_profiles": "profiles",
    "DecodeStepRecord": "records",
    "DumpError": "records",
    "ReqDetail": "records",
    "decode_server_info": "records",
}


def __getattr__(name: str) -> Any:
    """Import on first use: the engine server need not load the collector's analytics."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)


__all__ = [
    "Collector",
    "CollectorOptions",
    "DecodeStepRecord",
    "DumpError",
    "LaunchProfile",
    "ReqDetail",
    "ServerCollector",
    "decode_server_info",
    "ingest_dump",
    "run_row",
    "server_profiles",
]
