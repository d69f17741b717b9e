"""Whole-block steps (issue 24): a step that verifies every block launches the verify right
after the draft, reads back once, and accepts the whole batch in one array operation. Each
piece is held to the path it replaces: the per-request acceptance, the scheduler's own plan,
and the engine with the old step (``whole_block_verify=False``), record for record."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from dspark_obs.cost_table import AdditiveCostTable
from dspark_obs.engine.acceptance import greedy_accept_argmax, greedy_accept_batch
from dspark_obs.engine.batched import BatchedRuntime
from dspark_obs.engine.block_verify import (
    LogitRows,
    block_plan,
    summary_columns,
    window_pack,
    windows_on_device,
)
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.reference import ReferenceRuntime
from dspark_obs.engine.scheduler import BudgetDecision, Scheduler, allocate
from dspark_obs.engine.session import Models, run_with_companion
from dspark_obs.engine.slots import Pack
from dspark_obs.engine.types import EngineConfig, GenRequest
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.testing.tiny_models import trimming_table
from tests.test_engine_batched import _models, _requests

VOLATILE = {"ts", "step_cpu_ms", "draft_gpu_ms", "target_verify_gpu_ms"}


def _mild_table() -> AdditiveCostTable:
    """Verify tokens cost a little: confident batches verify everything, others trim."""
    return trimming_table()


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
                assert got.row(i) == want


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
    calls = {"whole": 0, "trimmed": 0, "rest": 0, "sampled": 0}
    for cls in (BatchedRuntime, ReferenceRuntime):
        real = cls.verify_block

        def spy(self, block, floor=None, budget=None, _real=real, **kw):  # type: ignore[no-untyped-def]
            calls["whole"] += 1
            calls["trimmed"] += budget is not None and budget < block.tokens.numel()
            calls["rest"] += bool(kw.get("rest"))
            calls["sampled"] += kw.get("sampling") is not None
            return _real(self, block, floor, budget, **kw)

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
        calls["whole"] = calls["trimmed"] = calls["rest"] = 0
        cfg = EngineConfig(mode=mode, max_batch=3, backend=backend, cost_table=_mild_table(),
                           whole_block_verify=whole, launch_ahead=False)  # fmt: skip
        res, tables = _records(target, drafter, cfg, reqs)
        out[whole] = (res.outputs, tables, res.steps, calls["whole"], calls["trimmed"],
                      calls["rest"])  # fmt: skip
    (outs_a, tables_a, steps, whole_steps, trimmed, rest), (outs_b, tables_b, _, none, _, _) = (
        out[True], out[False]
    )
    assert none == 0 and 0 < whole_steps < steps  # both kinds of step ran
    # trimmed budgets run as whole-block steps too (windows packed on the device); a
    # trimmed cap-accept step verifies the drafts past its windows on top (cap_trim)
    assert (trimmed > 0) == (mode != "static")
    assert rest == (trimmed if mode == "cap-accept" else 0)
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


def test_device_windows_are_the_schedulers_allocation() -> None:
    """The top-b rule on the device (a stable sort) against the host's lexsort, ties and
    the survival floor included; rows from ``live`` on are padding and get 0."""
    rng = np.random.default_rng(11)
    for case in range(400):
        bs, gamma = int(rng.integers(1, 9)), int(rng.integers(1, 7))
        pad = int(rng.integers(0, 3))
        levels = rng.choice([0.0, 1e-7, 0.25, 0.5, 0.5, 1.0], size=(bs + pad, gamma))
        conf = levels if case % 2 else rng.random((bs + pad, gamma)) ** 0.3
        survival = np.cumprod(conf.astype(np.float32), axis=1)
        budget = int(rng.integers(0, bs * gamma + 2))
        floor = float(rng.choice([1e-6, 0.3]))
        got = windows_on_device(
            torch.from_numpy(survival), torch.tensor([budget]),
            torch.tensor([floor], dtype=torch.float32), torch.tensor([bs]),
        ).numpy()  # fmt: skip
        want = allocate(survival[:bs], min(budget, bs * gamma), survival_eps=floor)
        assert got[:bs].tolist() == want.tolist()
        assert not got[bs:].any()


def test_a_device_pack_is_the_host_pack_of_the_same_windows() -> None:
    rng = np.random.default_rng(12)
    for _ in range(100):
        bt, gamma = int(rng.integers(1, 7)), int(rng.integers(1, 6))
        q = gamma + 1
        live = int(rng.integers(1, bt + 1))
        send = np.where(np.arange(bt) < live, rng.integers(1, q + 1, size=bt), 0)
        rows = int(send.sum()) + int(rng.integers(0, 4))
        start = rng.integers(0, 50, size=bt)
        anchors = rng.integers(0, 100, size=bt)
        drafts = rng.integers(0, 100, size=(bt, gamma))
        tokens, slot, pos, qidx = window_pack(
            torch.from_numpy(send), torch.from_numpy(start), torch.from_numpy(anchors),
            torch.from_numpy(drafts), rows, trash=99,
        )  # fmt: skip
        grid = np.concatenate([anchors[:, None], drafts], axis=1)
        want = Pack.build(
            range(live), [grid[r, : send[r]].tolist() for r in range(live)], start[:live],
            q=q, batch=bt, rows=rows, trash=99,
        )  # fmt: skip
        assert tokens.tolist() == want.tokens.tolist()
        assert slot.tolist() == want.slot.tolist()
        assert qidx.tolist() == want.qidx.tolist()
        n = want.n
        assert pos[:n].tolist() == want.pos[:n].tolist()  # padding positions: any (scratch)


def test_a_greedy_pair_packs_its_windows_on_the_device_and_a_sampled_pair_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A compact run and its cap-accept companion must run the same forward shapes (bf16
    rounds by shape). Greedy, both trim on the device (cap-accept's first forward is
    compact's own replay) and commit the same tokens; with a sampled request, cap-accept's
    trimmed steps take the split step, so compact's do too; alone, compact packs them on
    the device."""
    target, drafter = _models(7)
    models = Models(target=target, drafter=drafter, tokenizer=None, stop_ids=(),
                    model_name="tiny", drafter_name="tiny")  # fmt: skip
    reqs = _requests(5, seed=8)
    cfg = EngineConfig(mode="compact", max_batch=3, backend="batched", cost_table=_mild_table())
    calls = _counting(monkeypatch)
    compact, cap, _ = run_with_companion(models, reqs, cfg, [MemorySink()], "paired",
                                         companion=True)  # fmt: skip
    assert calls["trimmed"] > 0 and calls["rest"] > 0
    assert cap is not None and compact.outputs == cap.outputs
    sampled = [GenRequest(**{**vars(r), "temperature": 0.8}) if i == 2 else r
               for i, r in enumerate(reqs)]  # fmt: skip
    calls["whole"] = calls["trimmed"] = 0
    run_with_companion(models, sampled, cfg, [MemorySink()], "paired-s", companion=True)
    assert calls["trimmed"] == 0
    _records(target, drafter, replace(cfg, device_sampling=True), sampled)
    assert calls["trimmed"] > 0


