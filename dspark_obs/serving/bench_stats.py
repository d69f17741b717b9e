"""Benchmark statistics over per-request frames, with the seed campaign's definitions.

* TPOT excludes TTFT: (E2E - TTFT) / (output tokens - 1), per request (SGLang bench_serving).
* Output throughput = all output tokens / the benchmark's wall time (not a mean of rates).
* Peak throughput = the most output tokens in one fixed 1-second window aligned to the
  benchmark start, tokens counted at their chunk's arrival. It depends on where the window
  edges fall (about +-5% on a steady stream), so it is reported with its phase band (the
  peak's range over shifted window phases) and never optimized.
* Derived step time = mean TPOT x mean accept length: the time of one decode step, which A/B
  decisions use because it is stable across runs where TPOT and accept length co-vary.

Everything here is a pure function of a :func:`request_frame` (pandas) and token events.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from dspark_obs.serving.client import RequestResult

__all__ = [
    "PEAK_CAVEAT",
    "BenchSummary",
    "Distribution",
    "bootstrap_step_ratio",
    "distribution",
    "peak_phase_band",
    "peak_throughput",
    "request_frame",
    "summarize",
    "token_events",
    "window_counts",
]

PEAK_CAVEAT = (
    "peak throughput is a max over fixed 1-s windows aligned to the benchmark start; moving "
    "the window edges moves it (about +-5%, see the phase band): report it, never optimize it"
)

FRAME_COLUMNS = ("rid", "workload", "ok", "send_s", "ttft_s", "tpot_s", "e2e_s",
                 "completion_tokens", "accept_length", "spec_verify_ct")


def request_frame(results: Sequence[RequestResult], start_clock: float = 0.0) -> pd.DataFrame:
    """One row per request: times in seconds (``send_s`` after ``start_clock``)."""
    rows = [
        {
            "rid": r.rid,
            "workload": r.workload,
            "ok": r.ok,
            "send_s": r.send_clock - start_clock,
            "ttft_s": r.ttft,
            "tpot_s": r.tpot,
            "e2e_s": r.e2e,
            "completion_tokens": r.completion_tokens,
            "accept_length": r.accept_length,
            "spec_verify_ct": r.spec.get("spec_verify_ct"),
        }
        for r in results
    ]
    frame = pd.DataFrame(rows, columns=list(FRAME_COLUMNS))
    for col in ("ttft_s", "tpot_s", "e2e_s", "accept_length", "spec_verify_ct"):
        frame[col] = pd.to_numeric(frame[col], errors="coerce").astype(float)
    return frame


def token_events(results: Sequence[RequestResult], start_clock: float) -> np.ndarray:
    """``[n, 2]`` array of (seconds after start, new tokens): every chunk of every request."""
    parts = [
        np.column_stack([r.send_clock - start_clock + np.asarray(r.chunk_times, float),
                         np.asarray(r.chunk_tokens, float)])
        for r in results if r.ok and r.chunk_times
    ]
    return np.concatenate(parts) if parts else np.zeros((0, 2))


def window_counts(events: np.ndarray, window: float = 1.0, phase: float = 0.0) -> np.ndarray:
    """Tokens per fixed window; edges at ``phase + k*window`` (0 <= phase < window).

    With ``phase > 0`` the stretch before the first edge is its own (short) window.
    """
    if window <= 0:
        raise ValueError(f"window must be > 0, got {window}")
    if len(events) == 0:
        return np.zeros(0)
    t, n = events[:, 0], events[:, 1]
    index = np.floor((t - phase) / window).astype(np.int64) + (1 if phase > 0 else 0)
    index = np.maximum(index, 0)
    return np.bincount(index, weights=n)


def peak_throughput(events: np.ndarray, window: float = 1.0, phase: float = 0.0) -> float:
    """Most tokens in one fixed window, per second."""
    counts = window_counts(events, window, phase)
    return float(counts.max() / window) if counts.size else 0.0


def peak_phase_band(events: np.ndarray, window: float = 1.0,
                    phases: int = 10) -> tuple[float, float]:
    """(min, max) of the peak over ``phases`` equally spaced window phases."""
    peaks = [peak_throughput(events, window, window * k / phases) for k in range(phases)]
    return min(peaks), max(peaks)


@dataclass(frozen=True)
class Distribution:
    n: int
    mean: float
    median: float
    p99: float


def distribution(values: Sequence[float] | np.ndarray | pd.Series) -> Distribution:
    """n, mean, median and p99 of the finite values (NaN when there are none)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return Distribution(0, math.nan, math.nan, math.nan)
    return Distribution(int(v.size), float(v.mean()), float(np.median(v)),
                        float(np.percentile(v, 99)))


