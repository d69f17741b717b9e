"""Serving benchmarks over HTTP: the streaming client, workloads, load, stats and the A/B gate.

Against any SGLang or OpenAI-compatible server (``dspark-obs engine-server`` included):
:class:`ServingClient` streams one request and times it; :func:`run_bench` runs a workload
under load and summarizes it (:class:`BenchSummary`); :func:`gate_servers` and
:func:`gate_stored` run the correctness gate and the performance verdict (:class:`GateReport`).
"""

from .client import SPEC_FIELDS, ClientError, GenerationRequest, RequestResult, ServingClient
from .gate import GateCheck, GateReport
from .runner import BenchRun, GateOptions, gate_servers, gate_stored, run_bench
from .stats import PEAK_CAVEAT, BenchSummary, Distribution
from .workloads import BENCH_WORKLOADS, build_requests

__all__ = [
    "BENCH_WORKLOADS",
    "PEAK_CAVEAT",
    "SPEC_FIELDS",
    "BenchRun",
    "BenchSummary",
    "ClientError",
    "Distribution",
    "GateCheck",
    "GateOptions",
    "GateReport",
    "GenerationRequest",
    "RequestResult",
    "ServingClient",
    "build_requests",
    "gate_servers",
    "gate_stored",
    "run_bench",
]
