"""The report: one call from store frames to JSON / Markdown / rich."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from dspark_obs.analytics import CompanionDivergence, build_report
from dspark_obs.sts_file import StsCalibration
from dspark_obs.testing.synthetic import simulate_pair


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
    # 24 requests, 30% held out: the STS comparison is flagged, nothing else is
    assert len(rep.warnings) == 1 and "only 7 held-out request(s)" in rep.warnings[0]
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
    assert "## Per workload" in md and "| run | workload |" in md and "ECE judged STS" in md
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


def _inside(lo: float, x: float, hi: float) -> bool:
    return lo - 1e-9 <= x <= hi + 1e-9


def test_every_bracket_verdict_stands_beside_the_value_it_was_judged_against() -> None:
    """Sampled runs with EOS / length cuts: 'in [lo,hi]' is judged against the uncut ceiling,
    and that value is printed next to it, inside the printed bracket whenever it says yes."""
    disagree = 0
    for seed in range(6):
        s = simulate_pair(n_requests=10, seed=seed, temperature=1.0)
        rs, rq = _store_view(s)
        rep = build_report(rs, rq, s.runs, n_boot=20)
        wk = rep.workloads
        assert list(wk.columns).index("bracket_truth") + 1 == list(wk.columns).index(
            "truth_in_bracket"
        )
        for r in wk.itertuples():
            assert bool(r.truth_in_bracket) == _inside(r.est_lo, r.bracket_truth, r.est_hi)
            disagree += _inside(r.est_lo, r.bracket_truth, r.est_hi) != _inside(
                r.est_lo, r.mean_ceiling, r.est_hi
            )
        v = rep.validation
        for r in v.itertuples():
            assert bool(r.inside_bracket) == _inside(r.mean_lo, r.truth_mean_uncut, r.mean_hi)
            assert bool(r.interval_covers) == _inside(
                r.point_ci_lo, r.truth_mean_ceiling, r.point_ci_hi
            )
        console = Console(record=True, width=300)
        console.print(rep.to_rich())
        text = console.export_text()
        assert "truth_mean_uncut" in text and "point_ci_lo" in text
        assert "uncut ceiling" in rep.to_markdown()
    # the case that matters occurs: 'ceiling' (acc_len + cap_trim) outside [lo, hi] while the
    # uncut ceiling, the one judged and now printed beside the verdict, is inside (or back)
    assert disagree > 0


def test_sts_on_few_heldout_requests_or_worse_after_is_flagged() -> None:
    from dspark_obs.analytics import StsData, fit_sts_heldout

    rng = np.random.default_rng(0)
    z = rng.normal(2.0, 1.0, (40, 5))  # overconfident logits, 4 requests of 10 rows
    y = np.cumprod(rng.random((40, 5)) < 0.5, axis=1).astype(float)
    req = np.repeat([f"r{i}" for i in range(4)], 10)
    ho = fit_sts_heldout(StsData(z, y, np.ones_like(y, dtype=bool), req), 0.25, seed=0)
    assert ho.heldout_requests == 1 and ho.few_heldout
    lo, hi = ho.after_ci
    assert lo <= ho.pooled_after <= hi
    caveats = ho.caveats()
    assert any("only 1 held-out request(s)" in c and "interval" in c for c in caveats)
    # given temperatures that make the ECE worse are flagged in the warnings and the table
    s = simulate_pair(n_requests=12, seed=3, temperature=1.0)
    rs, rq = _store_view(s)
    rep = build_report(rs, rq, s.runs, sts=StsCalibration([0.1] * 5), n_boot=0)
    info = rep.sts["sim3-compact"]
    assert info["ece_after"] > info["ece_before"]
    assert any("WORSE" in w for w in rep.warnings)
    assert rep.workloads["sts_note"].str.contains("WORSE").any()
    assert "**CAVEAT**" in rep.to_markdown()
