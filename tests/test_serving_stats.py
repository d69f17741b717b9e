"""Benchmark statistics on crafted timelines: peak windows, TPOT, throughput, bootstrap."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from dspark_obs.serving.bench_stats import (
    BenchSummary,
    bootstrap_step_ratio,
    distribution,
    peak_phase_band,
    peak_throughput,
    request_frame,
    summarize,
    token_events,
    window_counts,
)
from dspark_obs.serving.client import RequestResult


def _result(rid, send_clock, chunk_times, chunk_tokens, end, verify_ct=None):
    r = RequestResult(rid=rid, send_time=1000.0 + send_clock, send_clock=send_clock, ok=True,
                      chunk_times=list(chunk_times), chunk_tokens=list(chunk_tokens),
                      end_time=end, completion_tokens=sum(chunk_tokens))
    if verify_ct is not None:
        r.spec["spec_verify_ct"] = verify_ct
    return r


def test_peak_is_max_over_fixed_one_second_windows():
    # Tokens at 0.1 (5), 0.9 (5), 1.2 (3), 2.5 (20), 2.99 (1): windows [0,1) 10, [1,2) 3, [2,3) 21.
    events = np.array([[0.1, 5], [0.9, 5], [1.2, 3], [2.5, 20], [2.99, 1]], float)
    assert window_counts(events).tolist() == [10, 3, 21]
    assert peak_throughput(events) == 21
    # Shift the edges by 0.5 s: (-0.5,0.5) 5, [0.5,1.5) 8, [1.5,2.5) 0 ... [2.5,3.5) 21.
    assert window_counts(events, phase=0.5).tolist() == [5, 8, 0, 21]
    # A 2-s window: [0,2) 13, [2,4) 21 -> 10.5 tok/s.
    assert peak_throughput(events, window=2.0) == 10.5
    assert peak_throughput(np.zeros((0, 2))) == 0.0
    with pytest.raises(ValueError):
        window_counts(events, window=0)


def test_phase_band_of_a_steady_stream_brackets_its_rate():
    # 100 tok/s as one token every 10 ms, plus a burst that a phase shift splits.
    t = np.arange(0, 5, 0.01)
    events = np.column_stack([t, np.ones_like(t)])
    events = np.vstack([events, [[2.95, 30], [3.05, 30]]])
    lo, hi = peak_phase_band(events, phases=10)
    assert hi == pytest.approx(160, abs=1)  # both halves of the burst in one window
    assert lo == pytest.approx(130, abs=1)  # an edge at 3.0 splits it
    assert lo <= peak_throughput(events) <= hi


def test_events_line_up_requests_by_send_clock():
    a = _result("a", 10.0, [0.5, 0.7], [1, 2], 0.8)
    b = _result("b", 10.6, [0.1], [4], 0.2)
    events = token_events([a, b], start_clock=10.0)
    assert events.tolist() == [[0.5, 1], [0.7, 2], [pytest.approx(0.7), 4]]


def test_summary_definitions():
    # Request a: TTFT 0.5, 5 tokens, end 0.9 -> TPOT (0.9-0.5)/4 = 0.1; 2 verify steps.
    # Request b: TTFT 0.2, 3 tokens, end 0.6 -> TPOT 0.2; 3 verify steps.
    a = _result("a", 0.0, [0.5, 0.7, 0.9], [1, 2, 2], 0.9, verify_ct=2)
    b = _result("b", 1.0, [0.2, 0.4, 0.6], [1, 1, 1], 0.6, verify_ct=3)
    c = RequestResult(rid="c", send_time=0, send_clock=0.5, ok=False, error="boom")
    frame = request_frame([a, b, c], start_clock=0.0)
    s = summarize(frame, duration_s=2.0, events=token_events([a, b], 0.0))
    assert (s.completed, s.failed, s.output_tokens) == (2, 1, 8)
    assert s.output_throughput == 4.0  # all output tokens / wall time
    assert s.tpot_ms.mean == pytest.approx(150.0) and s.tpot_ms.median == pytest.approx(150.0)
    assert s.ttft_ms.mean == pytest.approx(350.0)
    assert s.accept_length.mean == pytest.approx((2.5 + 1.0) / 2)
    assert s.accept_length_pooled == pytest.approx(8 / 5)
    assert s.derived_step_ms == pytest.approx(150.0 * 1.75)
    assert s.peak_output_throughput == 5  # [0,1): a's 5 tokens; [1,2): b's 3
    assert BenchSummary.from_dict(s.to_dict()) == s


def test_single_token_requests_have_no_tpot():
    r = _result("x", 0.0, [0.3], [1], 0.3)
    assert r.tpot is None
    assert math.isnan(summarize(request_frame([r]), 1.0).tpot_ms.mean)
    assert distribution([1.0, float("nan"), 3.0]).n == 2


def test_bootstrap_ratio_recovers_a_known_slowdown():
    rng = np.random.default_rng(0)
    n = 40
    base = pd.DataFrame({"ok": True, "tpot_s": rng.normal(0.05, 0.002, n),
                         "accept_length": rng.normal(2.0, 0.1, n)})
    new = base.assign(tpot_s=base["tpot_s"] * 1.5)
    point, lo, hi = bootstrap_step_ratio(base, new, reps=500)
    assert point == pytest.approx(1.5, rel=0.02)
    assert lo < point < hi and lo > 1.3 and hi < 1.7
    same = bootstrap_step_ratio(base, base.copy(), reps=500)
    assert same[1] < 1.0 < same[2]
    with pytest.raises(ValueError, match="no request with a TPOT"):
        bootstrap_step_ratio(base, base.assign(tpot_s=np.nan))
