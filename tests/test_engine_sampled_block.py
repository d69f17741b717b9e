"""Sampled rows on the device (issue 24, item 1): a whole-block step accepts its sampled rows
by rejection sampling in the verify's own replay, with the coins the host drew from each
request's generator at launch. Held to the split step, which reads the drafts back and
accepts each request on the host (``whole_block_verify=False``): on the CPU in fp32 both
decide from the same bits, so every committed token and every record must be the same, in
every mode and on both runtimes, with greedy, plain, top-k and top-p rows in one batch."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_obs.engine.batched import BatchedRuntime
from dspark_obs.engine.types import EngineConfig, GenRequest
from tests.test_engine_launch_ahead import _free_table
from tests.test_engine_loop import _models, _requests, _trimming_table
from tests.test_engine_whole_block import _counting, _records

SAMPLERS = [
    {"temperature": 0.0},
    {"temperature": 0.9},
    {"temperature": 1.3, "top_k": 3},
    {"temperature": 0.7, "top_p": 0.8},
    {"temperature": 1.0, "top_k": 4, "top_p": 0.9},
]


def _mixed(n: int, seed: int) -> list[GenRequest]:
    reqs = _requests(n, seed=seed)
    for i, r in enumerate(reqs):
        for name, value in SAMPLERS[i % len(SAMPLERS)].items():
            setattr(r, name, value)
    return reqs


@pytest.mark.parametrize("backend", ["batched", "reference"])
@pytest.mark.parametrize("mode", ["static", "compact", "cap-accept"])
def test_sampled_rows_on_the_device_commit_and_record_what_the_split_step_does(
    backend: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, drafter = _models(5)  # a 6-token vocabulary: sampled drafts often survive
    reqs = _mixed(10, seed=6)
    calls = _counting(monkeypatch)
    # a trimmed cap-accept batch with a sampled row takes the split step (tested below):
    # there the budgets are full, and the floor still cuts some windows
    table = _free_table() if mode == "cap-accept" else _trimming_table()
    out = {}
    for whole in (True, False):
        calls["whole"] = calls["sampled"] = 0
        cfg = EngineConfig(mode=mode, max_batch=4, backend=backend, cost_table=table,
                           whole_block_verify=whole, launch_ahead=False,
                           device_sampling=True)  # fmt: skip
        res, tables = _records(target, drafter, cfg, reqs)
        out[whole] = (res.outputs, tables, calls["sampled"])
    (outs_a, tables_a, sampled), (outs_b, tables_b, none) = out[True], out[False]
    assert sampled > 0 and none == 0
    assert outs_a == outs_b
    assert tables_a == tables_b
    rows = tables_a["req_steps"]
    assert any(r["temperature"] > 0 and r["correct_drafts"] > 0 for r in rows)
    if mode == "compact":  # the estimator's censored blocks opened on sampled rows too
        assert any(r["temperature"] > 0 and r["trimmed_tokens"] for r in rows)


def test_a_launched_ahead_sampled_run_commits_what_the_synchronous_one_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Launching ahead draws step k + 1's coins before step k is read: each request's stream
    is still drawn in the same order (draft, then acceptance, step after step). Budgets stay
    full here: a trimmed budget is shared by the batch, whose make-up shifts by a step when
    launching ahead, and a sampled request's tokens depend on its windows."""
    target, drafter = _models(6)
    reqs = _mixed(9, seed=7)
    calls = _counting(monkeypatch)
    outs = {}
    for ahead in (True, False):
        cfg = EngineConfig(mode="compact", max_batch=3, backend="batched",
                           cost_table=_free_table(), launch_ahead=ahead,
                           device_sampling=True)  # fmt: skip
        outs[ahead] = _records(target, drafter, cfg, reqs)[0].outputs
    assert outs[True] == outs[False]
    assert calls["sampled"] > 0


def test_a_trimmed_cap_accept_batch_with_a_sampled_row_takes_the_split_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The drafts past cap-accept's windows are counted by the greedy rule only: a trimmed
    budget over a batch with a sampled row is verified after the drafts are read back."""
    target, drafter = _models(7)
    reqs = _mixed(6, seed=8)
    seen: list[tuple[bool, bool]] = []
    real = BatchedRuntime.verify_block

    def spy(self, block, floor=None, budget=None, **kw):  # type: ignore[no-untyped-def]
        seen.append((budget is not None and budget < block.tokens.numel(),
                     kw.get("sampling") is not None))  # fmt: skip
        return real(self, block, floor, budget, **kw)

    monkeypatch.setattr(BatchedRuntime, "verify_block", spy)
    cfg = EngineConfig(mode="cap-accept", max_batch=3, backend="batched",
                       cost_table=_trimming_table(), device_sampling=True)  # fmt: skip
    _records(target, drafter, cfg, reqs)
    assert seen and not any(trimmed and sampled for trimmed, sampled in seen)
    assert any(sampled for _, sampled in seen) and any(trimmed for trimmed, _ in seen)


def test_the_coins_are_the_requests_own_stream() -> None:
    """A request's outputs do not depend on who shares its batch (its generator alone draws
    its coins): alone or among others, a seeded sampled request commits the same tokens."""
    target, drafter = _models(8)
    reqs = _mixed(8, seed=9)
    for r in reqs:
        r.arrival_step = 0
    cfg = EngineConfig(mode="static", max_batch=8, backend="batched", device_sampling=True)
    together = _records(target, drafter, cfg, reqs)[0].outputs
    for r in reqs[1:4]:
        alone = _records(target, drafter, cfg, [r])[0].outputs
        assert alone[r.rid] == together[r.rid]
    assert np.mean([len(v) for v in together.values()]) > 5


def test_on_a_synchronous_runtime_sampled_rows_take_the_split_step_unless_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU nothing overlaps the host's acceptance, which reads only the verified rows:
    by default sampled batches take the split step there (greedy ones still do not)."""
    target, drafter = _models(9)
    calls = _counting(monkeypatch)
    for asked, want in ((None, False), (True, True)):
        calls["whole"] = calls["sampled"] = 0
        cfg = EngineConfig(mode="static", max_batch=4, backend="batched", device_sampling=asked)
        _records(target, drafter, cfg, _mixed(6, seed=10))
        assert (calls["sampled"] > 0) == want and (calls["whole"] > 0) == want
        _records(target, drafter, cfg, _requests(4, seed=10))  # greedy: whole blocks anyway
        assert calls["whole"] > 0
