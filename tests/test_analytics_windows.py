"""Window histograms and budgets: hand cases."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from dspark_obs.analytics import budget_stats, window_histogram, window_stats


def _rows():
    spec = [
        ("math", "a", 6),
        ("math", "a", 6),
        ("math", "b", 2),
        ("math", "b", 3),
        ("chat", "c", 1),
        ("chat", "c", 4),
    ]
    return pd.DataFrame(
        [
            {
                "run_id": "r",
                "rid": rid,
                "workload": wl,
                "forward_ct": i,
                "gamma": 5,
                "verify_len": vl,
                "acc_len": 1,
            }
            for i, (wl, rid, vl) in enumerate(spec)
        ]
    )


def test_window_stats_hand_case():
    ws = window_stats(_rows()).set_index("workload")
    assert ws.loc["math", "steps"] == 4 and ws.loc["math", "requests"] == 2
    assert ws.loc["math", "mean_window"] == pytest.approx(17 / 4)
    assert ws.loc["math", "share_max_window"] == pytest.approx(0.5)
    assert ws.loc["math", "share_window_le3"] == pytest.approx(0.5)
    assert ws.loc["chat", "share_max_window"] == 0.0
    assert ws.loc["chat", "median_window"] == pytest.approx(2.5)
    per_req = window_stats(_rows(), by=("run_id", "rid"))
    assert per_req["mean_window"].tolist() == pytest.approx([6.0, 2.5, 2.5])
    assert window_stats(_rows(), by=())["steps"].iloc[0] == 6


def test_window_histogram_includes_zero_bins():
    h = window_histogram(_rows())
    chat = h[h.workload == "chat"]
    assert chat["verify_len"].tolist() == [1, 2, 3, 4, 5, 6]
    assert chat["steps"].tolist() == [1, 0, 0, 1, 0, 0]
    assert chat["share"].sum() == pytest.approx(1.0)


def test_budget_stats_skip_unset():
    steps = pd.DataFrame(
        {
            "run_id": ["r", "r", "r", "s"],
            "forward_ct": [1, 2, 3, 1],
            "budget": [4, -1, 8, 2],
            "num_verify_tokens": [10, 12, -1, 3],
            "bs": [2, 2, 2, 1],
        }
    )
    b = budget_stats(steps).set_index("run_id")
    assert b.loc["r", "steps"] == 3 and b.loc["r", "budget_steps"] == 2
    assert b.loc["r", "mean_budget"] == pytest.approx(6.0)
    assert b.loc["r", "max_budget"] == 8
    assert b.loc["r", "mean_verify_tokens"] == pytest.approx(11.0)
    assert b.loc["s", "mean_bs"] == 1.0
    assert math.isnan(
        budget_stats(pd.DataFrame({"run_id": ["x"], "budget": [-1]}))["mean_budget"].iloc[0]
    )
