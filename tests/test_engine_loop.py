"""The decode loop on tiny random models: lossless modes, cap-accept == compact, records."""

from __future__ import annotations

import itertools
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from dspark_obs.cost_table import AdditiveCostTable, CostTable
from dspark_obs.engine.drafter import Drafter
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.model import Target
from dspark_obs.engine.types import EngineConfig, EngineError, GenRequest
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.testing.tiny_models import tiny_pair

VOCAB = 6  # a tiny vocabulary so random drafts are often accepted


def _models(seed: int = 0) -> tuple[Target, Drafter]:
    return tiny_pair(seed, vocab_size=VOCAB)


def _trimming_table() -> CostTable:
    """Step time grows steeply with verify tokens, so the scheduler trims windows."""
    return AdditiveCostTable.from_dict(
        {
            "bias_seconds": 0.01,
            "bs_probes": [1, 16],
            "alpha_seconds": [0.0, 0.0],
            "m_probes": [1, 8, 16, 64, 128],
            "theta_seconds": [0.0, 0.01, 0.03, 0.15, 0.4],
        }
    )


def _requests(n: int, seed: int = 0, temperature: float = 0.0) -> list[GenRequest]:
    rng = np.random.default_rng(seed)
    return [
        GenRequest(
            rid=f"r{i}",
            prompt_ids=rng.integers(0, VOCAB, size=int(rng.integers(3, 9))).tolist(),
            max_new_tokens=int(rng.integers(10, 30)),
            workload="math",
            temperature=temperature,
            seed=100 + i,
            arrival_step=int(rng.integers(0, 6)),
        )
        for i in range(n)
    ]


def _greedy_reference(target: Target, prompt: list[int], n: int) -> list[int]:
    cache = target.new_cache(len(prompt) + n + 1)
    out = target.forward([torch.tensor(prompt)], [cache])
    seq = []
    for _ in range(n):
        tok = int(torch.argmax(out.logits[0][-1]))
        seq.append(tok)
        out = target.forward([torch.tensor([tok])], [cache])
    return seq


def _run(
    target: Target,
    drafter: Drafter,
    mode: str,
    reqs: list[GenRequest],
    max_batch: int,
    table: CostTable | None = None,
    run_id: str = "run",
):
    sink = MemorySink()
    fan = FanOut([sink])
    eng = Engine(
        target, drafter, EngineConfig(mode=mode, gamma=5, max_batch=max_batch, cost_table=table)
    )
    res = eng.run(reqs, fan.emit, run_id)
    assert fan.errors == [], [str(e) for e in fan.errors[:3]]
    return res, sink


@pytest.mark.parametrize("max_batch", [1, 3, 8])
@pytest.mark.parametrize("mode", ["static", "compact", "cap-accept"])
def test_greedy_output_equals_target_greedy(mode: str, max_batch: int) -> None:
    target, drafter = _models()
    reqs = _requests(6)
    res, _ = _run(target, drafter, mode, reqs, max_batch, _trimming_table())
    for r in reqs:
        assert res.outputs[r.rid] == _greedy_reference(target, r.prompt_ids, r.max_new_tokens)


def test_cap_accept_commits_what_compact_commits_and_exposes_the_ceiling() -> None:
    target, drafter = _models(1)
    reqs = _requests(8, seed=1)
    table = _trimming_table()
    _, compact = _run(target, drafter, "compact", reqs, 4, table, "c")
    _, cap = _run(target, drafter, "cap-accept", reqs, 4, table, "k")
    _, static = _run(target, drafter, "static", reqs, 4, None, "s")
    c = compact.table("req_steps").to_pandas().sort_values(["forward_ct", "rid"])
    k = cap.table("req_steps").to_pandas().sort_values(["forward_ct", "rid"])
    assert len(c) == len(k)
    for col in ("rid", "verify_len", "acc_len", "correct_drafts", "bonus_token"):
        assert c[col].tolist() == k[col].tolist(), col
    # cap-accept verifies the window first: the drafter saw bitwise the same features.
    assert [list(x) for x in c.confidence] == [list(x) for x in k.confidence]
    # The scheduler really trimmed, and trimming really hid accepted drafts.
    assert (c.verify_len < 6).mean() > 0.3
    assert k.cap_trim.sum() > 0
    assert (c.cap_trim == 0).all()
    # cap_trim = correct_full - min(correct_full, verify_len - 1): with greedy drafts the
    # full-block truth is the leading match length against the static run's target rows.
    ceiling = k.acc_len + k.cap_trim
    assert (ceiling <= 6).all() and (ceiling >= k.acc_len).all()
    assert (k.correct_drafts + k.cap_trim <= 5).all()
    assert (k.cap_trim[k.correct_drafts < k.verify_len - 1] == 0).all()
    # Static commits whole blocks: its mean accept length is an upper bound of compact's.
    s = static.table("req_steps").to_pandas()
    assert s.acc_len.mean() >= c.acc_len.mean()


