"""Cost tables fitted from measured step times, in SGLang's two formats.

* the additive table ``T(bs, K) = bias + alpha(bs) + theta(bs + K)`` (:func:`fit_table`),
  which is what the scheduler loads by default, and
* the 1-D steps-per-sec table ``SPS(n)``, a floor lookup on ``n = bs + K``
  (:func:`fit_steps_per_sec`), the shape SGLang's diagonal profile writes.

The unit of data is the *cell* (one ``(bs, fraction)`` run, summarized by its median step):
steps of one cell share their batch, prompts and cache state, so fits are judged on whole
held-out cells (:func:`split_cells`; scoring is :mod:`dspark_obs.engine.profile_report`).
Numpy only: fitting needs neither torch nor the engine.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dspark_obs.cost_table import AdditiveCostTable, CostTable, CostTableError, StepsPerSecTable

Cell = tuple[int, float]
"""One profiled configuration: ``(batch size, forced budget fraction)``."""


@dataclass(frozen=True)
class StepSample:
    """One measured decode step: its cell, the extra verify tokens ``k`` it sent, its time."""

    bs: int
    frac: float
    k: int
    seconds: float

    @property
    def cell(self) -> Cell:
        return (self.bs, self.frac)


@dataclass(frozen=True)
class CellStat:
    """A cell's summary: median step time (robust to GC / page-fault outliers) at its ``k``."""

    bs: int
    frac: float
    k: int  # the cell's extra verify tokens (lower median over its steps; normally all equal)
    steps: int
    seconds: float

    @property
    def batch_tokens(self) -> int:
        return self.bs + self.k


def cell_stats(samples: Sequence[StepSample]) -> dict[Cell, CellStat]:
    """Per-cell medians, sorted by cell: the unit that fits are judged on."""
    groups: dict[Cell, list[StepSample]] = {}
    for s in samples:
        groups.setdefault(s.cell, []).append(s)
    return {
        cell: CellStat(
            bs=cell[0],
            frac=cell[1],
            k=int(statistics.median_low(s.k for s in group)),
            steps=len(group),
            seconds=statistics.median(s.seconds for s in group),
        )
        for cell, group in sorted(groups.items())
    }


def split_cells(
    cells: Sequence[Cell], holdout: float = 0.25, seed: int = 0
) -> tuple[list[Cell], list[Cell]]:
    """``(train, held_out)``: a seeded random ``holdout`` share of whole cells, both sorted.

    Whole cells, because steps of one cell are near-copies of each other: holding out single
    steps would test the fit on points it was trained on. At least one cell stays on each
    side when there are two or more (and ``holdout > 0``); the order of ``cells`` is ignored.
    """
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    ordered = sorted(set(cells))
    n_test = round(holdout * len(ordered))
    if holdout > 0 and len(ordered) >= 2:
        n_test = min(max(n_test, 1), len(ordered) - 1)
    pick = np.random.default_rng(seed).permutation(len(ordered))[:n_test]
    test = sorted(ordered[i] for i in pick)
    chosen = set(test)
    return [c for c in ordered if c not in chosen], test


def fit_table(
    samples: Sequence[StepSample], m_bin: int = 4, smooth: float = 1e-3
) -> AdditiveCostTable:
    """Least-squares additive table ``T = bias + alpha(bs) + theta(bs + K)`` from step samples.

    The model and cell medians are :func:`~dspark_obs.cost_table.fit_additive`'s (SGLang's
    profiler fits the same shape); three things differ, each found on held-out cells of
    synthetic and real (H200, CPU) profiles, see tests/test_profile.py:

    * theta's probes are multiples of ``m_bin`` clamped to the measured M range, and each cell
      enters theta at its *own* M with the table's interpolation weights, instead of being
      rounded onto a probe: the fit scores the table as the scheduler reads it.
    * Pinned budgets give M = bs * (1 + gamma * frac), so the largest batches reach M no
      smaller batch does; there alpha(bs) and theta trade off freely. A tiny penalty on
      theta's curvature (``smooth``, relative to the data) picks the smoothest of the equally
      good fits, i.e. theta continues its slope, instead of lstsq's minimum-norm guess.
    * theta is made non-decreasing (more verify tokens never look cheaper) by a weighted
      isotonic fit and bias + alpha are then refit, rather than a running maximum, which
      lifts every later probe to one high probe (it wrecked an H200 profile: R^2 0.88 -> -0.1).
    """
    keys, target = _additive_cells(samples)
    bs_levels = sorted({b for b, _ in keys})
    probes = _theta_probes([m for _, m in keys], m_bin)
    weights = np.array([_interp_weights(probes, m) for _, m in keys])  # cells x theta probes
    theta = _smooth_theta(keys, target, weights, probes, smooth)
    theta = isotonic_nondecreasing(theta, weights.sum(axis=0))
    theta -= theta[0]
    level = _levels(keys, target - weights @ theta)  # bias + alpha(bs), refit to theta
    bias = level[bs_levels[0]]
    if not (math.isfinite(bias) and bias > 0):
        raise CostTableError(f"cost table <fit>: fitted bias_seconds {bias!r} is not > 0")
    alpha = tuple(level[b] - bias for b in bs_levels)
    return AdditiveCostTable(
        bias, tuple(bs_levels), alpha, tuple(probes), tuple(float(v) for v in theta)
    )


def _theta_probes(ms: Sequence[int], m_bin: int) -> list[int]:
    """Multiples of ``m_bin`` near the measured M, the end ones moved onto the measured ends."""
    lo, hi = min(ms), max(ms)
    return sorted({min(max(round(m / m_bin) * m_bin, lo), hi) for m in ms})


