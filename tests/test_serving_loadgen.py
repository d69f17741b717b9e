"""Load generation over real HTTP: the concurrency cap, Poisson arrivals, warm-up excluded."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_serving_fakeserver import FakeServer

from dspark_obs.serving import GenerationRequest, ServingClient
from dspark_obs.serving.loadgen import arrival_offsets, run_load


def _requests(n: int) -> list[GenerationRequest]:
    return [GenerationRequest(rid=f"q{i}", input_ids=[i + 1], max_new_tokens=4) for i in range(n)]


def _max_in_flight(load) -> int:
    spans = [(r.send_clock - load.start_clock, r.send_clock - load.start_clock + r.e2e)
             for r in load.results]
    return max(sum(s <= t < e for s, e in spans) for t, _ in spans)


def test_concurrency_caps_requests_in_flight():
    with FakeServer(ttft_s=0.1, step_s=0.05, accept=(2,)) as server:
        client = ServingClient(server.url)
        capped = run_load(client, _requests(6), concurrency=2, warmup=1)
        wide = run_load(client, _requests(6), concurrency=6, warmup=0)
        sent = [r["rid"] for r in server.requests]
    assert [r.rid for r in capped.results] == [f"q{i}" for i in range(6)]
    assert all(r.ok for r in capped.results) and len(capped.warmup) == 1
    assert sent[0] == "q0-warmup0" and sent.count("q0-warmup0") == 1  # warm-up: first, once
    assert _max_in_flight(capped) == 2 and _max_in_flight(wide) == 6


def test_poisson_arrivals_are_seeded_and_paced():
    a = arrival_offsets(200, 4.0, seed=1)
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    assert np.array_equal(a, arrival_offsets(200, 4.0, seed=1))
    assert np.mean(np.diff(a)) == pytest.approx(0.25, rel=0.2)
    assert not arrival_offsets(5, math.inf).any()
    with pytest.raises(ValueError, match="request_rate"):
        arrival_offsets(3, 0.0)
    with FakeServer() as server:
        load = run_load(ServingClient(server.url), _requests(4), concurrency=4,
                        request_rate=10.0, warmup=0, seed=3)
    offsets = [r.send_clock - load.start_clock for r in load.results]
    expected = arrival_offsets(4, 10.0, seed=3)
    assert offsets == sorted(offsets)  # sent in arrival order
    assert all(o >= e - 1e-3 for o, e in zip(offsets, expected, strict=True))  # never early
