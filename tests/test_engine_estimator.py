"""The estimator on real engine records: compact alone recovers the companion's ceiling."""

from __future__ import annotations

import numpy as np

from dspark_obs.analytics import estimate_blocks, pair_companion, validate_estimator
from tests.test_engine_loop import _models, _requests, _run, _trimming_table


def _pair(temperature: float, seed: int):
    target, drafter = _models(seed)
    reqs = _requests(8, seed=seed, temperature=temperature)
    table = _trimming_table()
    _, compact = _run(target, drafter, "compact", reqs, 4, table, "c")
    _, cap = _run(target, drafter, "cap-accept", reqs, 4, table, "c-cap")
    return compact, cap


def test_greedy_estimate_from_compact_alone_equals_companion_truth() -> None:
    compact, cap = _pair(0.0, 5)
    rs = compact.table("req_steps").to_pandas()
    req = compact.table("requests").to_pandas()
    est = estimate_blocks(rs, req, gamma=5)
    assert est.problems.empty if hasattr(est.problems, "empty") else not est.problems
    blocks = est.blocks.sort_values(["rid", "forward_ct"]).reset_index(drop=True)
    truth = cap.table("req_steps").to_pandas().sort_values(["rid", "forward_ct"])
    truth = truth.reset_index(drop=True)
    assert len(blocks) == len(truth)
    exact = blocks.greedy_exact.to_numpy(bool)
    assert exact.mean() > 0.8
    # DESIGN's ceiling: acc_len + cap_trim (a cut final step counts what it committed).
    ceiling = (truth.acc_len + truth.cap_trim).to_numpy()
    assert np.array_equal(blocks.greedy_ceiling.to_numpy()[exact], ceiling[exact])
    # Where not exact (the request ended first), the truth lies inside the greedy bounds.
    lo, hi = blocks.greedy_lo.to_numpy(), blocks.greedy_hi.to_numpy()
    assert np.all((lo[~exact] <= ceiling[~exact]) & (ceiling[~exact] <= hi[~exact]))


def test_companion_pairs_identically_and_bracket_holds_truth_under_sampling() -> None:
    compact, cap = _pair(1.0, 6)
    pair = pair_companion(compact.table("req_steps"), cap.table("req_steps"),
                          compact.table("requests"), cap.table("requests"), greedy=True)
    assert pair.identical, pair.message
    est = estimate_blocks(compact.table("req_steps").to_pandas(),
                          compact.table("requests").to_pandas(), gamma=5)
    val = validate_estimator(est, pair, n_boot=50)
    assert len(val) >= 1
    assert bool(val.filter(like="inside").all(axis=None)), val.T
