"""First tokens kept on the device (issue 24): a greedy arrival's first token is the
prefill's argmax, written into the device's anchors and drafted from there; the host books
it when it reads the first step that ran the request, so an admission does not stop the
launched-ahead pipeline. Held to the run that reads each first token at admission
(``first_token_on_device=False``), token for token, record for record, with arrivals while
steps are in flight, first tokens that are stop ids, streamed tokens and cancels."""

from __future__ import annotations

from collections import defaultdict

import pytest

from dspark_obs.engine.live import FirstTokens
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.types import EngineConfig
from dspark_obs.fanout import FanOut, MemorySink
from tests.test_engine_batched import _models, _plain_greedy, _requests
from tests.test_engine_launch_ahead import _free_table, _per_request
from tests.test_engine_whole_block import _mild_table


def _run(cfg: EngineConfig, reqs, stop_ids=(), on_tokens=None):  # type: ignore[no-untyped-def]
    target, drafter = _models(7)
    sink = MemorySink()
    engine = Engine(target, drafter, cfg, stop_ids=stop_ids)
    engine.scheduler.survival_eps = 1e-8  # this tiny drafter's survivals run down to 1e-9
    res = engine.run(reqs, FanOut([sink]).emit, "a", on_tokens=on_tokens)
    return res, {t: sink.table(t).to_pylist() for t in ("requests", "steps", "req_steps")}


def _untimed(rows: list[dict]) -> list[dict]:
    """Rows in (step, request) order without what depends on when the host learnt a token
    (clock readings), not on what was computed."""
    ordered = sorted(rows, key=lambda r: (r.get("forward_ct", 0), r.get("rid", "")))
    clock = ("_time", "_ms", "latency")
    return [{k: v for k, v in r.items() if k != "ts" and not k.endswith(clock)} for r in ordered]


