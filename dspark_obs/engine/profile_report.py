"""How well a fitted cost table predicts step time, and the profile's files.

Each table kind is fitted on the training cells and scored on the held-out ones (plus
in-sample and all-cell scores), then refitted on every cell for saving; the report is the
tables in SGLang's JSON, ``<name>_fit.json`` (metrics, one row per cell, every sample) and a
predicted-vs-measured plot.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from dspark_obs.cost_table import CostTable, CostTableError
from dspark_obs.engine.profile_fit import (
    FITTERS,
    Cell,
    CellStat,
    Fitter,
    StepSample,
    cell_stats,
    split_cells,
)


class Metrics(TypedDict):
    """Prediction error of a table over some cells (None where undefined, e.g. no cells)."""

    cells: int
    rms_ms: float | None
    r2: float | None
    median_rel_err: float | None


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


TABLE_SUFFIX: Mapping[str, str] = {"additive": "", "steps_per_sec": "_1d"}
"""File stem suffix per table kind: ``<name>.json`` is the additive one the scheduler loads."""


def save_profile(
    report: FitReport, out_dir: str | Path, name: str, meta: Mapping[str, Any]
) -> dict[str, Path | None]:
    """Write both tables (SGLang JSON), ``<name>_fit.json`` and ``<name>_fit.png``.

    ``meta`` (device, versions, the command...) heads the report; its ``host`` block, if
    any, also goes into each table (a table predicts the host it was profiled on, and says
    which: ``host_tables``). The plot entry is None when matplotlib is missing; a plot left
    from an earlier profile of that name is removed then, so it cannot be mistaken for this one.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path | None] = {}
    host = {"host": meta["host"]} if "host" in meta else {}
    for kind, fit in report.fits.items():
        path = out / f"{name}{TABLE_SUFFIX.get(kind, '_' + kind)}.json"
        CostTable.from_dict({**fit.table.to_dict(), **host}, source=str(path)).save(path)
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


POOR_FIT_R2 = 0.5
"""Below this R^2 (the saved additive table over every cell) the step times were mostly
noise: seen at 0.14 on a 2-core CPU while a test suite ran beside the profile, 0.77 idle."""


def poor_fit_warning(report: FitReport) -> str | None:
    """One line for the user when the saved table explains little of the timed steps (a busy
    machine, or too few steps per cell), since a run would plan with it; None otherwise."""
    fit = report.fits.get("additive")
    r2 = None if fit is None else fit.all_cells["r2"]
    if r2 is None or r2 >= POOR_FIT_R2:
        return None
    return (
        f"the saved table explains little of the timed steps (R^2 {r2:.2f} < {POOR_FIT_R2}): "
        "was something else running on this machine? Profile again when it is idle, or "
        "with more --new-tokens per cell."
    )


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
