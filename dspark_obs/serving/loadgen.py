"""Load generation: warm-up, then requests at a request rate under a concurrency cap.

Arrivals are a Poisson process of ``request_rate`` requests/s (seeded; ``inf`` sends all
at once), and at most ``concurrency`` requests are in flight: a request that arrives while
all slots are busy waits for one (its send time, not its arrival, starts its TTFT, as in
SGLang's bench_serving). Warm-up requests run one by one before the clock starts and are
left out of every figure.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from dspark_obs.serving.client import ClientError, GenerationRequest, RequestResult, ServingClient

__all__ = ["LoadPlan", "LoadResult", "arrival_offsets", "run_load"]


@dataclass(frozen=True)
class LoadPlan:
    """How a benchmark sends its requests: :func:`run_load`'s settings, as one value that a
    bench run or a gate round passes on."""

    concurrency: int = 1
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf: all at once
    warmup: int = 1
    seed: int = 0  # of the arrival times


@dataclass
class LoadResult:
    """The measured requests (in request order) and the benchmark's wall time."""

    results: list[RequestResult]
    start_time: float  # epoch seconds when the clock started
    start_clock: float  # time.perf_counter() then
    duration: float  # seconds from the clock start to the last request's end
    concurrency: int
    request_rate: float
    warmup: list[RequestResult] = field(default_factory=list)


def arrival_offsets(n: int, request_rate: float, seed: int = 0) -> np.ndarray:
    """Seconds after the start at which each of ``n`` requests arrives (Poisson, seeded)."""
    if request_rate <= 0 or math.isnan(request_rate):
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if math.isinf(request_rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def run_load(
    client: ServingClient,
    requests: Sequence[GenerationRequest],
    *,
    concurrency: int = 1,
    request_rate: float = math.inf,
    warmup: int = 1,
    seed: int = 0,
    on_done: Callable[[RequestResult], None] | None = None,
) -> LoadResult:
    """Run ``warmup`` copies of the first requests, then all ``requests`` under load.

    Raises ClientError when a warm-up request fails (the server is not serving); a failed
    measured request is kept with ``ok=False`` and its error.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    warm = []
    for i in range(warmup):
        base = requests[i % len(requests)]
        res = client.generate(replace(base, rid=f"{base.rid}-warmup{i}"))
        if not res.ok:
            raise ClientError(f"warm-up request to {client.url} failed: {res.error}")
        warm.append(res)

    offsets = arrival_offsets(len(requests), request_rate, seed)
    results: list[RequestResult | None] = [None] * len(requests)
    lock = threading.Lock()

    def one(i: int) -> None:
        res = client.generate(requests[i])
        results[i] = res
        if on_done is not None:
            with lock:
                on_done(res)

    start_time, start_clock = time.time(), time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = []
        for i, offset in enumerate(offsets):
            delay = start_clock + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one, i))
        for f in futures:
            f.result()
    done = [r for r in results if r is not None]
    end = max((r.send_clock + r.end_time for r in done), default=start_clock)
    return LoadResult(done, start_time, start_clock, end - start_clock, concurrency,
                      request_rate, warm)
