"""The report: one call from store frames to JSON / Markdown / rich."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from rich.console import Console

from dspark_obs.analytics import CompanionDivergence, StsCalibration, build_report
from dspark_obs.analytics.synthetic import simulate_pair


@pytest.fixture(scope="module")
def sim():
    return simulate_pair(n_requests=24, seed=11, temperature=0.0)


def _store_view(s):
    """What the store returns: both runs in one table."""
    return (
        pd.concat([s.compact_req_steps, s.cap_req_steps], ignore_index=True),
        pd.concat([s.compact_requests, s.cap_requests], ignore_index=True),
    )


def test_report_from_store_view(sim):
    rs, rq = _store_view(sim)
    rep = build_report(rs, rq, sim.runs, steps=sim.compact_steps, n_boot=50)
    assert rep.meta["runs"] == ["sim11-compact"] and rep.meta["companions"] == ["sim11-cap"]
    wk = rep.workloads.set_index("workload")
    assert set(wk.index) == {"math", "chat", "poetry"}
    for c in (
        "mean_window",
        "mean_ceiling",
        "utilization",
        "est_lo",
        "est_hi",
        "ece_raw",
        "ece_sts",
    ):
        assert wk[c].notna().all(), c
    assert (wk["utilization"] <= 1).all()
    assert rep.warnings == []
    # greedy: the point estimate is the companion's ceiling up to the few unresolved blocks
    assert (abs(wk["est_point"] - wk["mean_ceiling"]) < 0.15).all()
    doc = json.loads(rep.to_json())
    assert set(doc) >= {
        "workloads",
        "calibration",
        "sts",
        "estimator",
        "validation",
        "companion",
        "budgets",
    }
    assert doc["sts"]["sim11-compact"]["calibration"]["temperatures"]
    md = rep.to_markdown()
    assert "## Per workload" in md and "| run | workload |" in md and "ECE STS" in md
    console = Console(record=True, width=250)
    console.print(rep.to_rich())
    text = console.export_text()
    assert "per workload" in text and "poetry" in text


def test_report_with_separate_companion_and_given_sts(sim):
    rep = build_report(
        sim.compact_req_steps,
        sim.compact_requests,
        None,
        companion_req_steps=sim.cap_req_steps,
        companion_requests=sim.cap_requests,
        sts=StsCalibration([1.0] * 5),
        n_boot=0,
    )
    assert rep.sts["sim11-compact"]["evaluation"].startswith("given temperatures")
    wk = rep.workloads
    assert wk["mean_ceiling"].notna().all()
    assert (abs(wk["ece_sts"] - wk["ece_raw"]) < 0.02).all()  # T = 1 only undoes 4-decimal rounding


def test_report_flags_greedy_divergence(sim):
    cap = sim.cap_req_steps.copy()
    cap.loc[cap.index[5], "acc_len"] = int(cap.loc[cap.index[5], "acc_len"]) + 1
    with pytest.warns(CompanionDivergence):
        rep = build_report(
            sim.compact_req_steps, sim.compact_requests, sim.runs, companion_req_steps=cap, n_boot=0
        )
    assert any("DIVERGENCE" in w for w in rep.warnings)
    assert len(rep.divergences) == 1
    assert "WARNING" in rep.to_markdown()


def test_report_without_confidence_or_companion():
    s = simulate_pair(n_requests=6, seed=2, temperature=0.7)
    rows = s.compact_req_steps.drop(columns=["confidence", "survival"])
    rep = build_report(rows, s.compact_requests, s.runs.iloc[:1], n_boot=0)
    assert rep.workloads["mean_ceiling"].isna().all()
    assert rep.workloads["est_mid"].notna().all()
    assert any("STS not evaluated" in w for w in rep.warnings)
    json.loads(rep.to_json())
