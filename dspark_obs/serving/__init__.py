"""Serving benchmarks over HTTP: the streaming client, bench requests, load, stats, the A/B gate.

Against any SGLang or OpenAI-compatible server (``dspark-obs engine-server`` included):
:class:`ServingClient` streams one request and times it; :func:`run_bench` runs a workload
under load and summarizes it (:class:`BenchSummary`); :func:`gate_servers` and
:func:`gate_stored` run the correctness gate and the performance verdict (:class:`GateReport`).
"""

from dspark_obs.serving.bench_requests import BENCH_WORKLOADS, build_requests, requests_from_traffic
from dspark_obs.serving.bench_stats import PEAK_CAVEAT, BenchSummary, Distribution
from dspark_obs.serving.client import (
    SPEC_FIELDS,
    ClientError,
    GenerationRequest,
    RequestResult,
    ServingClient,
)
from dspark_obs.serving.gate import GateCheck, GateReport
from dspark_obs.serving.loadgen import LoadPlan, run_load
from dspark_obs.serving.runner import BenchRun, GateOptions, gate_servers, gate_stored, run_bench

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
    "LoadPlan",
    "RequestResult",
    "ServingClient",
    "build_requests",
    "gate_servers",
    "gate_stored",
    "requests_from_traffic",
    "run_bench",
    "run_load",
]