def _smooth_theta(
    keys: Sequence[tuple[int, int]],
    target: np.ndarray,
    weights: np.ndarray,
    probes: Sequence[int],
    smooth: float,
) -> np.ndarray:
    """theta (first probe 0) of ``T = bias + alpha[bs] + weights @ theta``, curvature-penalized."""
    bs_levels = sorted({b for b, _ in keys})
    n_alpha = len(bs_levels) - 1
    col = {b: 1 + i for i, b in enumerate(bs_levels[1:])}
    design = np.zeros((len(keys), 1 + n_alpha + weights.shape[1] - 1))
    design[:, 0] = 1.0
    for row, (b, _) in enumerate(keys):
        if b in col:
            design[row, col[b]] = 1.0
    design[:, 1 + n_alpha :] = weights[:, 1:]
    curvature = _curvature_rows(probes)
    penalty = np.zeros((len(curvature), design.shape[1]))
    penalty[:, 1 + n_alpha :] = curvature[:, 1:] * smooth * math.sqrt(len(keys))
    lhs = np.vstack([design, penalty])
    rhs = np.concatenate([target, np.zeros(len(penalty))])
    beta = np.linalg.lstsq(lhs, rhs, rcond=None)[0]
    return np.concatenate(([0.0], beta[1 + n_alpha :]))


def _levels(keys: Sequence[tuple[int, int]], resid: np.ndarray) -> dict[int, float]:
    """Mean residual per batch size: least squares for ``bias + alpha(bs)`` with theta fixed."""
    bs_of = np.array([b for b, _ in keys])
    return {int(b): float(resid[bs_of == b].mean()) for b in np.unique(bs_of)}


def _additive_cells(samples: Sequence[StepSample]) -> tuple[list[tuple[int, int]], np.ndarray]:
    """Sorted ``(bs, M)`` keys and their median step seconds; bad samples are refused."""
    cells: dict[tuple[int, int], list[float]] = {}
    for s in samples:
        if s.bs < 1 or s.k < 0 or not math.isfinite(s.seconds) or s.seconds <= 0:
            raise CostTableError(f"cost table <fit>: bad sample {s}")
        cells.setdefault((s.bs, s.bs + s.k), []).append(s.seconds)
    if not cells:
        raise CostTableError("cost table <fit>: no samples")
    keys = sorted(cells)
    return keys, np.array([statistics.median(cells[k]) for k in keys])


def _interp_weights(probes: Sequence[int], m: int) -> np.ndarray:
    """``w`` with ``w @ values`` = linear interpolation at ``m``, clamped (as ``theta_at``)."""
    return np.array([np.interp(m, probes, np.eye(len(probes))[j]) for j in range(len(probes))])


def _curvature_rows(probes: Sequence[int]) -> np.ndarray:
    """One row per inner probe: the change of theta's slope there, times the mean spacing."""
    p = np.asarray(probes, dtype=np.float64)
    if len(p) < 3:
        return np.zeros((0, len(p)))
    spacing = (p[-1] - p[0]) / (len(p) - 1)
    rows = np.zeros((len(p) - 2, len(p)))
    for i in range(len(p) - 2):
        left, right = p[i + 1] - p[i], p[i + 2] - p[i + 1]
        rows[i, i : i + 3] = (1 / left, -1 / left - 1 / right, 1 / right)
    return rows * spacing


def isotonic_nondecreasing(values: Sequence[float], weights: Sequence[float]) -> np.ndarray:
    """Weighted least-squares non-decreasing fit to ``values`` (pool adjacent violators)."""
    blocks: list[tuple[float, float, int]] = []  # (mean, weight, members)
    for v, w in zip(values, weights, strict=True):
        blocks.append((float(v), float(w), 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append(((v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2))
    return np.repeat([b[0] for b in blocks], [b[2] for b in blocks])


def fit_steps_per_sec(samples: Sequence[StepSample], *, fill: bool = True) -> StepsPerSecTable:
    """SGLang's 1-D table ``SPS(n)``, ``n = bs + K``, from per-cell medians.

    Each distinct ``n`` gets the median steps/s of the cells that ran at it (cells of several
    batch sizes can share one ``n``; merging them keeps the probes strictly increasing). The
    step times ``1 / SPS`` are then made non-decreasing in ``n`` (isotonic, weighted by cell
    count), so a larger batch never looks faster to the budget search.

    Why ``fill``: SGLang looks this table up by *floor* (largest probe ``<= n``), so with
    probes only at the measured ``n`` every batch between two probes is predicted as fast as
    the smaller one; the budget search then sees free tokens up to each next probe. ``n`` is
    an integer, so placing a probe at every integer between the first and last measured ``n``
    (step time linearly interpolated between measurements) turns the floor lookup into exact
    piecewise-linear interpolation, while the measured probes keep their fitted values.
    ``fill=False`` gives the sparse table SGLang's own fitter writes.
    """
    by_n: dict[int, list[float]] = {}
    for c in cell_stats(samples).values():
        by_n.setdefault(c.batch_tokens, []).append(1.0 / c.seconds)
    if not by_n:
        raise CostTableError("cost table <fit>: no samples")
    ns = sorted(by_n)
    seconds = isotonic_nondecreasing(
        [1.0 / statistics.median(by_n[n]) for n in ns], [len(by_n[n]) for n in ns]
    )
    probes = np.arange(ns[0], ns[-1] + 1) if fill else np.asarray(ns)
    filled = np.interp(probes, ns, seconds)
    return StepsPerSecTable(
        tuple(int(n) for n in probes),
        tuple(float(1.0 / t) for t in filled),
        int(probes[-1]),
    )


Fitter = Callable[[Sequence[StepSample]], CostTable]

FITTERS: Mapping[str, Fitter] = {"additive": fit_table, "steps_per_sec": fit_steps_per_sec}
"""The tables ``dspark-obs profile`` fits and saves, by report name."""
