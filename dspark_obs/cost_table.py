"""Step-cost tables for the SPS-argmax verify budget, in SGLang 0.5.23's JSON formats.

Two shapes exist, told apart by the key ``"bias_seconds"`` (as SGLang's loader does):

* :class:`StepsPerSecTable` (1-D): ``{"sample_batch_tokens": [strictly increasing ints],
  "sample_steps_per_sec": [...], "max_batch_tokens": int}``. ``SPS(n)`` is a *floor* lookup:
  the value at the largest probe ``<= n`` (the first probe below the range). SGLang does not
  interpolate this table, so neither do we; ``step_seconds`` is ``1 / SPS(bs + budget)``.
* :class:`AdditiveCostTable`: ``{"bias_seconds" (> 0), "bs_probes", "alpha_seconds",
  "m_probes", "theta_seconds"}`` with ``T(bs, K) = bias + alpha(bs) + theta(bs + K)``, both
  terms linearly interpolated and clamped at the end probes.

The float arithmetic of the additive table follows SGLang's budget path operation by
operation (``(bias + alpha) + theta``, theta interpolated between bracketing probes with the
last segment used at the top end), so argmax ties resolve the same way as on a server.

Validation is stricter than SGLang's, each case named in its error: NaN and infinite numbers
are refused everywhere; steps-per-sec values must be > 0 (SGLang would accept them and then
predict an infinite step time); every probe (``sample_batch_tokens``, ``bs_probes``,
``m_probes``) must lie in 0..2**31, so a table with a negative probe is refused although
SGLang 0.5.23 accepts it (its tables check only that probes strictly increase; a batch size or
token count is never negative, so such a probe only shifts the interpolation); and an additive
table that predicts a step time <= 0 anywhere a step can reach is refused.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import statistics
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from dspark_obs._atomic import write_text_atomic
from dspark_obs._jsonfile import read_json_file

__all__ = [
    "AdditiveCostTable",
    "CostTable",
    "CostTableError",
    "StepsPerSecTable",
    "fit_additive",
]


class CostTableError(ValueError):
    """A cost-table file or dict is malformed; the message names the source and the problem."""


MAX_TOKENS = 2**31
"""Largest probe / ``max_batch_tokens`` accepted (far above any batch; keeps int64 safe)."""

MAX_SECONDS = 1e6
"""Largest magnitude of a seconds / steps-per-sec value accepted."""


def _fail(source: str, problem: str) -> CostTableError:
    return CostTableError(f"cost table {source}: {problem}")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else f"{text[:40]}... ({type(v).__name__})"


def _int_list(source: str, data: Mapping[str, Any], key: str) -> tuple[int, ...]:
    """A non-empty, strictly increasing list of ints (bools and floats refused, as msgspec does)."""
    raw = data[key]
    if not isinstance(raw, list) or not raw:
        raise _fail(source, f"{key!r} must be a non-empty list of ints, got {_short(raw)}")
    for i, v in enumerate(raw):
        if isinstance(v, bool) or not isinstance(v, int):
            raise _fail(source, f"{key!r} must hold ints, got {key}[{i}] = {_short(v)}")
        if not 0 <= v <= MAX_TOKENS:
            raise _fail(source, f"{key}[{i}] = {_short(v)} is outside 0..{MAX_TOKENS}")
    for a, b in zip(raw, raw[1:], strict=False):
        if b <= a:
            raise _fail(source, f"{key!r} must be strictly increasing, got {_short(raw)}")
    return tuple(raw)


def _float_list(source: str, data: Mapping[str, Any], key: str, n: int, probes: str) -> tuple:
    raw = data[key]
    if not isinstance(raw, list):
        raise _fail(source, f"{key!r} must be a list of numbers, got {_short(raw)}")
    if len(raw) != n:
        raise _fail(source, f"{key!r} has {len(raw)} values but {probes!r} has {n} probes")
    out = []
    for i, v in enumerate(raw):
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise _fail(source, f"{key!r} must hold numbers, got {key}[{i}] = {_short(v)}")
        if isinstance(v, float) and not math.isfinite(v):
            raise _fail(source, f"{key}[{i}] holds a non-finite number {v!r}")
        if not -MAX_SECONDS <= v <= MAX_SECONDS:  # compared exactly, also for huge ints
            raise _fail(source, f"{key}[{i}] = {_short(v)} is beyond +-{MAX_SECONDS:g}")
        out.append(float(v))
    return tuple(out)


def _require_keys(source: str, data: Mapping[str, Any], keys: Sequence[str]) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise _fail(source, f"missing key(s) {', '.join(repr(k) for k in missing)}")


class CostTable(ABC):
    """Predicted step time of one verify step as a function of (bs, extra verify tokens)."""

    KEYS: ClassVar[tuple[str, ...]]

    @abstractmethod
    def step_seconds(self, bs: int, budget: int) -> float:
        """Predicted seconds of a step with ``bs`` requests and ``budget`` extra verify tokens."""

    @abstractmethod
    def objective(self, bs: int, tau: np.ndarray) -> np.ndarray:
        """Predicted committed tokens per second for budgets ``b = 0..len(tau)-1``.

        ``tau[b]`` is the expected committed tokens at budget ``b``. Each kind uses SGLang's
        exact formula (``tau / T`` additive, ``tau * SPS`` 1-D) so float ties break alike.
        """

    @abstractmethod
    def predicted_step_seconds(self, bs: int, budgets: np.ndarray) -> np.ndarray:
        """Vectorized :meth:`step_seconds` over an int array of budgets."""

    @abstractmethod
    def _curve(self, bs: int, n: int) -> np.ndarray:
        """The kind's own per-budget curve for budgets 0..n-1 (step seconds, or steps/sec)."""

    _curves: dict[tuple[int, int], np.ndarray]

    def _kept_curve(self, bs: int, n: int) -> np.ndarray:
        """:meth:`_curve`, kept per (bs, n): the planner asks for the same curve at every step
        of a batch size (most of :meth:`objective`'s time at batch 256). Read-only, so no
        caller can change what the next step reads."""
        key = (int(bs), int(n))
        curve = self._curves.get(key)
        if curve is None:
            if len(self._curves) >= _MAX_CURVES:
                self._curves.clear()
            curve = self._curve(bs, n)
            curve.flags.writeable = False
            self._curves[key] = curve
        return curve

    extra: Mapping[str, Any]

    @property
    def uninitialized(self) -> bool:
        """SGLang's "uninitialized" (flat) table: the planner verifies everything."""
        return False

    @classmethod
    @abstractmethod
    def _fields(cls, data: Mapping[str, Any], source: str) -> dict[str, Any]:
        """Validated, normalized field values (tuples, floats) from a JSON-shaped mapping."""

    @classmethod
    def _parse(cls, data: Mapping[str, Any], source: str) -> CostTable:
        extra = {k: v for k, v in data.items() if k not in cls.KEYS}
        # the concrete dataclasses take their fields plus ``extra`` as keywords
        return cls(**cls._fields(data, source), extra=extra)  # type: ignore[call-arg]

    def __post_init__(self) -> None:
        # Direct construction gets the parser's checks; lists are normalized to tuples.
        vals = self._fields(self._known_dict(), f"<{type(self).__name__}>")
        for name, value in vals.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "extra", dict(self.extra))

    def _known_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in self.KEYS:
            value = getattr(self, key)
            out[key] = list(value) if isinstance(value, tuple | list) else value
        return out

    def to_dict(self) -> dict[str, Any]:
        """The SGLang JSON object (known keys in SGLang's order, then any unknown keys kept)."""
        out = self._known_dict()
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out

    @staticmethod
    def from_dict(data: Mapping[str, Any], *, source: str = "<dict>") -> CostTable:
        """Parse either shape; the presence of ``"bias_seconds"`` selects the additive one."""
        if not isinstance(data, Mapping):
            raise _fail(source, f"top level must be a JSON object, got {type(data).__name__}")
        if "bias_seconds" in data:
            return AdditiveCostTable._parse(data, source)
        return StepsPerSecTable._parse(data, source)

    @staticmethod
    def load(path: str | os.PathLike[str]) -> CostTable:
        """Read a table file written by SGLang's profiler, by :meth:`save`, or by hand."""
        return CostTable.from_dict(read_json_file(path, _FileError), source=str(path))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (temp file + rename), so a reader never sees half a table."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")


