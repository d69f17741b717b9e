"""Profile the embedded engine's step time and fit SGLang's two cost-table formats.

Like SGLang's ``dspark_sps_profiler``: pin the budget to fractions of ``bs * gamma`` (the
scheduler's ``forced_budget_frac``), run real compact decode steps at several batch sizes,
take each step's measured time, and fit

* the additive table ``T(bs, K) = bias + alpha(bs) + theta(bs + K)`` (:func:`fit_table`),
  which is what the scheduler loads by default, and
* the 1-D steps-per-sec table ``SPS(n)``, a floor lookup on ``n = bs + K``
  (:func:`fit_steps_per_sec`), the shape SGLang's diagonal profile writes.

Fit quality is measured on whole held-out *cells* (one cell = one ``(bs, fraction)`` run),
not on single steps: steps of one cell share their batch, prompts and cache state, so a
step-level split would let the fit see its own test points. See :func:`evaluate_fits`.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from dspark_obs.engine.costs import AdditiveCostTable, CostTable, CostTableError, StepsPerSecTable
from dspark_obs.engine.loop import Engine, EngineConfig, GenRequest
from dspark_obs.fanout import FanOut, MemorySink

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


class Metrics(TypedDict):
    """Prediction error of a table over some cells (None where undefined, e.g. no cells)."""

    cells: int
    rms_ms: float | None
    r2: float | None
    median_rel_err: float | None


# --------------------------------------------------------------------------- measuring


def _run_cell(
    target: Any,
    drafter: Any,
    prompts: Sequence[list[int]],
    bs: int,
    frac: float,
    gamma: int,
    new_tokens: int,
    compile: bool = False,
) -> list[StepSample]:
    """Steps of one compact run at a pinned budget, full batch only, first step dropped."""
    reqs = [
        GenRequest(
            rid=f"p{i}",
            prompt_ids=list(prompts[i % len(prompts)]),
            max_new_tokens=new_tokens,
            seed=i,
        )
        for i in range(bs)
    ]
    config = EngineConfig(mode="compact", gamma=gamma, max_batch=bs, compile=compile)
    engine = Engine(target, drafter, config)
    engine.scheduler.forced_budget_frac = float(frac)
    sink = MemorySink()
    engine.run(reqs, FanOut([sink]).emit, f"profile-{bs}-{frac}")
    steps = sink.table("steps")
    if steps is None:
        return []
    frame = steps.to_pandas()
    full = frame[frame.bs == bs].iloc[1:]  # the first step pays one-off allocations
    # step_cpu_ms is the step's whole wall time (on CUDA the step synchronizes before it ends)
    return [
        StepSample(bs, float(frac), int(r.num_verify_tokens) - bs, float(r.step_cpu_ms) / 1000.0)
        for r in full.itertuples()
    ]


def profile_steps(
    target: Any,
    drafter: Any,
    prompts: Sequence[list[int]],
    *,
    gamma: int = 5,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    fractions: Sequence[float] = (0, 0.25, 0.5, 0.75, 1),
    new_tokens: int = 24,
    warmup: bool = True,
    compile: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[StepSample]:
    """Measured step samples from real compact steps over the ``batch_sizes x fractions`` grid.

    ``k`` is what the step really sent (``num_verify_tokens - bs``), which is the pinned
    budget unless some survival fell below the allocator's epsilon. With ``warmup`` one short
    untimed run goes first, so process-wide one-offs (allocator growth, CUDA kernel
    selection) do not land in the first cell.
    """
    if warmup:
        for bs in batch_sizes:  # CUDA graphs of every batch tier are captured here, untimed
            _run_cell(target, drafter, prompts, bs, max(fractions), gamma, 4, compile)
    samples: list[StepSample] = []
    grid = [(bs, float(frac)) for bs in batch_sizes for frac in fractions]
    for i, (bs, frac) in enumerate(grid, 1):
        cell = _run_cell(target, drafter, prompts, bs, frac, gamma, new_tokens, compile)
        samples += cell
        if progress:
            progress(f"[{i}/{len(grid)}] {_cell_line(bs, frac, cell)}")
    return samples


def _cell_line(bs: int, frac: float, cell: Sequence[StepSample]) -> str:
    if not cell:
        return f"bs={bs} frac={frac:g}: no full-batch steps after the first (raise --new-tokens)"
    ms = statistics.median(s.seconds for s in cell) * 1000.0
    k = statistics.median_low(s.k for s in cell)
    return f"bs={bs} frac={frac:g} K={k}: {len(cell)} steps, median {ms:.2f} ms"


def parse_batch_sizes(text: str) -> list[int]:
    """``--batch-sizes``: distinct ints >= 1, in the given order (the order cells run in)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError as exc:
        raise ValueError(f"--batch-sizes must be a comma list of ints, got {text!r}") from exc
    if min(values) < 1 or len(set(values)) != len(values):
        raise ValueError(f"--batch-sizes must list distinct ints >= 1, got {text!r}")
    return values


