"""Calibration metrics: hand cases, loop-based twins on random data, and censoring."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from dspark_obs.analytics import (
    auroc,
    auroc_binned,
    brier,
    calibration_table,
    conditional_acceptance,
    ece,
    ece_equal_mass,
    mce,
    position_labels,
    reliability_bins,
    request_confidence,
)
from dspark_obs.analytics._frames import bootstrap_indices
from dspark_obs.analytics.calibration import bin_index

# ---------------------------------------------------------------- loop-based twins


def loop_bins(p, y, n_bins=15):
    """Bin sums by walking samples one by one (floor of clamped p * n_bins)."""
    count, ps, ys = [0] * n_bins, [0.0] * n_bins, [0.0] * n_bins
    for pi, yi in zip(p, y, strict=True):
        pc = min(max(float(pi), 1e-8), 1 - 1e-8)
        b = min(int(math.floor(pc * n_bins)), n_bins - 1)
        count[b] += 1
        ps[b] += pc
        ys[b] += float(yi)
    return count, ps, ys


def loop_ece(p, y, n_bins=15):
    count, ps, ys = loop_bins(p, y, n_bins)
    n = sum(count)
    return (
        sum(abs(ps[b] / count[b] - ys[b] / count[b]) * count[b] for b in range(n_bins) if count[b])
        / n
    )


def loop_mce(p, y, n_bins=15):
    count, ps, ys = loop_bins(p, y, n_bins)
    return max(abs(ps[b] / count[b] - ys[b] / count[b]) for b in range(n_bins) if count[b])


def loop_auroc(p, y):
    pos = [a for a, b in zip(p, y, strict=True) if b == 1]
    neg = [a for a, b in zip(p, y, strict=True) if b == 0]
    wins = 0.0
    for a in pos:
        for b in neg:
            wins += 1.0 if a > b else 0.5 if a == b else 0.0
    return wins / (len(pos) * len(neg))


def loop_mass_ece(p, y, n_bins=15):
    pc = [min(max(float(v), 1e-8), 1 - 1e-8) for v in p]
    order = sorted(range(len(pc)), key=lambda i: pc[i])
    n = len(pc)
    k = min(n_bins, n)
    base, extra = divmod(n, k)
    total, start = 0.0, 0
    for b in range(k):
        size = base + (1 if b < extra else 0)
        idx = order[start : start + size]
        start += size
        mp = sum(pc[i] for i in idx) / size
        my = sum(float(y[i]) for i in idx) / size
        total += size * abs(mp - my)
    return total / n


# ---------------------------------------------------------------- hand cases


def test_ece_hand_case():
    p = [0.05, 0.05, 0.95, 0.95, 0.5]
    y = [0, 1, 1, 1, 0]
    # bins 0, 14, 7: (|.05-.5|*2 + |.95-1|*2 + |.5-0|*1) / 5
    assert ece(p, y) == pytest.approx(0.3, abs=1e-15)
    assert mce(p, y) == pytest.approx(0.5)
    assert brier(p, y) == pytest.approx((0.05**2 + 0.95**2 + 0.05**2 * 2 + 0.25) / 5)


def test_bin_edges_follow_sglang_clamp_and_truncation():
    p = np.clip(np.array([0.0, 1e-8, 1 - 1e-8, 1.0, 0.5, 0.0666, 0.0667]), 1e-8, 1 - 1e-8)
    assert bin_index(p).tolist() == [0, 0, 14, 14, 7, 0, 1]
    # a perfectly "certain" wrong prediction still counts through the clamp
    assert ece([0.0], [0]) == pytest.approx(1e-8, rel=1e-6)
    assert ece([1.0], [1]) == pytest.approx(1e-8, rel=1e-6)
    assert math.isnan(ece([], []))


def test_auroc_hand_and_single_class():
    assert auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auroc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)
    assert math.isnan(auroc([0.2, 0.3], [1, 1]))
    assert math.isnan(auroc_binned([0.2, 0.3], [0, 0]))


def test_equal_mass_hand_case():
    # 4 samples, 2 bins: {0.1, 0.2} labels {0, 1} -> |0.15-0.5|; {0.7, 0.9} labels {1, 1} -> |0.8-1|
    assert ece_equal_mass([0.9, 0.1, 0.7, 0.2], [1, 0, 1, 1], n_bins=2) == pytest.approx(
        (2 * 0.35 + 2 * 0.2) / 4
    )


def test_reliability_bins_hand_case():
    rb = reliability_bins([0.05, 0.05, 0.95], [0, 1, 1], n_bins=15)
    assert rb["count"].tolist()[0] == 2 and rb["count"].tolist()[14] == 1
    assert rb.loc[0, "mean_label"] == pytest.approx(0.5)
    assert rb.loc[14, "gap"] == pytest.approx(-0.05)
    assert rb["mean_pred"].isna().sum() == 13


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_match_loop_twins_on_random_data(seed):
    rng = np.random.default_rng(seed)
    n = 700
    p = rng.beta(0.7, 0.7, size=n)
    p[:5] = [0.0, 1.0, 1 - 1e-8, 1e-9, 14 / 15]
    y = (rng.random(n) < p**1.3).astype(float)
    p_ties = np.round(p, 2)  # ties for AUROC
    assert ece(p, y) == pytest.approx(loop_ece(p, y), abs=1e-12)
    assert ece(p, y, n_bins=7) == pytest.approx(loop_ece(p, y, 7), abs=1e-12)
    assert mce(p, y) == pytest.approx(loop_mce(p, y), abs=1e-12)
    assert ece_equal_mass(p, y) == pytest.approx(loop_mass_ece(p, y), abs=1e-12)
    assert auroc(p_ties, y) == pytest.approx(loop_auroc(p_ties, y), abs=1e-12)
    pc = np.clip(p, 1e-8, 1 - 1e-8)
    assert brier(p, y) == pytest.approx(float(np.mean((pc - y) ** 2)), abs=1e-12)
    # SGLang's 1024-bin AUROC approaches the exact one
    assert auroc_binned(p, y) == pytest.approx(auroc(p, y), abs=0.01)


# ---------------------------------------------------------------- labels and censoring


def _rows(specs, gamma=4, run_id="r", mode_col=None):
    rows = []
    for i, (vl, cd, ct, conf) in enumerate(specs):
        row = {
            "run_id": run_id,
            "dp_rank": 0,
            "forward_ct": i,
            "rid": f"q{i % 3}",
            "gamma": gamma,
            "verify_len": vl,
            "correct_drafts": cd,
            "cap_trim": ct,
            "acc_len": cd + 1,
            "workload": "math",
            "confidence": conf,
        }
        if mode_col:
            row["mode"] = mode_col
        rows.append(row)
    return pd.DataFrame(rows)


def test_position_labels_censoring_rules():
    conf = [0.9, 0.8, 0.5, 0.5]
    df = _rows([(3, 2, 0, conf), (4, 1, 0, conf)])
    lab = position_labels(df, mode="compact")
    a = lab[lab.forward_ct == 0]
    b = lab[lab.forward_ct == 1]
    # whole window (2 drafts) accepted: positions 3, 4 unobserved, never rejections
    assert a["observed"].tolist() == [True, True, False, False]
    assert a["label"].iloc[:2].tolist() == [1.0, 1.0] and a["label"].iloc[2:].isna().all()
    # rejection inside the window: later positions are known zeros
    assert b["observed"].tolist() == [True, True, True, True]
    assert b["label"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert b["at_risk"].tolist() == [True, True, False, False]
    # survival from confidences
    assert a["pred"].tolist() == pytest.approx([0.9, 0.72, 0.36, 0.18])
    assert a["conf"].tolist() == pytest.approx(conf)


def test_cap_accept_labels_use_full_count():
    df = _rows([(2, 1, 2, [0.9] * 4)])
    lab = position_labels(df, runs={"r": "cap-accept"})
    assert lab["observed"].all()
    assert lab["label"].tolist() == [1.0, 1.0, 1.0, 0.0]
    # the same row read as compact only knows position 1
    lab_c = position_labels(df, runs={"r": "compact"})
    assert lab_c["observed"].tolist() == [True, False, False, False]


def test_survival_column_is_preferred_and_conf_derived():
    df = _rows([(5, 4, 0, None)])
    df["survival"] = [[0.9, 0.45, 0.36, 0.18]]
    lab = position_labels(df)
    assert lab["pred"].tolist() == pytest.approx([0.9, 0.45, 0.36, 0.18])
    assert lab["conf"].tolist() == pytest.approx([0.9, 0.5, 0.8, 0.5])


def test_trimming_never_lowers_acceptance():
    """Every verified draft accepted; a naive reader would see rejections past each window."""
    rng = np.random.default_rng(3)
    gamma = 5
    specs = []
    for _ in range(400):
        vl = int(rng.integers(1, gamma + 2))
        specs.append((vl, vl - 1, 0, [0.97] * gamma))
    df = _rows(specs, gamma=gamma)
    lab = position_labels(df, mode="compact")
    ca = conditional_acceptance(lab)
    assert (ca["accept_rate"] == 1.0).all()
    assert ca["position"].tolist() == [1, 2, 3, 4, 5]
    cal = calibration_table(lab)
    assert (cal["label_mean"] == 1.0).all()
    # the naive prefix label 1[j <= correct_drafts] on every position would be far below 1
    cd = df["correct_drafts"].to_numpy()
    naive = [np.mean(cd[cd >= j - 1] >= j) for j in range(1, gamma + 1)]
    assert max(naive) < 0.9


def test_censored_estimate_is_consistent_with_full_verification():
    """Random windows independent of outcomes: compact labels estimate what cap-accept sees."""
    rng = np.random.default_rng(7)
    gamma, n = 5, 6000
    cond = np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    full = np.zeros(n, dtype=int)
    for i in range(n):
        k = 0
        while k < gamma and rng.random() < cond[k]:
            k += 1
        full[i] = k
    vl = rng.integers(1, gamma + 2, size=n)
    cd = np.minimum(full, vl - 1)
    compact = _rows(
        [(int(v), int(c), 0, [0.5] * gamma) for v, c in zip(vl, cd, strict=True)], gamma=gamma
    )
    cap = _rows(
        [(int(v), int(c), int(f - c), [0.5] * gamma) for v, c, f in zip(vl, cd, full, strict=True)],
        gamma=gamma,
    )
    ca_c = conditional_acceptance(position_labels(compact, mode="compact"))[
        "accept_rate"
    ].to_numpy()
    ca_a = conditional_acceptance(position_labels(cap, mode="cap-accept"))["accept_rate"].to_numpy()
    assert np.abs(ca_a - cond).max() < 0.03
    assert np.abs(ca_c - cond).max() < 0.05
    # a naive reader that treats unverified drafts as rejected underestimates badly
    naive = []
    for j in range(1, gamma + 1):
        at_risk = cd >= j - 1
        naive.append(np.mean(cd[at_risk] >= j))
    assert (cond[2:] - np.array(naive)[2:] > 0.1).all()


def test_conditional_acceptance_hand_case():
    conf = [0.9, 0.8, 0.7, 0.6]
    df = _rows([(5, 4, 0, conf), (5, 1, 0, conf), (3, 2, 0, conf), (2, 0, 0, conf)])
    ca = conditional_acceptance(position_labels(df, mode="compact")).set_index("position")
    # position 1: rows 1..4 at risk, accepted 3; position 2: rows 1,2,3 at risk, accepted 2;
    # position 3: row 1 only (row 3 accepted its whole 2-draft window: position 3 unobserved)
    assert ca.loc[1, "at_risk"] == 4 and ca.loc[1, "accepted"] == 3
    assert ca.loc[2, "at_risk"] == 3 and ca.loc[2, "accepted"] == 2
    assert ca.loc[3, "at_risk"] == 1 and ca.loc[3, "accept_rate"] == 1.0
    assert ca.loc[4, "at_risk"] == 1
    assert ca.loc[1, "mean_conf"] == pytest.approx(0.9)


def test_calibration_table_bootstrap_matches_loop_resampling():
    rng = np.random.default_rng(11)
    rows = []
    for r in range(12):
        for s in range(int(rng.integers(3, 9))):
            vl = int(rng.integers(1, 7))
            cd = int(rng.integers(0, vl))
            rows.append(
                {
                    "run_id": "a",
                    "rid": f"q{r}",
                    "forward_ct": s,
                    "gamma": 5,
                    "verify_len": vl,
                    "correct_drafts": cd,
                    "workload": "chat",
                    "confidence": rng.uniform(0.3, 1.0, 5).round(4).tolist(),
                }
            )
    lab = position_labels(pd.DataFrame(rows), mode="compact")
    n_boot, seed = 60, 5
    tab = calibration_table(lab, by=("position",), n_boot=n_boot, seed=seed)
    for _, row in tab.iterrows():
        g = lab[lab.observed & (lab.position == row["position"])]
        keys = sorted(set(zip(g.run_id, g.rid, strict=True)))
        per = {k: g[(g.run_id == k[0]) & (g.rid == k[1])] for k in keys}
        idx = bootstrap_indices(len(keys), n_boot, seed)
        eces, briers = [], []
        for draw in idx:
            sample = pd.concat([per[keys[i]] for i in draw])
            eces.append(loop_ece(sample.pred.tolist(), sample.label.tolist()))
            pc = np.clip(sample.pred.to_numpy(), 1e-8, 1 - 1e-8)
            briers.append(float(np.mean((pc - sample.label.to_numpy()) ** 2)))
        assert row["ece_lo"] == pytest.approx(np.quantile(eces, 0.025), abs=1e-12)
        assert row["ece_hi"] == pytest.approx(np.quantile(eces, 0.975), abs=1e-12)
        assert row["brier_hi"] == pytest.approx(np.quantile(briers, 0.975), abs=1e-12)
        assert row["ece"] == pytest.approx(loop_ece(g.pred.tolist(), g.label.tolist()), abs=1e-12)
        assert row["requests"] == len(keys)


def test_grouping_per_workload_run_request():
    df = pd.concat(
        [
            _rows([(5, 4, 0, [0.9] * 4), (5, 0, 0, [0.2] * 4)], run_id="r1"),
            _rows([(5, 2, 0, [0.6] * 4)], run_id="r2").assign(workload="chat"),
        ]
    )
    lab = position_labels(df)
    assert set(calibration_table(lab, by=("workload",))["workload"]) == {"math", "chat"}
    assert set(calibration_table(lab, by=("run_id",))["run_id"]) == {"r1", "r2"}
    per_req = calibration_table(lab, by=("run_id", "rid"))
    assert len(per_req) == 3
    assert calibration_table(lab, by=())["n"].iloc[0] == 12


def test_request_confidence_hand_case():
    df = _rows([(3, 2, 0, [0.5] * 4), (2, 0, 0, [0.5] * 4)])
    df["rid"] = "q"
    rc = request_confidence(df, mode="compact").iloc[0]
    # step 1: 1 + .5 + .25 = 1.75 vs 3; step 2: 1 + .5 vs 1 -> means 1.625 vs 2
    assert rc["pred_window"] == pytest.approx(1.625)
    assert rc["realized"] == pytest.approx(2.0)
    assert rc["gap_window"] == pytest.approx(-0.375)
    assert rc["pred_block"] == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
    assert math.isnan(rc["realized_block"])
    rc_cap = request_confidence(df.assign(cap_trim=[1, 0]), mode="cap-accept").iloc[0]
    assert rc_cap["realized_block"] == pytest.approx((4 + 1) / 2)
