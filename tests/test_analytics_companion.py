"""Companion pairing: identical greedy runs, loud divergences, ceiling arithmetic."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from dspark_obs.analytics import (
    CompanionDivergence,
    ceiling_summary,
    find_companion,
    pair_companion,
    step_ceilings,
)
from dspark_obs.testing.synthetic import simulate_pair


@pytest.fixture(scope="module")
def greedy_sim():
    return simulate_pair(n_requests=24, seed=3, temperature=0.0)


def test_greedy_runs_are_identical_and_quiet(greedy_sim):
    s = greedy_sim
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = pair_companion(
            s.compact_req_steps, s.cap_req_steps, s.compact_requests, s.cap_requests
        )
    assert res.greedy is True and res.identical and not res.alarm
    assert len(res.divergences) == 0
    assert len(res.steps) == len(s.cap_req_steps)
    assert (res.steps["acc_len_compact"] == res.steps["committed"]).all()


def test_per_workload_ceiling_matches_loop(greedy_sim):
    s = greedy_sim
    res = pair_companion(pa.Table.from_pandas(s.compact_req_steps), s.cap_req_steps)
    for wl, row in res.per_workload.set_index("workload").iterrows():
        acc = trim = steps = 0
        utils = []
        for r in s.cap_req_steps.itertuples():
            if r.workload == wl:
                acc += r.acc_len
                trim += r.cap_trim
                steps += 1
                utils.append(r.acc_len / (r.acc_len + r.cap_trim))
        assert row["steps"] == steps
        assert row["committed"] == acc and row["tokens_left"] == trim
        assert row["ceiling"] == acc + trim
        assert row["utilization"] == pytest.approx(acc / (acc + trim))
        assert row["mean_step_utilization"] == pytest.approx(np.mean(utils))
        assert row["mean_ceiling"] == pytest.approx((acc + trim) / steps)


def test_divergence_under_greedy_is_loud(greedy_sim):
    s = greedy_sim
    cap = s.cap_req_steps.copy()
    target = cap.index[(cap.rid == "req-0005")][3]
    cap.loc[target, "bonus_token"] = int(cap.loc[target, "bonus_token"]) + 1
    cap_req = s.cap_requests.copy()
    cap_req.at[cap_req.index[cap_req.rid == "req-0007"][0], "finish_reason"] = "abort"
    with pytest.warns(CompanionDivergence, match="DIVERGENCE under greedy"):
        res = pair_companion(s.compact_req_steps, cap, s.compact_requests, cap_req)
    assert res.alarm and not res.identical
    d = res.divergences
    row = d[d.field == "bonus_token"].iloc[0]
    assert row["rid"] == "req-0005" and row["step"] == 3
    assert ((d.rid == "req-0007") & (d.field == "finish_reason") & (d.step == -1)).any()


def test_missing_step_is_a_divergence(greedy_sim):
    s = greedy_sim
    cap = s.cap_req_steps.drop(index=s.cap_req_steps.index[-1])
    with pytest.warns(CompanionDivergence):
        res = pair_companion(s.compact_req_steps, cap, greedy=True)
    assert (res.divergences.field == "step").sum() == 1


def test_sampling_divergence_is_expected_not_alarm():
    s = simulate_pair(n_requests=12, seed=1, temperature=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = pair_companion(
            s.compact_req_steps, s.cap_req_steps, s.compact_requests, s.cap_requests
        )
    assert res.greedy is False and not res.identical and not res.alarm
    assert "expected under sampling" in res.message
    assert len(res.per_workload) == 3


def test_find_companion_and_hand_ceilings():
    runs = pd.DataFrame(
        {
            "run_id": ["c", "a", "x"],
            "mode": ["compact", "cap-accept", "cap-accept"],
            "companion_of": [None, "c", "other"],
        }
    )
    assert find_companion(runs, "c") == "a"
    assert find_companion(runs, "zzz") is None
    cap = pd.DataFrame(
        {
            "rid": ["q", "q", "p"],
            "forward_ct": [2, 1, 1],
            "workload": ["w"] * 3,
            "acc_len": [2, 1, 3],
            "cap_trim": [2, 0, 1],
            "correct_drafts": [1, 0, 2],
            "verify_len": [2, 2, 3],
        }
    )
    st = step_ceilings(cap)
    assert st[st.rid == "q"]["step"].tolist() == [0, 1]  # ordered by forward_ct
    summ = ceiling_summary(st).iloc[0]
    assert summ["ceiling"] == 9 and summ["committed"] == 6 and summ["tokens_left"] == 3
    assert summ["utilization"] == pytest.approx(6 / 9)
    assert summ["mean_step_utilization"] == pytest.approx((1 + 0.5 + 0.75) / 3)
    assert summ["share_steps_trimmed"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="one run"):
        step_ceilings(cap.assign(run_id=["a", "b", "a"]))
