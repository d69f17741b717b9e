"""Launching ahead (issue 24): a whole-block step launches from the device's own lengths and
anchors before the host has read the step before it, so the host's per-request work overlaps
the device's next step. Held to the synchronous step (``launch_ahead=False``) and to plain
greedy decoding, token for token, with requests finishing, arriving, moving slots and
forcing the split step while the pipeline runs; the records are checked to add up."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from dspark_obs.cost_table import AdditiveCostTable
from dspark_obs.engine.batched import BatchedRuntime
from dspark_obs.engine.block_verify import BlockHost, survival_of
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.scheduler import Scheduler
from dspark_obs.engine.step import StepPipeline
from dspark_obs.engine.types import EngineConfig
from dspark_obs.fanout import FanOut, MemorySink
from tests.test_engine_batched import _models, _plain_greedy, _requests
from tests.test_engine_loop import _models as loop_models
from tests.test_engine_loop import _requests as loop_requests
from tests.test_engine_loop import _trimming_table as trimming_table
from tests.test_engine_whole_block import _mild_table


def _spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts launches ahead, reads that skipped finished rows, and slot moves made while
    the moved request had a verify the host had not committed."""
    seen = {"ahead": 0, "skipped": 0, "moved_ahead": 0}
    launch, rows, release = StepPipeline._launch, BlockHost.rows, BatchedRuntime.release

    def spy_launch(self, *args, ahead):  # type: ignore[no-untyped-def]
        seen["ahead"] += ahead
        return launch(self, *args, ahead=ahead)

    def spy_rows(self, index):  # type: ignore[no-untyped-def]
        seen["skipped"] += 1
        return rows(self, index)

    def spy_release(self, slot):  # type: ignore[no-untyped-def]
        last = self.used - 1
        seen["moved_ahead"] += slot != last and self._ahead_by[last] > 0
        return release(self, slot)

    monkeypatch.setattr(StepPipeline, "_launch", spy_launch)
    monkeypatch.setattr(BlockHost, "rows", spy_rows)
    monkeypatch.setattr(BatchedRuntime, "release", spy_release)
    return seen


def _free_table() -> AdditiveCostTable:
    """Verify tokens cost nothing: every budget is full while the lagged survival clears the
    floor (the current one may not: windows are then cut at it, on the device too)."""
    return AdditiveCostTable.from_dict({
        "bias_seconds": 0.01, "bs_probes": [1, 16], "alpha_seconds": [0.0, 0.0],
        "m_probes": [1, 128], "theta_seconds": [0.0, 0.0],
    })  # fmt: skip


def _run(cfg: EngineConfig, reqs, stop_ids=(), eps=1e-8):  # type: ignore[no-untyped-def]
    target, drafter = _models(7)
    sink = MemorySink()
    engine = Engine(target, drafter, cfg, stop_ids=stop_ids)
    # this tiny drafter's survivals run down to 1e-9: a floor of 1e-8 lets most lagged
    # budgets be full while some current windows are cut at it
    engine.scheduler.survival_eps = eps
    res = engine.run(reqs, FanOut([sink]).emit, "a")
    return res, sink.table("steps").to_pylist(), sink.table("req_steps").to_pylist()