def test_sampled_cap_accept_matches_compact_token_for_token() -> None:
    target, drafter = _models(2)
    reqs = _requests(5, seed=2, temperature=0.9)
    table = _trimming_table()
    rc, _ = _run(target, drafter, "compact", reqs, 3, table, "c")
    rk, _ = _run(target, drafter, "cap-accept", reqs, 3, table, "k")
    assert rc.outputs == rk.outputs


def test_compact_processes_sum_of_verify_len_tokens() -> None:
    target, drafter = _models(3)
    reqs = _requests(5, seed=3)
    res, sink = _run(target, drafter, "compact", reqs, 4, _trimming_table())
    assert res.committed_tokens == sum(len(o) for o in res.outputs.values())
    rs = sink.table("req_steps").to_pandas()
    steps = sink.table("steps").to_pandas()
    prompts = sum(len(r.prompt_ids) for r in reqs)
    assert res.target_tokens == prompts + rs.verify_len.sum()
    per_step = rs.groupby("forward_ct").verify_len.sum()
    assert (
        steps.set_index("forward_ct").num_verify_tokens.loc[per_step.index].tolist()
        == per_step.tolist()
    )


def test_records_are_consistent_and_censored_blocks_are_recorded() -> None:
    target, drafter = _models(4)
    reqs = _requests(8, seed=4)
    _, sink = _run(target, drafter, "compact", reqs, 8, _trimming_table())
    rs = sink.table("req_steps").to_pandas()
    requests = sink.table("requests").to_pandas()
    assert sorted(requests.rid) == sorted(r.rid for r in reqs)
    # completion tokens = first token (prefill) + everything committed in steps
    committed = rs.groupby("rid").acc_len.sum()
    for _, row in requests.iterrows():
        assert row.completion_tokens == 1 + committed.get(row.rid, 0)
        assert row.first_token_time >= row.arrival_time
    censored = rs[rs.trimmed_tokens.notna()]
    assert len(censored) > 0
    for _, row in censored.iterrows():
        assert row.correct_drafts == row.verify_len - 1 < 5
        assert len(row.trimmed_tokens) == len(row.q_lp) == 5 - (row.verify_len - 1)
        assert list(row.trimmed_tokens) == list(row.draft_tokens)[row.verify_len - 1 :]
    # Every pg entry points at an earlier-or-same censored step of the same request.
    src = {(r.rid, r.forward_ct): r for r in censored.itertuples()}
    pgs = rs[rs.pg.notna()]
    assert len(pgs) > 0
    for row in pgs.itertuples():
        for e in row.pg:
            blk = src[(row.rid, e["src_fct"])]
            assert e["src_fct"] <= row.forward_ct
            # k is SGLang's 1-based draft position of a trimmed draft: verify_len..gamma
            assert blk.verify_len <= e["k"] <= 5
            assert e["draft_token"] == blk.trimmed_tokens[e["k"] - blk.verify_len]
            assert e["target_logprob"] <= 0


def test_bad_input_is_refused_before_anything_is_written() -> None:
    target, drafter = _models()
    with pytest.raises(EngineError, match="unknown mode"):
        EngineConfig(mode="fast")
    with pytest.raises(EngineError, match="gamma"):
        EngineConfig(gamma=0)
    eng = Engine(target, drafter, EngineConfig())
    sink = MemorySink()
    bad = [GenRequest("a", [1, 2], 5), GenRequest("b", [], 5)]
    with pytest.raises(EngineError, match="empty prompt"):
        eng.run(bad, FanOut([sink]).emit, "x")
    too_long = [GenRequest("c", [1] * 500, 100)]
    with pytest.raises(EngineError, match="exceeds the context"):
        eng.run(too_long, FanOut([sink]).emit, "x")
    assert sink.batches == {}


def test_every_bad_sampling_setting_is_refused_before_anything_is_written() -> None:
    target, drafter = _models()
    eng = Engine(target, drafter, EngineConfig())
    sink = MemorySink()
    for change, needle in (
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"temperature": float("inf")}, "temperature"),
        ({"seed": -1}, "seed"),
        ({"arrival_step": -2}, "arrival_step"),
        ({"prompt_ids": [1, VOCAB]}, "token id"),
    ):
        good = GenRequest("ok", [1, 2], 5)
        bad = GenRequest("bad", **{"prompt_ids": [1, 2], "max_new_tokens": 5, **change})
        with pytest.raises(EngineError, match=needle):
            eng.run([good, bad], FanOut([sink]).emit, "x")
    for kwargs in ({"flush_every": 0}, {"flush_seconds": 0.0}, {"estimator_rows": "some"}):
        with pytest.raises(EngineError):
            EngineConfig(**kwargs)
    assert sink.batches == {}