class _FileError(CostTableError):
    def __init__(self, message: str) -> None:
        super().__init__(f"cost table {message}")


@dataclass(frozen=True)
class StepsPerSecTable(CostTable):
    """SGLang's 1-D table: steps/sec sampled at total verify-token counts (floor lookup)."""

    sample_batch_tokens: tuple[int, ...]
    sample_steps_per_sec: tuple[float, ...]
    max_batch_tokens: int
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    _curves: dict[tuple[int, int], np.ndarray] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    KEYS: ClassVar[tuple[str, ...]] = (
        "sample_batch_tokens",
        "sample_steps_per_sec",
        "max_batch_tokens",
    )

    @classmethod
    def _fields(cls, data: Mapping[str, Any], source: str) -> dict[str, Any]:
        _require_keys(source, data, cls.KEYS)
        probes = _int_list(source, data, "sample_batch_tokens")
        sps = _float_list(source, data, "sample_steps_per_sec", len(probes), "sample_batch_tokens")
        if any(v <= 0 for v in sps):
            raise _fail(source, f"'sample_steps_per_sec' must all be > 0, got {list(sps)}")
        mbt = data["max_batch_tokens"]
        if isinstance(mbt, bool) or not isinstance(mbt, int) or not 0 <= mbt <= MAX_TOKENS:
            raise _fail(
                source, f"'max_batch_tokens' must be an int in 0..{MAX_TOKENS}, got {_short(mbt)}"
            )
        if mbt < probes[-1]:
            raise _fail(source, f"'max_batch_tokens' {mbt} is below the largest probe {probes[-1]}")
        return {"sample_batch_tokens": probes, "sample_steps_per_sec": sps, "max_batch_tokens": mbt}

    @property
    def uninitialized(self) -> bool:
        """At most one probe: SGLang's ``is_uninitialized_sps_table`` (compact verifies all)."""
        return len(self.sample_batch_tokens) <= 1

    def steps_per_sec(self, batch_tokens: int) -> float:
        """SPS at the largest probe ``<= batch_tokens``; the first probe below the range."""
        idx = bisect.bisect_right(self.sample_batch_tokens, batch_tokens) - 1
        return self.sample_steps_per_sec[max(0, min(idx, len(self.sample_batch_tokens) - 1))]

    def _sps_many(self, batch_tokens: np.ndarray) -> np.ndarray:
        probes = np.asarray(self.sample_batch_tokens, dtype=np.int64)
        idx = np.searchsorted(probes, batch_tokens, side="right") - 1
        idx = np.clip(idx, 0, len(probes) - 1)
        return np.asarray(self.sample_steps_per_sec, dtype=np.float64)[idx]

    def step_seconds(self, bs: int, budget: int) -> float:
        return 1.0 / self.steps_per_sec(bs + budget)

    def predicted_step_seconds(self, bs: int, budgets: np.ndarray) -> np.ndarray:
        return 1.0 / self._sps_many(bs + np.asarray(budgets, dtype=np.int64))

    def _curve(self, bs: int, n: int) -> np.ndarray:
        return self._sps_many(bs + np.arange(n, dtype=np.int64))

    def objective(self, bs: int, tau: np.ndarray) -> np.ndarray:
        return tau * self._kept_curve(bs, len(tau))


