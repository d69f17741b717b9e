"""Whole-block steps (issue 24): a step that verifies every block launches the verify right
after the draft, reads back once, and accepts the whole batch in one array operation. Each
piece is held to the path it replaces: the per-request acceptance, the scheduler's own plan,
and the engine with the old step (``whole_block_verify=False``), record for record."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_obs.cost_table import AdditiveCostTable
from dspark_obs.engine.acceptance import greedy_accept_argmax, greedy_accept_batch
from dspark_obs.engine.batched import BatchedRuntime
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.reference import ReferenceRuntime
from dspark_obs.engine.scheduler import BudgetDecision, Scheduler
from dspark_obs.engine.types import EngineConfig, GenRequest
from dspark_obs.fanout import FanOut, MemorySink
from tests.test_engine_batched import _models, _requests

VOLATILE = {"ts", "step_cpu_ms", "draft_gpu_ms", "target_verify_gpu_ms"}


def _mild_table() -> AdditiveCostTable:
    """Verify tokens cost a little: confident batches verify everything, others trim."""
    return AdditiveCostTable.from_dict({
        "bias_seconds": 0.01, "bs_probes": [1, 16], "alpha_seconds": [0.0, 0.0],
        "m_probes": [1, 8, 16, 64, 128], "theta_seconds": [0.0, 0.002, 0.005, 0.03, 0.08],
    })  # fmt: skip


def test_batch_acceptance_equals_per_request_acceptance() -> None:
    rng = np.random.default_rng(0)
    vocab, gamma = 4, 5
    for _ in range(200):
        bs = int(rng.integers(1, 9))
        pred = rng.integers(0, vocab, size=(bs, gamma + 1))
        drafts = np.where(rng.random((bs, gamma)) < 0.7, pred[:, :gamma],
                          rng.integers(0, vocab, size=(bs, gamma)))  # fmt: skip
        rows = rng.integers(1, gamma + 2, size=bs)
        windows = np.array([int(rng.integers(1, r + 1)) for r in rows])
        for win in (None, windows):
            got = greedy_accept_batch(pred, drafts, rows, vocab, windows=win)
            for i in range(bs):
                want = greedy_accept_argmax(
                    pred[i, : rows[i]], drafts[i], vocab,
                    window=None if win is None else int(win[i]),
                )  # fmt: skip
                assert got[i] == want


def test_batch_acceptance_names_bad_input() -> None:
    pred, drafts = np.zeros((2, 4), dtype=np.int64), np.zeros((2, 3), dtype=np.int64)
    with pytest.raises(ValueError, match="verified rows must be in 1..4"):
        greedy_accept_batch(pred, drafts, np.array([0, 4]), 8)
    with pytest.raises(ValueError, match="out of range"):
        greedy_accept_batch(pred, drafts + 9, np.array([4, 4]), 8)
    with pytest.raises(ValueError, match="window"):
        greedy_accept_batch(pred, drafts, np.array([2, 4]), 8, windows=np.array([3, 1]))


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_a_budget_decided_ahead_is_the_budget_plan_then_picks(lag: int) -> None:
    rng = np.random.default_rng(lag)
    sched = Scheduler(_mild_table(), gamma=5, lag=lag)
    plain = Scheduler(_mild_table(), gamma=5, lag=lag)  # never asked ahead
    alive = [f"r{i}" for i in range(4)]
    nxt, full = 4, 0
    for _ in range(60):
        if rng.random() < 0.3 and len(alive) > 1:  # one leaves, one joins
            alive.pop(int(rng.integers(0, len(alive))))
            alive.append(f"r{nxt}")
            nxt += 1
        low = 0.6 if rng.random() < 0.5 else 0.9999  # confident batches verify everything
        conf = rng.uniform(low, 1.0, size=(len(alive), 5))
        decided = sched.decide_ahead(alive)
        assert decided is not None
        ahead = decided.budget
        budget, windows = sched.plan(alive, np.cumprod(conf, axis=1), decided)
        want, want_windows = plain.plan(alive, np.cumprod(conf, axis=1))
        assert ahead == budget == want
        assert windows.tolist() == want_windows.tolist()
        assert sched.last_decision == plain.last_decision
        full += budget == len(alive) * 5
    assert 0 < full < 60  # both kinds of step happened
    assert Scheduler(_mild_table(), gamma=5, lag=0).decide_ahead(alive) is None
    assert Scheduler(None, gamma=5).decide_ahead(alive) == BudgetDecision(budget=len(alive) * 5)


def _records(target, drafter, cfg: EngineConfig, reqs: list[GenRequest]):
    sink = MemorySink()
    res = Engine(target, drafter, cfg).run(reqs, FanOut([sink]).emit, "w")
    tables = {}
    for name in ("steps", "req_steps"):
        rows = sink.table(name).to_pylist()
        tables[name] = sorted(
            ({k: v for k, v in r.items() if k not in VOLATILE} for r in rows),
            key=lambda r: (r["forward_ct"], r.get("rid", "")),
        )
    return res, tables


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"whole": 0}
    for cls in (BatchedRuntime, ReferenceRuntime):
        real = cls.verify_block

        def spy(self, block, floor=None, _real=real):  # type: ignore[no-untyped-def]
            calls["whole"] += 1
            return _real(self, block, floor)

        monkeypatch.setattr(cls, "verify_block", spy)
    return calls


@pytest.mark.parametrize("backend", ["batched", "reference"])
@pytest.mark.parametrize("mode", ["static", "compact", "cap-accept"])
def test_whole_block_steps_change_no_token_and_no_record(
    backend: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, drafter = _models(7)
    reqs = _requests(7, seed=8)
    # a penalized request and a min_new_tokens one force the old step while they run
    reqs[1].repetition_penalty = 1.3
    reqs[2].min_new_tokens = 6
    calls = _counting(monkeypatch)
    out = {}
    for whole in (True, False):
        calls["whole"] = 0
        cfg = EngineConfig(mode=mode, max_batch=3, backend=backend, cost_table=_mild_table(),
                           whole_block_verify=whole, launch_ahead=False)  # fmt: skip
        res, tables = _records(target, drafter, cfg, reqs)
        out[whole] = (res.outputs, tables, res.steps, calls["whole"])
    (outs_a, tables_a, steps, whole_steps), (outs_b, tables_b, _, none) = out[True], out[False]
    assert none == 0 and 0 < whole_steps < steps  # both kinds of step ran
    assert outs_a == outs_b
    assert tables_a == tables_b


def test_a_greedy_static_run_verifies_whole_blocks_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target, drafter = _models(8)
    reqs = _requests(5, seed=9)
    calls = _counting(monkeypatch)
    cfg = EngineConfig(mode="static", max_batch=3, backend="batched")
    res, _ = _records(target, drafter, cfg, reqs)
    assert calls["whole"] == res.steps > 0
