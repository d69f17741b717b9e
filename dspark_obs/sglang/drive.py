"""``dspark-obs drive``: the same seeded workload to a server and its companion, stored.

A compact server and its cap-accept companion must see the same requests (same prompts,
same per-request sampling seeds, same rids) for the companion to expose the ceiling of the
compact run. Each request's meta_info and timings (send, first token, finish: TTFT and TPOT)
become ``requests`` rows under the run the collector stores the server's steps in, so the
store joins a server's step dump with its requests by ``(run_id, rid)``. The servers run one
after the other, so they do not compete for the machine.

The HTTP client and the load generator are the bench's (dspark_obs.serving).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dspark_obs.fanout import FanOut, RecordSink
from dspark_obs.serving.bench_records import bench_records, server_meta
from dspark_obs.serving.bench_stats import request_frame, summarize
from dspark_obs.serving.client import GenerationRequest, RequestResult, ServingClient
from dspark_obs.serving.loadgen import run_load

__all__ = ["DriveTarget", "drive"]


@dataclass(frozen=True)
class DriveTarget:
    """One server to drive and the run its requests are stored under."""

    url: str
    run_id: str


def drive(
    targets: Sequence[DriveTarget],
    requests: Sequence[GenerationRequest],
    sinks: Sequence[RecordSink],
    *,
    api: str = "sglang",
    concurrency: int = 4,
    request_rate: float = math.inf,
    seed: int = 0,
    on_done: Callable[[str, RequestResult], None] | None = None,
) -> dict[str, list[RequestResult]]:
    """Send ``requests`` to every target in turn; store one ``requests`` row per result."""
    fan = FanOut(sinks)
    out: dict[str, list[RequestResult]] = {}
    for target in targets:
        client = ServingClient(target.url, api=api)  # type: ignore[arg-type]
        client.wait_ready(timeout=60.0)
        info = client.server_info()
        done = None if on_done is None else (lambda r, run=target.run_id: on_done(run, r))
        load = run_load(
            client,
            requests,
            concurrency=concurrency,
            request_rate=request_rate,
            warmup=0,
            seed=seed,
            on_done=done,
        )
        summary = summarize(request_frame(load.results, load.start_clock), load.duration)
        _, rows = bench_records(
            target.run_id,
            list(requests),
            load.results,
            summary,
            {"url": target.url, "api": api, "seed": seed},
            server_meta(info),
        )
        fan.emit("requests", rows)
        out[target.run_id] = load.results
    return out  # the sinks are the caller's to close