@dataclass(frozen=True)
class AdditiveCostTable(CostTable):
    """SGLang's additive table: ``T(bs, K) = bias + alpha(bs) + theta(bs + K)``."""

    bias_seconds: float
    bs_probes: tuple[int, ...]
    alpha_seconds: tuple[float, ...]
    m_probes: tuple[int, ...]
    theta_seconds: tuple[float, ...]
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    _curves: dict[tuple[int, int], np.ndarray] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    KEYS: ClassVar[tuple[str, ...]] = (
        "bias_seconds",
        "bs_probes",
        "alpha_seconds",
        "m_probes",
        "theta_seconds",
    )

    @classmethod
    def _fields(cls, data: Mapping[str, Any], source: str) -> dict[str, Any]:
        _require_keys(source, data, cls.KEYS)
        bias = data["bias_seconds"]
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise _fail(source, f"'bias_seconds' must be a number, got {_short(bias)}")
        if not 0 < bias <= MAX_SECONDS:
            raise _fail(source, f"'bias_seconds' must be finite and > 0, got {_short(bias)}")
        bs_probes = _int_list(source, data, "bs_probes")
        alpha = _float_list(source, data, "alpha_seconds", len(bs_probes), "bs_probes")
        m_probes = _int_list(source, data, "m_probes")
        theta = _float_list(source, data, "theta_seconds", len(m_probes), "m_probes")
        worst = _min_step(float(bias), bs_probes, alpha, m_probes, theta)
        if worst is not None:
            bs, m, sec = worst
            raise _fail(
                source,
                f"predicted step time T(bs={bs}, K={m - bs}) = bias + alpha + theta = "
                f"{sec:.6g} s is not > 0 (negative alpha_seconds / theta_seconds)",
            )
        return {
            "bias_seconds": float(bias),
            "bs_probes": bs_probes,
            "alpha_seconds": alpha,
            "m_probes": m_probes,
            "theta_seconds": theta,
        }

    def alpha_at(self, bs: float) -> float:
        """alpha(bs), linear between probes, clamped (end values returned exactly)."""
        xs, ys = self.bs_probes, self.alpha_seconds
        if bs <= xs[0]:
            return ys[0]
        if bs >= xs[-1]:
            return ys[-1]
        hi = bisect.bisect_right(xs, bs)
        lo = hi - 1
        frac = (bs - xs[lo]) / (xs[hi] - xs[lo])
        return ys[lo] + frac * (ys[hi] - ys[lo])

    def theta_at(self, m: np.ndarray | float) -> np.ndarray:
        """theta(M), linear between probes, clamped; the form SGLang's budget search uses."""
        xs = np.asarray(self.m_probes, dtype=np.float64)
        ys = np.asarray(self.theta_seconds, dtype=np.float64)
        mm = np.clip(np.asarray(m, dtype=np.float64), xs[0], xs[-1])
        if len(xs) == 1:
            return np.full_like(mm, ys[0])
        hi = np.clip(np.searchsorted(xs, mm, side="right"), 1, len(xs) - 1)
        lo = hi - 1
        span = np.maximum(xs[hi] - xs[lo], 1e-9)
        frac = (mm - xs[lo]) / span
        return ys[lo] + frac * (ys[hi] - ys[lo])

    def predicted_step_seconds(self, bs: int, budgets: np.ndarray) -> np.ndarray:
        floor = self.bias_seconds + self.alpha_at(float(bs))
        return floor + self.theta_at(bs + np.asarray(budgets, dtype=np.float64))

    def step_seconds(self, bs: int, budget: int) -> float:
        return float(self.predicted_step_seconds(bs, np.array([budget]))[0])

    def _curve(self, bs: int, n: int) -> np.ndarray:
        return self.predicted_step_seconds(bs, np.arange(n))

    def objective(self, bs: int, tau: np.ndarray) -> np.ndarray:
        step = self._kept_curve(bs, len(tau))
        with np.errstate(divide="ignore", invalid="ignore"):
            return tau / step


