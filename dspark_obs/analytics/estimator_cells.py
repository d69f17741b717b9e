"""Which cell of the estimator's validation sweep a run resembles, and how it measured there.

bench/bench_estimator_sweep.py judges the estimator against cap-accept truth per cell
(forced budget fraction x sampling) and commits the table to ``SWEEP_JSON``. A report or a
dashboard showing an estimate for a compact run names the cell with the same kind of
sampling and the nearest censored share, so a reader sees the point error and interval
coverage measured where the run sits, not a global claim.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dspark_obs.analytics.estimator_recorder import SGLANG_SAMPLING_EPS

SWEEP_JSON = Path(__file__).resolve().parents[2] / "runtime" / "bench" / "estimator_sweep.json"

SAMPLING_KINDS = {"greedy": "greedy", "T1": "temperature", "T0.7-p0.9": "top-p", "T1-k20": "top-k"}
"""The sweep's sampling settings and the kind of sampling each stands for."""


def sampling_kind(rows: pd.DataFrame) -> str:
    """greedy / temperature / top-p / top-k (the most restrictive present among the rows)."""
    t = pd.to_numeric(rows.get("temperature", pd.Series(dtype=float)), errors="coerce")
    p = pd.to_numeric(rows.get("top_p", pd.Series(dtype=float)), errors="coerce")
    k = pd.to_numeric(rows.get("top_k", pd.Series(dtype=float)), errors="coerce")
    if len(t) and (t.fillna(1.0) < SGLANG_SAMPLING_EPS).all():
        return "greedy"
    if len(k) and (k.fillna(-1) != -1).any():
        return "top-k"
    if len(p) and (p.fillna(1.0) < 1.0).any():
        return "top-p"
    return "temperature"


def load_cells(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The sweep's pooled cells (workload "all"); empty when the file is absent or unreadable."""
    f = Path(path) if path is not None else SWEEP_JSON
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        return []
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, list):
        return []
    return [c for c in cells if isinstance(c, dict) and c.get("workload", "all") == "all"]


def validation_cell(
    censored_share: float, kind: str, cells: list[dict[str, Any]] | None = None
) -> dict[str, Any] | None:
    """The sweep cell of this sampling kind with the nearest censored share (None if none)."""
    cells = load_cells() if cells is None else cells
    same = [c for c in cells if SAMPLING_KINDS.get(str(c.get("sampling"))) == kind]
    if not same or not math.isfinite(censored_share):
        return None
    best = min(same, key=lambda c: abs(float(c.get("censored_share", np.inf)) - censored_share))
    keys = ("frac", "sampling", "censored_share", "replicates", "point_error", "coverage")
    return {k: best.get(k) for k in (*keys, "interval_width")}


def describe_cell(cell: dict[str, Any] | None) -> str:
    """One line for a page or report: the cell and what it measured."""
    if not cell:
        return "no validation cell (runtime/bench/estimator_sweep.json absent)"
    return (
        f"budget fraction {cell['frac']:g}, {cell['sampling']}: censored "
        f"{100 * float(cell['censored_share']):.0f}%, point error "
        f"{100 * float(cell['point_error']):+.1f}%, 95% interval coverage "
        f"{float(cell['coverage']):.2f} over {cell['replicates']} replicates"
    )


def describe_tail(info: dict[str, Any]) -> str:
    """One line: which tail model filled unresolved offsets, how it was chosen, and the
    validation cell (``info``: ``TailModel.describe()`` plus a ``validation_cell`` key)."""
    if not info:
        return "tail model: unknown"
    chosen = info.get("tail_model", "?")
    cv = info.get("cv_log_loss")
    if cv:
        how = "chosen by held-out log loss " + ", ".join(
            f"{k} {v:.3f}" for k, v in sorted(cv.items())
        )
    elif chosen == "calibrated":
        how = "too few requests to cross-validate"
    else:
        how = "as asked"
    fit = f", slope on logit(confidence) {info['beta']:.2f}" if "beta" in info else ""
    return (
        f"tail model: {chosen} ({how}{fit}; {info.get('resolved_offsets', 0)} resolved trimmed "
        f"offsets); validation cell: {describe_cell(info.get('validation_cell'))}"
    )