def test_a_padded_block_step_computes_what_the_exact_one_does() -> None:
    """What a captured graph sees (its batch and token tiers, rows past the live ones holding
    whatever an earlier replay left: here confident drafts, which the allocation would favour
    were they not masked), against the exact sizes the CPU runs: the live rows' windows,
    acceptance, new lengths, anchors and logits agree, and the padding writes only the
    scratch slot."""
    target, drafter = _models(9)
    rt = BatchedRuntime(target, drafter, max_batch=8, max_len=128, gamma=5)
    prompts = _requests(3, seed=4)
    for r in prompts:
        rt.prefill([rt.acquire()], [r.prompt_ids])
    block = rt.draft([0.0] * 3)
    batch, gamma = block.tokens.shape
    budget = 6
    plan = rt._plan(block_plan(batch, gamma, 1e-6, budget, True))

    def run(bt: int, rows: int) -> tuple[torch.Tensor, ...]:
        def pad(x: torch.Tensor, value: float) -> torch.Tensor:
            return torch.cat([x, torch.full((bt - batch, *x.shape[1:]), value, dtype=x.dtype)])

        kv_before = rt.pool.kv.clone()
        out = rt._block_fn(
            drafts=pad(block.tokens, 7), conf=pad(block.confidence.float(), 1.0),
            logprobs=pad(block.logprobs.float(), 0.0), start=rt._dlen[:bt].clone(),
            anchors=rt._danchor[:bt].clone(), plan=plan, rows=torch.empty(rows),
            q=torch.empty(gamma + 1), span=torch.empty(64),
        )  # fmt: skip
        changed = (rt.pool.kv != kv_before).flatten(0, 1).any(dim=(-1, -2))  # [kv, slot, head]
        return (*out, changed.any(dim=0).any(dim=-1))

    logits_a, summary_a, len_a, bonus_a, touched_a = run(batch, batch + budget)
    logits_b, summary_b, len_b, bonus_b, touched_b = run(batch + 3, 40)
    assert torch.equal(summary_a, summary_b[:batch])
    assert torch.equal(len_a, len_b[:batch]) and torch.equal(bonus_a, bonus_b[:batch])
    window = summary_columns(gamma)["window"]
    n = int(summary_a[:, window].sum())  # the windows' tokens
    assert torch.allclose(logits_a[:n], logits_b[:n], atol=1e-5, rtol=0)
    assert not summary_b[batch:, window].any()  # padding rows get no window
    trash = rt.pool.trash
    assert not touched_b[batch:trash].any()  # no live slot past the batch was written


def test_stacked_rows_of_a_pack_are_the_rows_read_one_by_one() -> None:
    """LogitRows.stacked gathers several requests' rows from a pack in one index: the same
    float32 rows, in the same order, as reading each request's rows."""
    rng = np.random.default_rng(13)
    windows = np.array([3, 1, 6, 2, 4])
    pack = torch.from_numpy(rng.standard_normal((int(windows.sum()) + 3, 7))).to(torch.bfloat16)
    offsets = np.cumsum(windows) - windows
    index = np.array([4, 0, 2, 3])  # the rows still running, in their order
    send = windows[index] - np.array([0, 1, 2, 0])  # each reads a prefix of its window
    rows = LogitRows(pack, send, index, offsets)
    items = [2, 0, 3]
    want = torch.cat([rows[i] for i in items])
    assert want.dtype == torch.float32 and torch.equal(rows.stacked(items), want)
    assert [rows.count(i) for i in items] == [int(send[i]) for i in items]
    by_list = LogitRows([pack[o : o + w] for o, w in zip(offsets, windows, strict=True)],
                        send, index)  # fmt: skip
    assert torch.equal(by_list.stacked(items), want)
