"""Per-request semantics on both backends: stop ids, min_new_tokens (lossless), cancellation."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from dspark_obs.engine.drafter import Drafter
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.model import Target
from dspark_obs.engine.types import MASKED_LOGIT, EngineConfig, EngineError, GenRequest
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.testing.tiny_models import tiny_pair
from tests.test_engine_loop import _trimming_table

VOCAB = 6
BACKENDS = ("reference", "batched")


def _models(seed: int = 0) -> tuple[Target, Drafter]:
    return tiny_pair(seed, vocab_size=VOCAB, context_window=16)


def _requests(n: int, seed: int = 0, **kw: object) -> list[GenRequest]:
    rng = np.random.default_rng(seed)
    return [
        GenRequest(
            rid=f"r{i}",
            prompt_ids=rng.integers(0, VOCAB, size=int(rng.integers(3, 12))).tolist(),
            max_new_tokens=int(rng.integers(12, 30)),
            seed=11 + i,
            **kw,  # type: ignore[arg-type]
        )
        for i in range(n)
    ]


def _masked_greedy(
    target: Target, prompt: list[int], n: int, stops: set[int], min_new: int = 0
) -> list[int]:
    """Plain greedy, one token per forward, stop ids masked for the first ``min_new`` tokens,
    cut after the first stop id."""
    cache = target.new_cache(len(prompt) + n + 1)
    out = target.forward([torch.tensor(prompt)], [cache])
    seq: list[int] = []
    while len(seq) < n:
        row = out.logits[0][-1].clone()
        if len(seq) < min_new:
            row[sorted(stops)] = MASKED_LOGIT
        seq.append(int(torch.argmax(row)))
        if seq[-1] in stops:
            break
        out = target.forward([torch.tensor([seq[-1]])], [cache])
    return seq


def _run(
    target: Target,
    drafter: Drafter,
    reqs: list[GenRequest],
    backend: str,
    mode: str = "compact",
    stop_ids: tuple[int, ...] = (),
    **kw: object,
) -> tuple[dict[str, list[int]], dict[str, str]]:
    sink = MemorySink()
    cfg = EngineConfig(mode=mode, max_batch=3, backend=backend, cost_table=_trimming_table())
    res = Engine(target, drafter, cfg, stop_ids=stop_ids).run(
        reqs,
        FanOut([sink]).emit,
        "req",
        **kw,  # type: ignore[arg-type]
    )
    reasons = {r["rid"]: r["finish_reason"] for r in sink.table("requests").to_pylist()}
    return res.outputs, reasons


def _frequent_tokens(target: Target, reqs: list[GenRequest]) -> list[int]:
    """Tokens plain greedy produces early, most common first (so stops really happen)."""
    counts: dict[int, int] = {}
    for r in reqs:
        for t in _masked_greedy(target, r.prompt_ids, 6, set()):
            counts[t] = counts.get(t, 0) + 1
    return sorted(counts, key=lambda t: -counts[t])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["static", "compact", "cap-accept"])
def test_per_request_stop_ids_stop_that_request_only(backend: str, mode: str) -> None:
    target, drafter = _models(1)
    base = _requests(6, seed=2)
    stop = _frequent_tokens(target, base)[0]
    reqs = [replace(r, stop_token_ids=(stop,)) if i % 2 == 0 else r for i, r in enumerate(base)]
    reqs += [replace(reqs[0], rid="ign", ignore_eos=True)]  # ignore_eos turns its stops off
    outputs, reasons = _run(target, drafter, reqs, backend, mode)
    stopped = 0
    for r in reqs:
        stops = set() if r.ignore_eos else set(r.stop_token_ids)
        want = _masked_greedy(target, r.prompt_ids, r.max_new_tokens, stops)
        assert outputs[r.rid] == want, r.rid
        hit = bool(stops) and want[-1] in stops
        assert reasons[r.rid] == ("stop" if hit else "length")
        stopped += hit
    assert stopped >= 2  # the case is really exercised


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["static", "compact", "cap-accept"])
def test_min_new_tokens_masks_stops_and_greedy_equals_masked_plain_greedy(
    backend: str, mode: str
) -> None:
    target, drafter = _models(3)
    base = _requests(6, seed=4)
    eos, extra = _frequent_tokens(target, base)[:2]
    reqs = [
        replace(r, min_new_tokens=[0, 1, 3, 8, 12, r.max_new_tokens][i], stop_token_ids=(extra,))
        for i, r in enumerate(base)
    ]
    outputs, reasons = _run(target, drafter, reqs, backend, mode, stop_ids=(eos,))
    for r in reqs:
        stops = {eos, extra}
        want = _masked_greedy(target, r.prompt_ids, r.max_new_tokens, stops, r.min_new_tokens)
        assert outputs[r.rid] == want, r.rid
        assert not stops & set(outputs[r.rid][: r.min_new_tokens - 1])
        assert len(outputs[r.rid]) >= r.min_new_tokens
    plain = _run(
        target,
        drafter,
        [replace(r, min_new_tokens=0) for r in reqs],
        backend,
        mode,
        stop_ids=(eos,),
    )[0]
    assert any(len(plain[r.rid]) < r.min_new_tokens for r in reqs)  # the mask mattered


def _exact_two_token_law(target: Target, prompt: list[int], stops: list[int], t: float) -> dict:
    """P(first two tokens) with stop ids masked at both positions, temperature ``t``."""

    def probs(tokens: list[int]) -> torch.Tensor:
        cache = target.new_cache(len(tokens) + 1)
        row = target.forward([torch.tensor(tokens)], [cache]).logits[0][-1].clone()
        row[stops] = MASKED_LOGIT
        return torch.softmax(row / t, -1)

    p1 = probs(prompt)
    return {
        (a, b): float(p1[a] * probs([*prompt, a])[b])
        for a, b in itertools.product(range(VOCAB), repeat=2)
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_min_new_tokens_follows_the_masked_target_distribution(backend: str) -> None:
    target, drafter = _models(5)
    prompt, stops, t = [1, 4, 2, 0], [0, 3], 1.0
    n = 600  # fixed seeds: the outcome is deterministic, the bound is ~4x its noise
    reqs = [
        GenRequest(
            rid=f"s{i}",
            prompt_ids=prompt,
            max_new_tokens=3,
            min_new_tokens=2,
            temperature=t,
            seed=1000 + i,
        )
        for i in range(n)
    ]
    cfg = EngineConfig(mode="static", max_batch=64, backend=backend)
    res = Engine(target, drafter, cfg, stop_ids=stops).run(reqs, FanOut([]).emit, "law")
    seen: dict[tuple[int, int], int] = {}
    for out in res.outputs.values():
        assert not set(out[:2]) & set(stops)
        seen[(out[0], out[1])] = seen.get((out[0], out[1]), 0) + 1
    law = _exact_two_token_law(target, prompt, stops, t)
    tv = 0.5 * sum(abs(seen.get(k, 0) / n - p) for k, p in law.items())
    assert tv < 0.12, tv


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_aborts_a_running_and_a_waiting_request_and_frees_the_slot(backend: str) -> None:
    target, drafter = _models(2)
    reqs = _requests(5, seed=6)
    reqs = [replace(r, max_new_tokens=25) for r in reqs]
    cfg = EngineConfig(mode="compact", max_batch=2, backend=backend, cost_table=_trimming_table())
    engine = Engine(target, drafter, cfg)
    sink = MemorySink()
    seen: dict[str, int] = {}

    def on_tokens(rid: str, tokens: list[int]) -> None:
        seen[rid] = seen.get(rid, 0) + len(tokens)
        if rid == "r0" and seen[rid] > 4:
            engine.cancel("r0")  # running: aborted at the next step boundary
            engine.cancel("r4")  # still waiting (max_batch=2): aborted with no tokens
            engine.cancel("never-submitted")  # unknown: forgotten

    res = engine.run(reqs, FanOut([sink]).emit, "cancel", on_tokens=on_tokens)
    rows = {r["rid"]: r for r in sink.table("requests").to_pylist()}
    assert rows["r0"]["finish_reason"] == "abort" and rows["r4"]["finish_reason"] == "abort"
    assert rows["r4"]["output_tokens"] == [] and rows["r4"]["completion_tokens"] == 0
    full = {r.rid: _masked_greedy(target, r.prompt_ids, r.max_new_tokens, set()) for r in reqs}
    assert 4 < len(res.outputs["r0"]) < 25 and res.outputs["r0"] == full["r0"][: seen["r0"]]
    for rid in ("r1", "r2", "r3"):  # the freed slot served the others, exactly
        assert res.outputs[rid] == full[rid] and rows[rid]["finish_reason"] == "length"
    assert res.requests == 5 and not engine._cancels
    steps = sink.table("req_steps").to_pylist()
    last_r0 = max(r["forward_ct"] for r in steps if r["rid"] == "r0")
    assert min(r["forward_ct"] for r in steps if r["rid"] == "r2") <= last_r0 + 2


def test_cancel_finds_a_request_handed_to_the_source_but_not_yet_polled() -> None:
    target, drafter = _models(2)
    first, late = _requests(2, seed=8)
    engine = Engine(target, drafter, EngineConfig(mode="static", max_batch=2))
    queue: list[list[GenRequest]] = [[], [late]]

    def source(idle: bool) -> list[GenRequest] | None:
        if not queue:
            return None
        batch = queue.pop(0)
        if not batch:  # the server enqueues `late` and cancels it before the next poll
            engine.cancel(late.rid)
        return batch

    sink = MemorySink()
    res = engine.run([first], FanOut([sink]).emit, "src", source=source)
    reasons = {r["rid"]: r["finish_reason"] for r in sink.table("requests").to_pylist()}
    assert reasons == {first.rid: "length", late.rid: "abort"}
    assert res.outputs[late.rid] == []


def test_bad_per_request_settings_are_refused_before_anything_is_written() -> None:
    target, drafter = _models(0)
    engine = Engine(target, drafter, EngineConfig())
    good = _requests(1)[0]
    bad = [
        replace(good, stop_token_ids=(VOCAB,)),
        replace(good, stop_token_ids=(-1,)),
        replace(good, min_new_tokens=-1),
        replace(good, min_new_tokens=good.max_new_tokens + 1),
    ]
    for r in bad:
        sink = MemorySink()
        with pytest.raises(EngineError, match="stop token|min_new_tokens"):
            engine.run([r], FanOut([sink]).emit, "bad")
        assert sink.table("requests") is None