_MAX_CURVES = 1024
"""Curves a table keeps (one per batch size and candidate count seen)."""


def _min_step(
    bias: float,
    bs_probes: Sequence[int],
    alpha: Sequence[float],
    m_probes: Sequence[int],
    theta: Sequence[float],
) -> tuple[int, int, float] | None:
    """``(bs, M, T)`` where the table predicts a step time <= 0 for some bs >= 1, M >= bs.

    Both terms are piecewise linear and clamped, so the minimum over that region lies at a
    pair of breakpoints (of either term, or bs = 1) with M >= bs: evaluated exactly there.
    """
    pts = np.unique(np.concatenate(([1], bs_probes, m_probes)).astype(np.float64))
    pts = pts[pts >= 1]
    a = np.interp(pts, np.asarray(bs_probes, np.float64), np.asarray(alpha, np.float64))
    t = np.interp(pts, np.asarray(m_probes, np.float64), np.asarray(theta, np.float64))
    total = bias + a + np.minimum.accumulate(t[::-1])[::-1]  # best theta over M >= bs
    i = int(np.argmin(total))
    if total[i] > 0:
        return None
    return int(pts[i]), int(pts[i + int(np.argmin(t[i:]))]), float(total[i])


def fit_additive(samples: Iterable[tuple[int, int, float]], *, m_bin: int = 1) -> AdditiveCostTable:
    """Least-squares additive table from measured ``(bs, K, seconds)`` step samples.

    Why this shape: it is the model SGLang's profiler fits, so a table fit here can be fed to a
    server and vice versa. Samples are grouped into cells by ``(bs, M)`` (``M = bs + K``,
    rounded to a multiple of ``m_bin``) and each cell's median step time is used, which keeps
    a few slow outlier steps (GC, page faults) from bending the fit. The model is then
    ``T = bias + a[bs] + t[M]`` with one free value per distinct bs and per distinct M, the
    smallest bs and smallest M pinned to 0 (otherwise bias would not be identifiable), solved
    by ordinary least squares. Identifiability needs K varied at a fixed bs (pin budgets while
    profiling); with confounded samples ``lstsq`` returns the minimum-norm solution.
    Raises :class:`CostTableError` when there are no samples or the fitted bias is not > 0.
    """
    cells: dict[tuple[int, int], list[float]] = {}
    for bs, k, sec in samples:
        if bs < 1 or k < 0 or not math.isfinite(sec) or sec <= 0:
            raise _fail("<fit>", f"bad sample (bs={bs}, K={k}, seconds={sec})")
        m = bs + k
        if m_bin > 1:
            m = round(m / m_bin) * m_bin
        cells.setdefault((int(bs), int(m)), []).append(float(sec))
    if not cells:
        raise _fail("<fit>", "no samples")
    keys = sorted(cells)
    bs_levels = sorted({b for b, _ in keys})
    m_levels = sorted({m for _, m in keys})
    bs_col = {b: i for i, b in enumerate(bs_levels[1:])}
    m_col = {m: len(bs_col) + i for i, m in enumerate(m_levels[1:])}
    design = np.zeros((len(keys), 1 + len(bs_col) + len(m_col)))
    target = np.array([statistics.median(cells[key]) for key in keys])
    design[:, 0] = 1.0
    for row, (b, m) in enumerate(keys):
        if b in bs_col:
            design[row, 1 + bs_col[b]] = 1.0
        if m in m_col:
            design[row, 1 + m_col[m]] = 1.0
    beta = np.linalg.lstsq(design, target, rcond=None)[0]
    bias = float(beta[0])
    if not (math.isfinite(bias) and bias > 0):
        raise _fail("<fit>", f"fitted bias_seconds {bias!r} is not > 0; profile more cells")
    alpha = [0.0] + [float(beta[1 + bs_col[b]]) for b in bs_levels[1:]]
    theta = [0.0] + [float(beta[1 + m_col[m]]) for m in m_levels[1:]]
    return AdditiveCostTable(bias, tuple(bs_levels), tuple(alpha), tuple(m_levels), tuple(theta))