@dataclass(frozen=True)
class BenchSummary:
    """The figures of one benchmark run (times in ms, throughputs in tokens/s)."""

    completed: int
    failed: int
    duration_s: float
    output_tokens: int
    output_throughput: float
    request_throughput: float
    peak_output_throughput: float
    peak_phase_band: tuple[float, float]
    ttft_ms: Distribution
    tpot_ms: Distribution
    e2e_ms: Distribution
    accept_length: Distribution  # per-request committed tokens per verify step
    accept_length_pooled: float  # all output tokens / all verify steps
    derived_step_ms: float  # mean TPOT x mean accept length

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> BenchSummary:
        data = dict(data)
        for key in ("ttft_ms", "tpot_ms", "e2e_ms", "accept_length"):
            data[key] = Distribution(**data[key])
        data["peak_phase_band"] = tuple(data["peak_phase_band"])
        return cls(**data)


def _ms(seconds: pd.Series) -> Distribution:
    return distribution(seconds * 1000.0)


def summarize(frame: pd.DataFrame, duration_s: float,
              events: np.ndarray | None = None) -> BenchSummary:
    """Summary of a :func:`request_frame`; ``events`` (:func:`token_events`) for the peak."""
    ok = frame[frame["ok"].astype(bool)]
    tokens = int(ok["completion_tokens"].sum())
    tpot = _ms(ok["tpot_s"])
    acc = distribution(ok["accept_length"])
    verify = ok["spec_verify_ct"].sum()
    pooled = float(tokens / verify) if verify > 0 else math.nan
    events = np.zeros((0, 2)) if events is None else events
    return BenchSummary(
        completed=len(ok),
        failed=len(frame) - len(ok),
        duration_s=float(duration_s),
        output_tokens=tokens,
        output_throughput=tokens / duration_s if duration_s > 0 else math.nan,
        request_throughput=len(ok) / duration_s if duration_s > 0 else math.nan,
        peak_output_throughput=peak_throughput(events),
        peak_phase_band=peak_phase_band(events),
        ttft_ms=_ms(ok["ttft_s"]),
        tpot_ms=tpot,
        e2e_ms=_ms(ok["e2e_s"]),
        accept_length=acc,
        accept_length_pooled=pooled,
        derived_step_ms=tpot.mean * acc.mean if acc.n else math.nan,
    )


def _step_time(tpot: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """Derived step time per bootstrap row: mean TPOT x mean accept length (rows x requests)."""
    return np.nanmean(tpot, axis=-1) * np.nanmean(acc, axis=-1)


def bootstrap_step_ratio(
    base: pd.DataFrame,
    new: pd.DataFrame,
    *,
    reps: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Derived step time NEW / BASE: (point, lo, hi), a percentile bootstrap over requests.

    Requests are resampled with replacement within each side, each request keeping its own
    (TPOT, accept length) pair. A side without accept lengths uses accept length 1.
    """
    rng = np.random.default_rng(seed)

    def side(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
        ok = frame[frame["ok"].astype(bool) & frame["tpot_s"].notna()]
        tpot = ok["tpot_s"].to_numpy(float)
        acc = ok["accept_length"].to_numpy(float)
        if not np.isfinite(acc).any():
            acc = np.ones_like(tpot)
        if tpot.size == 0:
            raise ValueError("no request with a TPOT (need >= 2 output tokens) on one side")
        return tpot, acc

    (bt, ba), (nt, na) = side(base), side(new)
    point = float(_step_time(nt, na) / _step_time(bt, ba))
    bi = rng.integers(0, bt.size, size=(reps, bt.size))
    ni = rng.integers(0, nt.size, size=(reps, nt.size))
    ratios = _step_time(nt[ni], na[ni]) / _step_time(bt[bi], ba[bi])
    alpha = (1.0 - level) / 2.0
    lo, hi = np.nanquantile(ratios, [alpha, 1.0 - alpha])
    return point, float(lo), float(hi)