def parse_fractions(text: str) -> list[float]:
    """``--fractions``: distinct budget fractions in [0, 1] (what ``forced_budget_frac`` takes)."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError as exc:
        raise ValueError(f"--fractions must be a comma list of numbers, got {text!r}") from exc
    if any(not 0.0 <= v <= 1.0 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"--fractions must list distinct numbers in [0, 1], got {text!r}")
    return values


# --------------------------------------------------------------------------- cells and split


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


# --------------------------------------------------------------------------- fitting


def fit_table(
    samples: Sequence[StepSample], m_bin: int = 4, smooth: float = 1e-3
) -> AdditiveCostTable:
    """Least-squares additive table ``T = bias + alpha(bs) + theta(bs + K)`` from step samples.

    The model and cell medians are :func:`~dspark_obs.engine.costs.fit_additive`'s (SGLang's
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


# --------------------------------------------------------------------------- quality


def predict_cell(table: CostTable, cell: CellStat) -> float:
    """Predicted seconds of a step of ``cell`` (at the ``(bs, K)`` its steps ran at)."""
    return float(table.step_seconds(cell.bs, cell.k))


def fit_quality(samples: Sequence[StepSample], table: CostTable, cells: Sequence[Cell]) -> Metrics:
    """RMS error (ms), R^2 and median relative error of ``table`` over ``cells``.

    Each cell counts once, measured by its median step time, so long cells (many cheap
    steps) do not outweigh short ones; R^2 is None with fewer than two distinct cell times.
    """
    stats = cell_stats(samples)
    rows = [stats[c] for c in cells if c in stats]
    if not rows:
        return Metrics(cells=0, rms_ms=None, r2=None, median_rel_err=None)
    meas = np.array([r.seconds for r in rows])
    pred = np.array([predict_cell(table, r) for r in rows])
    resid = pred - meas
    ss_tot = float(np.sum((meas - meas.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid**2)) / ss_tot if len(rows) > 1 and ss_tot > 0 else None
    return Metrics(
        cells=len(rows),
        rms_ms=float(np.sqrt(np.mean(resid**2)) * 1000.0),
        r2=r2,
        median_rel_err=float(np.median(np.abs(resid) / meas)),
    )


@dataclass(frozen=True)
class TableFit:
    """One table kind: fit on the training cells (judged) and on all cells (saved)."""

    name: str
    table: CostTable  # fit on every cell: the one to save
    split_table: CostTable | None  # fit on the training cells only; None if that fit failed
    held_out: Metrics
    in_sample: Metrics  # split_table on its own training cells
    all_cells: Metrics  # table on every cell
    error: str | None = None  # why split_table is None


@dataclass(frozen=True)
class FitReport:
    """Everything ``profile`` reports: the split, and per table kind its fits and metrics."""

    samples: list[StepSample]
    cells: dict[Cell, CellStat]
    train: list[Cell]
    held_out: list[Cell]
    fits: dict[str, TableFit]
    holdout: float
    seed: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: metrics per table, one row per cell with its predictions, all samples."""
        test = set(self.held_out)
        rows = []
        for cell, stat in self.cells.items():
            row: dict[str, Any] = {
                "bs": stat.bs,
                "frac": stat.frac,
                "k": stat.k,
                "batch_tokens": stat.batch_tokens,
                "steps": stat.steps,
                "median_ms": stat.seconds * 1000.0,
                "held_out": cell in test,
            }
            for name, fit in self.fits.items():
                split = fit.split_table
                row[f"pred_ms_{name}"] = None if split is None else predict_cell(split, stat) * 1e3
                row[f"pred_ms_{name}_saved"] = predict_cell(fit.table, stat) * 1000.0
            rows.append(row)
        return {
            "holdout": self.holdout,
            "seed": self.seed,
            "train_cells": [list(c) for c in self.train],
            "held_out_cells": [list(c) for c in self.held_out],
            "metrics": {
                name: {
                    "held_out": fit.held_out,
                    "in_sample": fit.in_sample,
                    "all_cells": fit.all_cells,
                    "error": fit.error,
                }
                for name, fit in self.fits.items()
            },
            "cells": rows,
            "samples": sample_rows(self.samples),
        }


def evaluate_fits(
    samples: Sequence[StepSample],
    *,
    holdout: float = 0.25,
    seed: int = 0,
    fitters: Mapping[str, Fitter] = FITTERS,
) -> FitReport:
    """Hold out whole cells, fit each table kind on the rest and score it; then refit on all.

    A training split too small for a kind (e.g. the additive bias comes out <= 0) is
    reported in ``error`` with empty held-out metrics instead of stopping the profile; a
    failing fit on *all* cells raises :class:`CostTableError`, since nothing could be saved.
    """
    cells = cell_stats(samples)
    train, test = split_cells(list(cells), holdout, seed)
    chosen = set(train)
    train_samples = [s for s in samples if s.cell in chosen]
    fits: dict[str, TableFit] = {}
    for name, fit in fitters.items():
        table = fit(samples)
        split: CostTable | None
        try:
            split, error = fit(train_samples), None
        except CostTableError as exc:
            split, error = None, str(exc)
        fits[name] = TableFit(
            name=name,
            table=table,
            split_table=split,
            held_out=_quality(samples, split, test),
            in_sample=_quality(samples, split, train),
            all_cells=fit_quality(samples, table, list(cells)),
            error=error,
        )
    return FitReport(list(samples), cells, train, test, fits, holdout, seed)


def _quality(samples: Sequence[StepSample], table: CostTable | None, cells: list[Cell]) -> Metrics:
    if table is None:
        return Metrics(cells=len(cells), rms_ms=None, r2=None, median_rel_err=None)
    return fit_quality(samples, table, cells)


# --------------------------------------------------------------------------- plot


_PLOT_GROUPS = ((False, "o", "tab:blue", "fit cells"), (True, "x", "tab:red", "held-out cells"))


def plot_fit(report: FitReport, path: str | Path, title: str = "") -> bool:
    """Predicted vs measured median step time per cell, one panel per table kind.

    Predictions come from the training-split fit, so held-out cells (marked) show how the
    table does on batches it never saw. Returns False, writing nothing, without matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    test = set(report.held_out)
    fig, axes = plt.subplots(1, len(report.fits), figsize=(5.5 * len(report.fits), 5))
    for ax, fit in zip(np.atleast_1d(axes), report.fits.values(), strict=True):
        table = fit.split_table or fit.table  # the saved fit only when the split fit failed
        pts = [
            (c.seconds * 1e3, predict_cell(table, c) * 1e3, cell in test)
            for cell, c in report.cells.items()
        ]
        hi = max(max(m, p) for m, p, _ in pts) * 1.05
        ax.plot([0, hi], [0, hi], color="grey", lw=1, ls="--", label="identity")
        for held, marker, color, label in _PLOT_GROUPS:
            xs = [m for m, _, h in pts if h == held]
            ys = [p for _, p, h in pts if h == held]
            if xs:
                ax.scatter(xs, ys, s=30, marker=marker, c=color, label=label)
        ax.set(xlim=(0, hi), ylim=(0, hi), xlabel="measured step (ms, cell median)")
        ax.set(ylabel="predicted step (ms)")
        ax.set_title(f"{fit.name}\n{_metrics_line(fit.held_out)}", fontsize=9)
        ax.legend(loc="upper left", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _metrics_line(m: Metrics) -> str:
    if m["cells"] == 0:
        return "no held-out cells"
    if m["rms_ms"] is None:
        return f"held-out: {m['cells']} cells, no split fit (saved fit shown)"
    r2 = "n/a" if m["r2"] is None else f"{m['r2']:.3f}"
    rel = m["median_rel_err"] or 0.0
    return f"held-out ({m['cells']} cells): RMS {m['rms_ms']:.2f} ms, R2 {r2}, med rel {rel:.1%}"


# --------------------------------------------------------------------------- outputs

TABLE_SUFFIX: Mapping[str, str] = {"additive": "", "steps_per_sec": "_1d"}
"""File stem suffix per table kind: ``<name>.json`` is the additive one the scheduler loads."""


def save_profile(
    report: FitReport, out_dir: str | Path, name: str, meta: Mapping[str, Any]
) -> dict[str, Path | None]:
    """Write both tables (SGLang JSON), ``<name>_fit.json`` and ``<name>_fit.png``.

    ``meta`` (device, versions, the command...) heads the report. The plot entry is None
    when matplotlib is missing; a plot left from an earlier profile of that name is removed
    then, so it cannot be mistaken for this one.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path | None] = {}
    for kind, fit in report.fits.items():
        path = out / f"{name}{TABLE_SUFFIX.get(kind, '_' + kind)}.json"
        fit.table.save(path)
        paths[kind] = path
    png = out / f"{name}_fit.png"
    plotted = plot_fit(report, png, title=f"{name}: cost-table fit ({meta.get('device', '?')})")
    if not plotted:
        png.unlink(missing_ok=True)
    body = {
        **meta,
        "tables": {k: p.name for k, p in paths.items() if p is not None},  # kinds only so far
        "plot": png.name if plotted else None,
        **report.to_dict(),
    }
    paths["plot"] = png if plotted else None
    paths["report"] = out / f"{name}_fit.json"
    paths["report"].write_text(json.dumps(body, indent=1, allow_nan=False) + "\n", "utf-8")
    return paths


def sample_rows(samples: Sequence[StepSample]) -> list[list[float]]:
    """``[bs, frac, k, ms]`` per step: the report's compact form of the raw measurements."""
    return [[s.bs, s.frac, s.k, s.seconds * 1000.0] for s in samples]


def save_samples(samples: Sequence[StepSample], path: str | Path) -> Path:
    """The raw ``[bs, frac, k, ms]`` steps alone, for when no table could be fit from them."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {"samples": sample_rows(samples)}
    out.write_text(json.dumps(body, allow_nan=False) + "\n", "utf-8")
    return out


def metrics_rows(report: FitReport) -> list[tuple[str, str, str, str, str, str]]:
    """``(table, cells scored, cells, RMS ms, R^2, median rel err)`` rows for a printed table."""
    rows = []
    for name, fit in report.fits.items():
        for label, m in (
            ("held-out", fit.held_out),
            ("in-sample", fit.in_sample),
            ("all (saved)", fit.all_cells),
        ):
            rows.append(
                (
                    name,
                    label,
                    str(m["cells"]),
                    _fmt(m["rms_ms"], ".2f"),
                    _fmt(m["r2"], ".3f"),
                    _fmt(m["median_rel_err"], ".1%"),
                )
            )
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