@pytest.mark.parametrize("mode", ["static", "compact", "cap-accept"])
def test_launching_ahead_changes_no_token(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = _requests(9, seed=3)
    reqs[4].repetition_penalty = 1.3  # the split step runs while it does
    seen = _spy(monkeypatch)
    outs = {}
    for ahead in (True, False):
        cfg = EngineConfig(mode=mode, max_batch=3, backend="batched", cost_table=_free_table(),
                           launch_ahead=ahead)  # fmt: skip
        outs[ahead] = _run(cfg, reqs, stop_ids=(5,))[0].outputs
    assert outs[True] == outs[False]
    assert seen["ahead"] > 10 and seen["skipped"] > 0 and seen["moved_ahead"] > 0


def test_a_synchronous_runtime_launches_ahead_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU nothing would overlap: the default reads each step before the next."""
    seen = _spy(monkeypatch)
    cfg = EngineConfig(mode="static", max_batch=3, backend="batched")
    _run(cfg, _requests(4, seed=1))
    assert seen["ahead"] == 0
    _run(EngineConfig(mode="static", max_batch=3, backend="batched", launch_ahead=True),
         _requests(4, seed=1))  # fmt: skip
    assert seen["ahead"] > 0


def test_launched_ahead_greedy_output_is_plain_greedy_decoding() -> None:
    reqs = _requests(6, seed=5)
    cfg = EngineConfig(mode="static", max_batch=4, backend="batched", launch_ahead=True)
    res, _, _ = _run(cfg, reqs)
    target, _ = _models(7)
    for r in reqs:
        assert res.outputs[r.rid] == _plain_greedy(target, r.prompt_ids, r.max_new_tokens)


@pytest.mark.parametrize(
    ("table", "mode"), [("free", "compact"), ("mild", "compact"), ("mild", "cap-accept")]
)
def test_records_of_a_launched_ahead_run_add_up(
    table: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No wasted row is recorded: a request's accepted tokens sum to its output, each row
    starts where its previous one ended, every step counts exactly its rows. Budgets trim
    (some under ``free``, whose floor leaves lagged drafts out; many under ``mild``), and
    those steps launch ahead too (windows allocated and packed on the device, each checked
    against the scheduler's when read; cap-accept's drafts past them verified on top);
    tokens stay plain greedy's."""
    trimmed = {"ahead": 0}
    verify_block, launch = BatchedRuntime.verify_block, StepPipeline._launch

    def spy_launch(self, *args, ahead):  # type: ignore[no-untyped-def]
        def spy_verify(block, floor=None, budget=None, **kw):  # type: ignore[no-untyped-def]
            trimmed["ahead"] += ahead and budget is not None and budget < block.tokens.numel()
            return verify_block(self.rt, block, floor, budget, **kw)

        monkeypatch.setattr(self.rt, "verify_block", spy_verify)
        return launch(self, *args, ahead=ahead)

    monkeypatch.setattr(StepPipeline, "_launch", spy_launch)
    reqs = _requests(9, seed=4)
    cost_table = _free_table() if table == "free" else _mild_table()
    cfg = EngineConfig(
        mode=mode, max_batch=3, backend="batched", cost_table=cost_table, launch_ahead=True
    )
    res, steps, req_steps = _run(cfg, reqs, stop_ids=(5,))
    assert any(row["verify_len"] < cfg.gamma + 1 for row in req_steps)  # cut at the floor
    assert trimmed["ahead"] > 0
    target, _ = _models(7)
    for r in reqs:
        plain = _plain_greedy(target, r.prompt_ids, r.max_new_tokens)
        assert res.outputs[r.rid] == plain[: len(res.outputs[r.rid])]  # a stop id ends it
    per_req: dict[str, list[dict]] = defaultdict(list)
    for row in sorted(req_steps, key=lambda r: r["forward_ct"]):
        per_req[row["rid"]].append(row)
    for r in reqs:
        rows = per_req[r.rid]
        assert sum(row["acc_len"] for row in rows) == len(res.outputs[r.rid]) - 1
        prefix = [row["prefix_len"] for row in rows]
        assert prefix == [len(r.prompt_ids) + 1 + sum(x["acc_len"] for x in rows[:i])
                          for i in range(len(rows))]  # fmt: skip
    fcts = [s["forward_ct"] for s in steps]
    assert fcts == sorted(set(fcts))
    count = defaultdict(int)
    for row in req_steps:
        count[row["forward_ct"]] += 1
    assert all(s["bs"] == count[s["forward_ct"]] for s in steps)


def test_a_launched_ahead_cap_accept_run_is_its_compact_run_plus_the_ceiling() -> None:
    """Cap-accept's trimmed steps launch ahead too: compact's windows, then the drafts past
    them on top. What it commits is its compact run's, row for row, and its ``cap_trim``
    (drafts accepted past the windows) is the split step's, which verifies the same drafts
    after reading them back."""
    target, drafter = loop_models(1)  # a 6-token vocabulary: random drafts often survive
    reqs = loop_requests(8, seed=1)
    runs = {}
    for mode, kw in (("compact", {}), ("cap-accept", {}),
                     ("split", {"device_windows": False, "launch_ahead": False})):  # fmt: skip
        cfg = EngineConfig(mode="compact" if mode == "compact" else "cap-accept", max_batch=4,
                           backend="batched", cost_table=trimming_table(),
                           **{"launch_ahead": True, **kw})  # fmt: skip
        sink = MemorySink()
        Engine(target, drafter, cfg).run(reqs, FanOut([sink]).emit, mode)
        runs[mode] = _per_request(sink.table("req_steps").to_pylist())
    for rid, rows in runs["compact"].items():
        for col in ("verify_len", "acc_len", "correct_drafts", "bonus_token", "confidence"):
            assert [r[col] for r in rows] == [r[col] for r in runs["cap-accept"][rid]], col
        cap = [r["cap_trim"] for r in runs["cap-accept"][rid]]
        assert cap == [r["cap_trim"] for r in runs["split"][rid]]
    assert any(r["verify_len"] < 6 for x in runs["compact"].values() for r in x)
    assert sum(r["cap_trim"] for x in runs["cap-accept"].values() for r in x) > 0


def _per_request(req_steps: list[dict]) -> dict[str, list[dict]]:
    """Each request's rows in step order, without what depends on the batch's make-up."""
    out: dict[str, list[dict]] = defaultdict(list)
    for row in sorted(req_steps, key=lambda r: r["forward_ct"]):
        out[row["rid"]].append(
            {k: v for k, v in row.items() if k not in ("forward_ct", "req_pool_index", "ts")}
        )
    return out


@pytest.mark.parametrize(("mode", "seed", "eps"), [("static", 4, 1e-8), ("compact", 2, 1e-6)])
def test_each_request_records_what_the_synchronous_step_records(
    mode: str, seed: int, eps: float
) -> None:
    """A request finishing is seen a step later, so requests join a step later and step
    numbers shift; what each request drafted, verified, accepted and resolved does not
    (in ``compact`` while the budgets stay full: this case resolves censored blocks; a
    trimmed budget is shared by the batch, whose make-up shifts, so those steps take the
    split step here, ``device_windows=False``)."""
    reqs = _requests(12, seed=seed)
    rows = {}
    for ahead in (True, False):
        cfg = EngineConfig(mode=mode, max_batch=3, backend="batched", cost_table=_free_table(),
                           launch_ahead=ahead, device_windows=False)  # fmt: skip
        rows[ahead] = _per_request(_run(cfg, reqs, stop_ids=(5,), eps=eps)[2])
    assert rows[True] == rows[False]
    assert mode == "static" or sum(len(r["pg"] or []) for x in rows[True].values() for r in x)


def test_the_runtime_refuses_host_work_on_a_slot_with_an_uncommitted_verify() -> None:
    target, drafter = _models(2)
    rt = BatchedRuntime(target, drafter, max_batch=2, max_len=128, gamma=4, cuda_graphs=False)
    slot = rt.acquire()
    rt.prefill([slot], [[1, 2, 3]])
    rt.set_anchor(slot, 4)
    with pytest.raises(RuntimeError, match="no whole-block verify"):
        rt.commit(slot, 3, 4, on_device=True)
    rt.verify_block(rt.draft([0.0]))
    with pytest.raises(RuntimeError, match="not committed"):
        rt.forward([slot], [[1]])
    with pytest.raises(RuntimeError, match="not committed"):
        rt.commit(slot, 3, 4)
    rt.commit(slot, 4, 4, on_device=True)
    rt.forward([slot], [[1]])  # the host owns it again


def test_survival_is_the_hosts_cumprod_to_the_bit() -> None:
    conf = torch.rand(64, 7, generator=torch.Generator().manual_seed(0))
    assert np.array_equal(survival_of(conf).numpy(), np.cumprod(conf.numpy(), axis=1))


@pytest.mark.parametrize("lag", [2, 3])
def test_a_budget_decided_one_step_ahead_is_the_one_plan_picks(lag: int) -> None:
    """The next batch's budget, decided before this batch is planned (``pending=1``), is the
    budget the scheduler picks when it gets there, as requests come and go."""
    rng = np.random.default_rng(lag)
    sched = Scheduler(_mild_table(), gamma=5, lag=lag)
    plain = Scheduler(_mild_table(), gamma=5, lag=lag)
    batches = [[f"r{i}" for i in range(4)]]
    nxt = 4
    for _ in range(60):
        alive = list(batches[-1])
        if rng.random() < 0.3:
            alive.pop(int(rng.integers(0, len(alive))))
            alive.append(f"r{nxt}")
            nxt += 1
        batches.append(alive)
    ahead = None
    full = 0
    for now, after in zip(batches, batches[1:], strict=False):
        low = 0.6 if rng.random() < 0.5 else 0.9999
        surv = np.cumprod(rng.uniform(low, 1.0, size=(len(now), 5)), axis=1)
        decided = sched.decide_ahead(after, pending=1)  # before `now` is planned
        budget, windows = sched.plan(now, surv, ahead)
        want, want_windows = plain.plan(now, surv)
        assert budget == want and windows.tolist() == want_windows.tolist()
        full += want == len(now) * 5
        ahead = decided
    assert 0 < full < 60
    assert Scheduler(_mild_table(), gamma=5, lag=1).decide_ahead(["a"], pending=1) is None


def test_a_request_that_grows_the_pool_mid_run_keeps_the_steps_in_flight() -> None:
    """An arrival needing longer slots regrows the pool while a step is launched ahead: the
    device lengths and anchors (and their uncommitted steps) move with the caches."""
    first = _requests(3, seed=6)
    late = _requests(1, seed=9)[0]
    late.rid, late.max_new_tokens = "late", 300
    outs = {}
    for ahead in (True, False):
        calls = iter([[], [], [late], None])

        def source(idle: bool, calls=calls):  # type: ignore[no-untyped-def]
            return next(calls)

        target, drafter = _models(7)
        cfg = EngineConfig(mode="static", max_batch=4, backend="batched", launch_ahead=ahead)
        res = Engine(target, drafter, cfg).run(
            first, FanOut([MemorySink()]).emit, "g", source=source
        )
        outs[ahead] = res.outputs
    assert outs[True] == outs[False] and len(outs[True]["late"]) == 300


def _graph_like_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every whole-block verify returns its logits in one shared buffer that the next verify
    overwrites, as a CUDA graph's static output is (graphs share one memory pool); on the CPU
    each eager call allocates its own, which would hide a record reading a stale buffer."""
    real = BatchedRuntime.verify_block
    shared: list[torch.Tensor] = []

    def aliased(self, block, floor=None, budget=None, **kw):  # type: ignore[no-untyped-def]
        out = real(self, block, floor, budget, **kw)
        rows, vocab = out.logits.shape
        if not shared or shared[0].shape[0] < rows:
            shared[:] = [torch.empty(max(rows, 64), vocab, dtype=out.logits.dtype)]
        shared[0][:rows].copy_(out.logits)
        shared[0][rows:] = float("nan")
        out.logits = shared[0][:rows]
        return out

    monkeypatch.setattr(BatchedRuntime, "verify_block", aliased)


@pytest.mark.parametrize(("device_windows", "seed"), [(False, 11), (True, 2)])
def test_launched_ahead_records_read_their_own_steps_logits(
    device_windows: bool, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launched-ahead step is read after the next one launched, and its records (the target
    log p of drafts whose blocks it censors) are built later still: they must read that
    step's own logits, not whatever a later verify wrote into the graph's buffer. Held to the
    synchronous step, whose records read each step before the next one runs (step numbers
    shift between the two, so the estimator entries are compared without theirs)."""
    _graph_like_logits(monkeypatch)
    reqs = _requests(12, seed=seed)
    rows = {}
    for ahead in (True, False):
        cfg = EngineConfig(mode="compact", max_batch=3, backend="batched",
                           cost_table=_free_table(), launch_ahead=ahead,
                           device_windows=device_windows)  # fmt: skip
        per_req = _per_request(_run(cfg, reqs, stop_ids=(5,), eps=1e-6)[2])
        for req_rows in per_req.values():
            for row in req_rows:
                pg = row["pg"] or []
                row["pg"] = [{k: v for k, v in e.items() if k != "src_fct"} for e in pg]
        rows[ahead] = per_req
    assert sum(len(r["pg"]) for x in rows[True].values() for r in x) > 0  # blocks resolved
    # a trimmed budget is shared by a batch whose make-up shifts: compare what was read where
    # the windows agree
    compared = 0
    for rid, ahead_rows in rows[True].items():
        for a, s in zip(ahead_rows, rows[False][rid], strict=True):
            if a["verify_len"] == s["verify_len"] and a["pg"] and s["pg"]:
                assert a["pg"] == s["pg"]
                compared += 1
    assert compared > 0
