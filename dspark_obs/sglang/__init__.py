"""SGLang integration: speak SGLang 0.5.23's DSpark surfaces in both directions.

* :mod:`~dspark_obs.sglang.collector` attaches to a running server (step dump, estimator
  JSONL, /metrics) and stores what it emits; :mod:`~dspark_obs.sglang.ranks` decides from
  the data which DP rank a reply is, what is new, restarts and lost ranges;
  :mod:`~dspark_obs.sglang.fleet` reads ``--targets`` files and exposes per-target counters;
  :func:`ingest_dump` stores a saved dump.
* :mod:`~dspark_obs.sglang.engine_server` serves the embedded engine with SGLang's HTTP API.
* :mod:`~dspark_obs.sglang.drive` sends one seeded workload to a server and its companion.
* :mod:`~dspark_obs.sglang.profiles` builds the launch command lines of both servers.
* :mod:`~dspark_obs.sglang.records` holds the DecodeStepRecord / ReqDetail types, the one
  step-dump encoder (``step_record``) and decoder (``decode_server_info``,
  ``records_to_tables``); :mod:`~dspark_obs.sglang.estimator_writer` the one estimator JSONL
  writer; :mod:`~dspark_obs.sglang.spec_stats` the ``meta_info`` counters and ``/metrics``
  gauges; :mod:`~dspark_obs.sglang.fetch` the deadline-bounded HTTP fetch;
  :mod:`~dspark_obs.sglang.files` the SPS profiler's step records.

Nothing here imports sglang (it needs CUDA): the project talks to it over HTTP and files.
The names below are the collector side's (no torch); the engine server and the driver are
imported from their modules (``dspark_obs.sglang.engine_server`` loads the torch engine,
which a collector on a serving host must not pay for).
"""

from dspark_obs.sglang.collector import Collector
from dspark_obs.sglang.ingest import ingest_dump, run_row
from dspark_obs.sglang.profiles import LaunchProfile, server_profiles
from dspark_obs.sglang.records import DecodeStepRecord, DumpError, ReqDetail, decode_server_info
from dspark_obs.sglang.server_collector import CollectorOptions, ServerCollector

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
