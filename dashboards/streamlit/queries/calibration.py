"""The Calibration page: reliability bins and ECE per draft position, raw and after a held-out
STS fit, with the STS verdict the CLI and the report give."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dashboards.streamlit.queries.shared import frame, in_list, lit, runs_of
from dspark_obs.analytics import (
    calibration_table,
    fit_sts_heldout,
    position_labels,
    reliability_table,
    sts_data_from_req_steps,
)
from dspark_obs.analytics.sts import logit as conf_logit
from dspark_obs.analytics.sts import sigmoid
from dspark_obs.analytics.sts_heldout import split_requests
from dspark_obs.analytics.sts_verdict import StsVerdict
from dspark_obs.store import Store

__all__ = ["Calibration", "calibration", "confidence_rows"]

_CONFIDENCE_COLUMNS = (
    "run_id, dp_rank, forward_ct, rid, gamma, verify_len, acc_len, correct_drafts, cap_trim, "
    "confidence, survival, workload, is_last"
)
_WORKLOAD = "coalesce(workload, 'unknown')"


def confidence_rows(store: Store, run_id: str, workloads: tuple[str, ...] = ()) -> pd.DataFrame:
    """A run's req-steps that carry a confidence vector (of some workloads, or all)."""
    wl = f" AND {in_list(_WORKLOAD, workloads)}" if workloads else ""
    return frame(
        store,
        f"SELECT {_CONFIDENCE_COLUMNS} FROM req_steps "
        f"WHERE run_id = {lit(run_id)}{wl} AND confidence IS NOT NULL",
    )


@dataclass
class Calibration:
    """Calibration of one run's confidence head, raw and after a held-out STS fit."""

    run_id: str
    metrics: pd.DataFrame  # workload, position, variant (raw | sts), n, ece, ece_lo, ece_hi ...
    reliability: pd.DataFrame  # workload, position, variant, bin, count, mean_pred, mean_label
    sts_json: str | None  # SGLang's STS JSON, fitted on this run's fit split
    evaluation: str  # how the STS numbers were obtained
    pooled: dict[str, float] = field(default_factory=dict)  # ece_before / ece_after held-out
    verdict: StsVerdict | None = None  # ok | too few to trust | worse: do not serve


def _with_sts(rows: pd.DataFrame, temperatures: list[float]) -> pd.DataFrame:
    """The same req-steps with confidences and survival after STS (SGLang's sigmoid(z/T))."""
    conf = np.array([np.asarray(c, dtype=np.float64) for c in rows["confidence"]])
    z = conf_logit(conf) / np.asarray(temperatures, dtype=np.float64)[None, : conf.shape[1]]
    cal = sigmoid(z)
    out = rows.copy()
    out["confidence"] = list(cal.astype(np.float32))
    out["survival"] = list(np.cumprod(cal, axis=1).astype(np.float32))
    return out


def calibration(
    store: Store,
    run_id: str,
    workloads: tuple[str, ...] = (),
    n_boot: int = 200,
    heldout_frac: float = 0.3,
    seed: int = 0,
) -> Calibration:
    """Reliability bins and ECE (15 equal-width bins, SGLang's definition) per position.

    STS is fitted on a request split of the run and both variants are judged on the
    held-out requests only, with bootstrap intervals over requests (never over steps).
    Without enough requests for a split, only the raw variant is shown.
    """
    rows = confidence_rows(store, run_id, workloads)
    runs = runs_of(store, [run_id])
    empty = Calibration(run_id, pd.DataFrame(), pd.DataFrame(), None, "no confidence recorded")
    if len(rows) == 0:
        return empty
    by = ("workload", "position")
    variants: list[tuple[str, pd.DataFrame]] = []
    sts_json, evaluation, pooled, verdict = None, "raw confidences, all requests", {}, None
    try:
        ho = fit_sts_heldout(
            sts_data_from_req_steps(rows, runs=runs), heldout_frac=heldout_frac, seed=seed
        )
        keys = (rows["run_id"].astype(str) + "/" + rows["rid"].astype(str)).to_numpy()
        held = rows.loc[split_requests(keys, heldout_frac, seed)]
        if len(held) == 0 or ho.heldout_requests == 0:
            raise ValueError("no held-out request")
        variants = [("raw", held), ("sts", _with_sts(held, ho.calibration.temperatures))]
        sts_json = json.dumps(ho.calibration.to_dict(), indent=2)
        evaluation = f"STS fitted on {ho.fit_requests} requests, judged on {ho.heldout_requests}"
        pooled = {"ece_before": ho.pooled_before, "ece_after": ho.pooled_after}
        verdict = ho.verdict()
    except ValueError:
        variants = [("raw", rows)]
    metrics, bins = [], []
    for name, part in variants:
        labels = position_labels(part, runs=runs)
        table = calibration_table(labels, by=by, n_boot=n_boot, seed=seed)
        metrics.append(table.assign(variant=name))
        bins.append(reliability_table(labels, by=by).assign(variant=name))
    return Calibration(
        run_id,
        pd.concat(metrics, ignore_index=True),
        pd.concat(bins, ignore_index=True),
        sts_json,
        evaluation,
        pooled,
        verdict,
    )
