"""SPS-argmax budget, top-b allocation and the lagged confidence relay, against plain references."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_obs.cost_table import AdditiveCostTable, CostTable, StepsPerSecTable
from dspark_obs.engine.scheduler import (
    SURVIVAL_EPS,
    ConfidenceRelay,
    Scheduler,
    allocate,
    sps_budget,
    sps_decision,
)

# --------------------------------------------------------------------------- references


def ref_budget(survival: np.ndarray, table: CostTable, eps: float = SURVIVAL_EPS) -> int:
    """Brute force: evaluate every budget with scalar table calls, keep the first maximum."""
    bs = survival.shape[0]
    cands = sorted((float(v) for v in survival.ravel() if v >= eps), reverse=True)
    best_b, best = 0, None
    tau = float(bs)
    for b in range(len(cands) + 1):
        if b:
            tau += cands[b - 1]
        if isinstance(table, AdditiveCostTable):
            score = tau / table.step_seconds(bs, b)
        else:
            assert isinstance(table, StepsPerSecTable)
            score = tau * table.steps_per_sec(bs + b)
        if best is None or score > best:
            best_b, best = b, score
    return best_b


def ref_allocate(survival: np.ndarray, b: int, eps: float = SURVIVAL_EPS) -> list[int]:
    """Rank (value desc, position asc, request asc), take b, count per request."""
    bs, gamma = survival.shape
    entries = [
        (-float(survival[r, j]), j, r)
        for r in range(bs)
        for j in range(gamma)
        if survival[r, j] >= eps
    ]
    entries.sort()
    lens = [1] * bs
    for _, _, r in entries[: max(b, 0)]:
        lens[r] += 1
    return [min(v, gamma + 1) for v in lens]


def random_survival(rng: np.random.Generator, bs: int, gamma: int, *, ties: bool) -> np.ndarray:
    conf = rng.uniform(0.0, 1.0, (bs, gamma)) ** rng.uniform(0.1, 1.0)
    if ties:
        conf = np.round(conf * 4) / 4  # many equal values, exact zeros and ones
    if rng.random() < 0.3:
        conf[rng.random((bs, gamma)) < 0.2] = 1e-9  # below eps
    return np.cumprod(conf, axis=1).astype(rng.choice([np.float32, np.float64]))


def random_table(rng: np.random.Generator) -> CostTable:
    if rng.random() < 0.5:
        n_bs, n_m = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        bs_probes = np.sort(rng.choice(np.arange(1, 64), n_bs, replace=False))
        m_probes = np.sort(rng.choice(np.arange(1, 400), n_m, replace=False))
        return AdditiveCostTable(
            float(rng.uniform(1e-3, 2e-2)),
            tuple(int(x) for x in bs_probes),
            tuple(np.cumsum(rng.uniform(0, 2e-3, n_bs)).tolist()),
            tuple(int(x) for x in m_probes),
            tuple(np.cumsum(rng.uniform(0, 5e-3, n_m) * rng.uniform(0, 3, n_m)).tolist()),
        )
    n = int(rng.integers(1, 8))
    probes = np.sort(rng.choice(np.arange(1, 300), n, replace=False))
    sps = np.sort(rng.uniform(5, 200, n))[::-1]
    if rng.random() < 0.5:
        sps = np.round(sps / 50) * 50 + 50  # flat stretches -> exact ties
    return StepsPerSecTable(tuple(int(x) for x in probes), tuple(sps.tolist()), int(probes[-1]) + 7)


# --------------------------------------------------------------------------- budget


def test_budget_matches_brute_force_random() -> None:
    rng = np.random.default_rng(1234)
    for trial in range(400):
        bs, gamma = int(rng.integers(1, 24)), int(rng.integers(1, 9))
        surv = random_survival(rng, bs, gamma, ties=trial % 2 == 0)
        table = random_table(rng)
        assert sps_budget(surv, table) == ref_budget(surv, table), trial


def test_budget_matches_brute_force_eps_zero() -> None:
    rng = np.random.default_rng(99)
    for trial in range(100):
        surv = random_survival(rng, int(rng.integers(1, 10)), 5, ties=True)
        table = random_table(rng)
        assert sps_budget(surv, table, survival_eps=0.0) == ref_budget(surv, table, eps=0.0), trial


def test_budget_first_maximum_on_exact_ties() -> None:
    # T(bs, K) = (bs + K) / 2 exactly in binary, survival all ones: every budget scores 2.0.
    table = AdditiveCostTable(0.5, (1,), (0.0,), (0, 1024), (-0.5, 511.5))
    surv = np.ones((3, 4))
    assert table.objective(3, 3.0 + np.arange(13)).tolist() == [2.0] * 13
    assert sps_budget(surv, table) == 0
    # 1-D flat SPS and zero survival beyond position 1: extra budget adds nothing.
    flat = StepsPerSecTable((1,), (10.0,), 1)
    surv = np.array([[0.5, 0.0, 0.0], [0.25, 0.0, 0.0]])
    assert sps_budget(surv, flat, survival_eps=0.0) == 2
    assert sps_budget(surv, flat) == 2


def test_budget_hand_case_and_decision_fields() -> None:
    # bs = 2, survivals 0.9, 0.8, 0.1 (+ one below eps). 1-D SPS: 100 up to 3 tokens, 50 after.
    table = StepsPerSecTable((1, 4), (100.0, 50.0), 16)
    surv = np.array([[0.9, 0.1], [0.8, 1e-7]])
    # tau = [2, 2.9, 3.7, 3.8]; score = [200, 290, 185, 190] -> b = 1
    d = sps_decision(surv, table)
    assert d.budget == 1
    assert d.predicted_theta == pytest.approx(290.0)
    assert d.predicted_step_seconds == pytest.approx(0.01)
    assert sps_decision(np.zeros((0, 2)), table).budget == 0


def test_budget_never_exceeds_candidates() -> None:
    table = StepsPerSecTable((1,), (10.0,), 1)  # flat: more tokens is always better
    surv = np.array([[0.5, 1e-7, 0.0]])
    assert sps_budget(surv, table) == 1
    assert sps_budget(surv, table, survival_eps=1e-8) == 2


def test_survival_validation() -> None:
    table = StepsPerSecTable((1,), (10.0,), 1)
    with pytest.raises(ValueError, match="2-D"):
        sps_budget(np.ones(3), table)
    with pytest.raises(ValueError, match=r"survival\[0, 0\] = nan"):
        allocate(np.array([[np.nan]]), 1)


# --------------------------------------------------------------------------- allocation


def test_allocate_matches_reference_random() -> None:
    rng = np.random.default_rng(7)
    for trial in range(400):
        bs, gamma = int(rng.integers(1, 20)), int(rng.integers(1, 9))
        surv = random_survival(rng, bs, gamma, ties=trial % 2 == 0)
        if trial % 5 == 0:
            surv = rng.permuted(surv, axis=1)  # not monotone: the count rule still applies
        b = int(rng.integers(0, bs * gamma + 3))
        got = allocate(surv, b)
        assert got.tolist() == ref_allocate(surv, b), trial
        n_cand = int((surv >= surv.dtype.type(SURVIVAL_EPS)).sum())
        assert int((got - 1).sum()) == min(b, n_cand)


def test_allocate_windows_are_prefixes_of_the_top_b() -> None:
    rng = np.random.default_rng(11)
    for _ in range(200):
        bs, gamma = int(rng.integers(1, 12)), int(rng.integers(1, 8))
        surv = np.cumprod(np.round(rng.uniform(0, 1, (bs, gamma)) * 3) / 3, axis=1)
        b = int(rng.integers(0, bs * gamma + 1))
        lens = allocate(surv, b, survival_eps=0.0)
        taken = {
            (r, j)
            for _, j, r in sorted((-surv[r, j], j, r) for r in range(bs) for j in range(gamma))[:b]
        }
        window = {(r, j) for r in range(bs) for j in range(lens[r] - 1)}
        assert taken == window


def test_allocate_tie_rules_hand_case() -> None:
    surv = np.array([[0.5, 0.5, 0.2], [0.5, 0.3, 0.3], [0.9, 0.1, 0.0]])
    # ranking: (0.9,p0,r2) (0.5,p0,r0) (0.5,p0,r1) (0.5,p1,r0) (0.3,p1,r1) (0.3,p2,r1)
    #          (0.2,p2,r0) (0.1,p1,r2); 0.0 is below eps
    assert allocate(surv, 0).tolist() == [1, 1, 1]
    assert allocate(surv, 1).tolist() == [1, 1, 2]
    assert allocate(surv, 2).tolist() == [2, 1, 2]
    assert allocate(surv, 3).tolist() == [2, 2, 2]
    assert allocate(surv, 4).tolist() == [3, 2, 2]
    assert allocate(surv, 5).tolist() == [3, 3, 2]
    assert allocate(surv, 6).tolist() == [3, 4, 2]
    assert allocate(surv, 7).tolist() == [4, 4, 2]
    assert allocate(surv, 8).tolist() == [4, 4, 3]
    assert allocate(surv, 100).tolist() == [4, 4, 3]  # 0.0 < eps is never verified


# --------------------------------------------------------------------------- relay


def _rows(step: int, rids: list[str], gamma: int = 3) -> np.ndarray:
    """Distinct, recognisable survival rows: value encodes (step, request)."""
    return np.array([[step / 100 + (ord(r[0]) - 96) / 1000] * gamma for r in rids])


def test_relay_lag_two_with_joins_and_leaves() -> None:
    relay = ConfidenceRelay(lag=2)
    ones = [1.0, 1.0, 1.0]
    seq = [
        ["a", "b"],  # 0
        ["a", "b", "c"],  # 1: c joins
        ["c", "a", "b"],  # 2: order changes
        ["a", "c"],  # 3: b leaves
        ["b", "a", "c"],  # 4: b comes back
        ["b", "c"],  # 5: a leaves
        ["b", "c", "a"],  # 6: a back
    ]
    expect = {
        0: {"a": None, "b": None},
        1: {"a": None, "b": None, "c": None},
        2: {"c": None, "a": 0, "b": 0},
        3: {"a": 1, "c": 1},
        4: {"b": None, "a": 2, "c": 2},
        5: {"b": None, "c": 3},
        6: {"b": 4, "c": 4, "a": None},
    }
    for step, rids in enumerate(seq):
        lagged = relay.step(rids, _rows(step, rids))
        for i, rid in enumerate(rids):
            src = expect[step][rid]
            want = ones if src is None else _rows(src, [rid])[0].tolist()
            assert lagged[i].tolist() == want, (step, rid)
        assert len(relay) == len(rids)  # departed requests are forgotten


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_relay_other_lags(lag: int) -> None:
    relay = ConfidenceRelay(lag=lag)
    for step in range(6):
        lagged = relay.step(["x"], _rows(step, ["x"]))
        want = _rows(step - lag, ["x"]) if step >= lag else np.ones((1, 3))
        assert np.array_equal(lagged, want)


class _DequeRelay:
    """The relay's rule written per request (the oracle): a request's rows of the calls it
    has been in without a break, the last lag + 1 of them."""

    def __init__(self, lag: int) -> None:
        self.lag, self.hist = lag, {}

    def peek(self, rids, gamma, pending):
        back = self.lag - pending
        out = np.ones((len(rids), gamma))
        for i, rid in enumerate(rids):
            h = self.hist.get(rid, [])
            if len(h) >= back:
                out[i] = h[-back]
        return out

    def step(self, rids, rows):
        self.hist = {r: ([*self.hist.get(r, []), rows[i].copy()])[-(self.lag + 1):]
                     for i, r in enumerate(rids)}  # fmt: skip
        return np.array([h[0] if len(h) == self.lag + 1 else np.ones(rows.shape[1])
                         for h in self.hist.values()]).reshape(rows.shape)  # fmt: skip


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_relay_random_joins_and_leaves_match_the_per_request_rule(lag: int) -> None:
    rng = np.random.default_rng(lag)
    relay, oracle, gamma = ConfidenceRelay(lag), _DequeRelay(lag), 4
    for _ in range(300):
        pool = [f"r{i}" for i in range(12)]
        rids = list(rng.permutation(pool)[: int(rng.integers(0, 10))])
        for pending in range(lag + 1):
            got = relay.peek(rids, gamma, pending)
            if lag <= pending:
                assert got is None
            else:
                assert np.array_equal(got, oracle.peek(rids, gamma, pending))
        rows = rng.random((len(rids), gamma))
        want = oracle.step(rids, rows)
        got = relay.step(rids, rows)
        rows[:] = -1.0  # the caller reusing its array changes no history
        assert np.array_equal(got, want)
        assert len(relay) == len(rids)


def test_relay_errors_and_reset() -> None:
    relay = ConfidenceRelay()
    with pytest.raises(ValueError, match="duplicate"):
        relay.step(["a", "a"], np.ones((2, 3)))
    with pytest.raises(ValueError, match="request ids"):
        relay.step(["a"], np.ones((2, 3)))
    relay.step(["a"], np.ones((1, 3)))
    with pytest.raises(ValueError, match="width"):
        relay.step(["a"], np.ones((1, 4)))
    relay.reset()
    assert len(relay) == 0
    relay.step(["a"], np.ones((1, 4)))
    with pytest.raises(ValueError):
        ConfidenceRelay(lag=-1)


# --------------------------------------------------------------------------- scheduler


def test_scheduler_without_table_verifies_everything() -> None:
    sched = Scheduler(None, gamma=5)
    budget, lens = sched.plan(["a", "b", "c"], np.full((3, 5), 0.01))
    assert budget == 15
    assert lens.tolist() == [6, 6, 6]
    assert sched.last_decision is None


def test_scheduler_with_uninitialized_1d_table_verifies_everything() -> None:
    """SGLang: a 1-D table with <= 1 probe is "uninitialized" and compact verifies all."""
    flat = StepsPerSecTable((8,), (10.0,), 8)
    assert flat.uninitialized and not StepsPerSecTable((1, 4), (9.0, 5.0), 8).uninitialized
    sched = Scheduler(flat, gamma=5)
    survival = np.cumprod(np.full((3, 5), 0.3), axis=1)  # a real table would trim these
    for _ in range(4):
        budget, lens = sched.plan(["a", "b", "c"], survival)
        assert budget == 15 and lens.tolist() == [6, 6, 6]
        assert sched.last_decision is None
    two = Scheduler(StepsPerSecTable((1, 4), (100.0, 10.0), 8), gamma=5, lag=0)
    assert two.plan(["a", "b", "c"], survival)[1].tolist() != [6, 6, 6]


@pytest.mark.parametrize("bad", [1.5, -0.1, np.nan, np.inf])
def test_survival_outside_unit_interval_is_refused_by_every_entry_point(bad: float) -> None:
    from dspark_obs.engine.scheduler import SurvivalError

    table = StepsPerSecTable((1, 4), (100.0, 10.0), 8)
    surv = np.full((2, 3), 0.5)
    surv[1, 2] = bad
    calls = (
        lambda: Scheduler(table, gamma=3).plan(["a", "b"], surv),
        lambda: Scheduler(None, gamma=3).plan(["a", "b"], surv),
        lambda: ConfidenceRelay(1).step(["a", "b"], surv),
        lambda: allocate(surv, 2),
        lambda: sps_budget(surv, table),
    )
    for call in calls:
        with pytest.raises(SurvivalError, match=r"\[1, 2\] = .*probabilities in \[0, 1\]"):
            call()


def test_scheduler_uses_lagged_budget_and_current_allocation() -> None:
    rng = np.random.default_rng(5)
    table = AdditiveCostTable(0.01, (1, 8), (0.0, 0.002), (1, 4, 8, 32), (0.0, 0.002, 0.006, 0.04))
    sched = Scheduler(table, gamma=4, lag=2)
    seen_budgets = set()
    differs_from_current = 0
    past: list[dict[str, np.ndarray]] = []  # per step: rid -> survival row
    for step in range(30):
        rids = [r for r in ["r0", "r1", "r2", "r3", "r4"] if rng.random() < 0.8] or ["r0"]
        surv = np.cumprod(rng.uniform(0.3, 1.0, (len(rids), 4)), axis=1)
        past.append(dict(zip(rids, surv, strict=True)))
        lagged = np.ones_like(surv)
        for i, rid in enumerate(rids):
            # lag 2: the row from two steps ago, if the request stayed in every batch since
            if step >= 2 and all(rid in past[t] for t in (step - 2, step - 1)):
                lagged[i] = past[step - 2][rid]
        budget, lens = sched.plan(rids, surv)
        assert budget == ref_budget(lagged, table)
        differs_from_current += budget != ref_budget(surv, table)
        assert lens.tolist() == ref_allocate(surv, budget)
        assert sched.last_decision is not None and sched.last_decision.budget == budget
        seen_budgets.add(budget)
    assert len(seen_budgets) > 3  # the table actually discriminates
    assert differs_from_current > 5  # and the lag matters


def test_scheduler_forced_budget_and_validation() -> None:
    sched = Scheduler(None, gamma=4)
    sched.forced_budget_frac = 0.5
    surv = np.cumprod(np.full((3, 4), 0.9), axis=1)
    budget, lens = sched.plan(["a", "b", "c"], surv)
    assert budget == 6
    assert lens.tolist() == ref_allocate(surv, 6)
    sched.forced_budget_frac = 2.0
    with pytest.raises(ValueError, match="forced_budget_frac"):
        sched.plan(["a"], surv[:1])
    with pytest.raises(ValueError, match="gamma"):
        Scheduler(None, gamma=3).plan(["a"], surv[:1])


def test_scheduler_plans_large_batches_as_the_references() -> None:
    """Batch 256 x gamma 16 (no wall-clock claim: what must hold at that size is the result)."""
    table = random_table(np.random.default_rng(0))
    sched = Scheduler(table, gamma=16, lag=0)
    rng = np.random.default_rng(0)
    rids = [f"r{i}" for i in range(256)]
    for step in range(3):
        surv = np.cumprod(rng.uniform(0.5, 1, (256, 16)), axis=1)
        budget, lens = sched.plan(rids, surv)
        assert budget == ref_budget(surv, table), step
        assert lens.tolist() == ref_allocate(surv, budget), step