def _count_kept(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    seen = {"kept": 0}
    init = FirstTokens.__init__

    def spy(self, tokens):  # type: ignore[no-untyped-def]
        seen["kept"] += len(tokens)
        init(self, tokens)

    monkeypatch.setattr(FirstTokens, "__init__", spy)
    return seen


@pytest.mark.parametrize(
    ("mode", "table"), [("static", None), ("compact", "free"), ("compact", "mild"),
                        ("cap-accept", "mild")],
)  # fmt: skip
def test_first_tokens_on_the_device_change_no_token_and_no_record(
    mode: str, table: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests arrive at several steps, finish at others, and take freed slots while a step
    is in flight; every token, every request row and every step row is the host path's."""
    seen = _count_kept(monkeypatch)
    reqs = _requests(10, seed=6)
    cost_table = {None: None, "free": _free_table(), "mild": _mild_table()}[table]
    runs = {}
    for on_device in (True, False):
        cfg = EngineConfig(mode=mode, max_batch=3, backend="batched", cost_table=cost_table,
                           launch_ahead=True, first_token_on_device=on_device)  # fmt: skip
        runs[on_device] = _run(cfg, reqs, stop_ids=(5,))
    kept = seen["kept"]
    assert kept == len(reqs)  # every admission of the first run kept them; none of the second
    (res, tables), (ref, ref_tables) = runs[True], runs[False]
    assert res.outputs == ref.outputs
    assert res.committed_tokens == ref.committed_tokens and res.steps == ref.steps
    for name in ("requests", "steps", "req_steps"):
        assert _untimed(tables[name]) == _untimed(ref_tables[name]), name
    for row in tables["requests"]:
        assert row["first_token_time"] >= row["arrival_time"]
    target, _ = _models(7)
    for r in reqs:
        plain = _plain_greedy(target, r.prompt_ids, r.max_new_tokens)
        assert res.outputs[r.rid] == plain[: len(res.outputs[r.rid])]


def test_a_first_token_that_is_a_stop_id_finishes_the_request_when_it_lands() -> None:
    """The request rode in a launched step before the host knew its first token: it still
    finishes with that token alone (reason "stop") and no step row of its own, and every
    other request's tokens and rows are the host path's."""
    reqs = _requests(7, seed=2)
    probe, _ = _run(EngineConfig(mode="compact", max_batch=3, backend="batched"), reqs)
    firsts = {rid: out[0] for rid, out in probe.outputs.items()}
    stop = firsts[reqs[4].rid]  # a later arrival's first token: it lands mid-run
    runs = {}
    for on_device in (True, False):
        cfg = EngineConfig(mode="compact", max_batch=3, backend="batched", launch_ahead=True,
                           first_token_on_device=on_device)  # fmt: skip
        runs[on_device] = _run(cfg, reqs, stop_ids=(stop,))
    (res, tables), (ref, ref_tables) = runs[True], runs[False]
    assert res.outputs == ref.outputs
    stopped = [rid for rid, first in firsts.items() if first == stop]
    assert reqs[4].rid in stopped
    for rid in stopped:
        assert res.outputs[rid] == [stop]
        row = next(r for r in tables["requests"] if r["rid"] == rid)
        assert row["finish_reason"] == "stop" and row["completion_tokens"] == 1
        assert not [r for r in tables["req_steps"] if r["rid"] == rid]
    # its slot stayed taken for the step it rode in, so later arrivals start a step later:
    # each request's own rows are the host path's, their step numbers may not be
    assert _per_request(tables["req_steps"]) == _per_request(ref_tables["req_steps"])


def test_streamed_tokens_start_with_the_first_token_in_order() -> None:
    reqs = _requests(8, seed=9)
    streams = {}
    for on_device in (True, False):
        got: dict[str, list[int]] = defaultdict(list)
        cfg = EngineConfig(mode="compact", max_batch=3, backend="batched", launch_ahead=True,
                           cost_table=_mild_table(), first_token_on_device=on_device)
        res, _ = _run(cfg, reqs, on_tokens=lambda rid, toks, got=got: got[rid].extend(toks))
        assert dict(got) == res.outputs
        streams[on_device] = dict(got)
    assert streams[True] == streams[False]


def test_a_request_cancelled_before_its_first_token_lands_keeps_that_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cancel taken while the first token is still on the device books it first: the
    request ends "abort" with that token, streamed once."""
    reqs = _requests(6, seed=3)
    for r in reqs:
        r.arrival_step = 0
    victim = reqs[4].rid  # admitted when a slot frees, while a step is in flight
    admit = Engine._admit
    pending_at_cancel = []

    def admit_then_cancel(self, reqs_, builder):  # type: ignore[no-untyped-def]
        lives = admit(self, reqs_, builder)
        for live in lives:
            if live.req.rid == victim and live.first is not None:
                self.cancel(victim)  # taken at the loop's next turn, before any step reads it
                pending_at_cancel.append(live)
        return lives

    monkeypatch.setattr(Engine, "_admit", admit_then_cancel)
    target, drafter = _models(7)
    cfg = EngineConfig(mode="compact", max_batch=3, backend="batched", launch_ahead=True,
                       first_token_on_device=True)  # fmt: skip
    engine = Engine(target, drafter, cfg)
    sink = MemorySink()
    streamed: dict[str, list[int]] = defaultdict(list)
    res = engine.run(reqs, FanOut([sink]).emit, "a",
                     on_tokens=lambda rid, toks: streamed[rid].extend(toks))  # fmt: skip
    row = next(r for r in sink.table("requests").to_pylist() if r["rid"] == victim)
    assert row["finish_reason"] == "abort" and pending_at_cancel
    plain = _plain_greedy(target, reqs[4].prompt_ids, reqs[4].max_new_tokens)
    assert res.outputs[victim] == streamed[victim] == plain[:1]
    assert row["completion_tokens"] == 1


def test_sampled_and_masked_arrivals_read_their_first_token_at_admission(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sampled first token draws from the request's generator on the host, and a
    ``min_new_tokens`` mask or a single-token request reads it before any step: an admission
    holding one of them reads every first token there (one wait either way)."""
    seen = _count_kept(monkeypatch)
    reqs = _requests(6, seed=4)
    for r in reqs:
        r.arrival_step = 0
    reqs[1].temperature = 0.8
    cfg = EngineConfig(mode="compact", max_batch=6, backend="batched", launch_ahead=True,
                       first_token_on_device=True)
    _run(cfg, reqs)
    assert seen["kept"] == 0
    greedy = _requests(6, seed=4)
    for r in greedy:
        r.arrival_step = 0
    _run(cfg, greedy)
    assert seen["kept"] == 6