class _ArrivalSink:
    """Records how many step rows each hand-over carries, and on which thread it came."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.threads: set[str] = set()

    def emit(self, table: str, rows: list) -> None:
        self.threads.add(threading.current_thread().name)
        if table == "steps":
            self.sizes.append(len(rows))


def test_records_reach_sinks_every_n_steps_or_every_interval_whichever_first() -> None:
    target, drafter = _models(2)
    reqs = [replace(r, max_new_tokens=120, arrival_step=0) for r in _requests(3, seed=2)]
    # by count: a huge interval, every 4 steps
    by_count = _ArrivalSink()
    res = Engine(target, drafter, EngineConfig(flush_every=4, flush_seconds=1e9)).run(
        reqs, by_count.emit, "n"
    )
    sizes = by_count.sizes
    assert sum(sizes) == res.steps and set(sizes[:-1]) == {4} and sizes[-1] <= 4
    assert by_count.threads == {"dspark-obs-records"}  # built and emitted off the decode thread
    # by time: a huge count, every 5 s of an injected clock that advances 1 s per reading
    # (the loop reads it once at the start and once per step)
    by_time = _ArrivalSink()
    ticks = itertools.count(1)
    eng = Engine(
        target, drafter, EngineConfig(flush_every=10**9, flush_seconds=5.0),
        clock=lambda: float(next(ticks)),
    )  # fmt: skip
    res = eng.run(reqs, by_time.emit, "t")
    sizes = by_time.sizes
    assert sum(sizes) == res.steps and res.steps > 10
    assert set(sizes[:-1]) == {5} and 1 <= sizes[-1] <= 5
    # the record worker's queue: one hand-over per flush, every step row, nothing failed
    rec = res.records
    assert rec is not None and (rec.enqueued, rec.done, rec.failed) == (len(sizes), len(sizes), 0)


def test_compact_with_an_uninitialized_1d_table_verifies_everything_as_sglang() -> None:
    from dspark_obs.cost_table import StepsPerSecTable

    target, drafter = _models(3)
    reqs = _requests(4, seed=3)
    flat = StepsPerSecTable((16,), (50.0,), 64)  # one probe: SGLang's "uninitialized" table
    res, sink = _run(target, drafter, "compact", reqs, 4, flat, "flat")
    rs = sink.table("req_steps").to_pandas()
    assert (rs.verify_len == 6).all()
    steps = sink.table("steps").to_pandas()
    assert (steps.num_verify_tokens == steps.bs * 6).all()
    assert steps.predicted_step_ms.isna().all()
    # the same run with no table at all commits the same tokens
    res_none, _ = _run(target, drafter, "compact", reqs, 4, None, "none")
    assert res.outputs == res_none.outputs


@pytest.mark.parametrize("mode", ["static", "compact"])
def test_ignore_eos_runs_to_the_length_limit_and_eos_stops_otherwise(mode: str) -> None:
    target, drafter = _models()
    base = _requests(3)
    ref = {r.rid: _greedy_reference(target, r.prompt_ids, r.max_new_tokens) for r in base}
    stop = ref[base[0].rid][2]  # a token greedy decoding really produces early
    reqs = base + [replace(r, rid=r.rid + "-ign", ignore_eos=True) for r in base]
    sink = MemorySink()
    fan = FanOut([sink])
    config = EngineConfig(mode=mode, gamma=5, max_batch=4, cost_table=_trimming_table())
    res = Engine(target, drafter, config, stop_ids=[stop]).run(reqs, fan.emit, "eos")
    finished = {r["rid"]: r["finish_reason"] for r in sink.table("requests").to_pylist()}
    for r in base:
        full = ref[r.rid]
        assert res.outputs[r.rid + "-ign"] == full
        assert finished[r.rid + "-ign"] == "length"
        if stop in full:
            assert res.outputs[r.rid] == full[: full.index(stop) + 1]
            assert finished[r.rid] == "stop"
    assert finished[base[0].rid] == "stop"


def test_a_failing_emit_fails_the_run_at_a_later_hand_over_and_leaves_no_thread() -> None:
    target, drafter = _models(2)
    reqs = [replace(r, max_new_tokens=40, arrival_step=0) for r in _requests(2, seed=2)]
    calls: list[str] = []

    def emit(table: str, rows: list) -> None:
        calls.append(table)
        raise OSError("store gone")

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(OSError, match="store gone"):
        Engine(target, drafter, EngineConfig(flush_every=2)).run(reqs, emit, "f")
    assert calls[0] == "steps" and len(calls) == 1  # the worker stopped at its first failure
    assert {t.name for t in threading.enumerate()} <= before
