"""The batched runtime (slot pool, one attention call per layer, graph tiers) against the
reference path, on tiny random models in float64 on the CPU (CUDA graphs themselves need a
GPU: their capture and replay were checked on an H200, see the README)."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch

from dspark_obs.engine import packed
from dspark_obs.engine.batched import BatchedRuntime
from dspark_obs.engine.drafter import Drafter
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.model import Target
from dspark_obs.engine.no_spec import run_no_spec
from dspark_obs.engine.reference import ReferenceRuntime
from dspark_obs.engine.runtime import Runtime
from dspark_obs.engine.shared_runtime import shared_runtime
from dspark_obs.engine.slots import Pack, prefill_plan, tier_of
from dspark_obs.engine.types import EngineConfig, EngineError, GenRequest
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.testing.compiled_check import eager_and_compiled
from dspark_obs.testing.tiny_models import tiny_pair

VOCAB = 8


def _models(seed: int = 0) -> tuple[Target, Drafter]:
    # a drafter far from its init, so drafts and confidences vary
    return tiny_pair(seed, vocab_size=VOCAB, num_layers=2, context_window=16, perturb=0.2)


def _requests(n: int, seed: int = 0, temperature: float = 0.0) -> list[GenRequest]:
    rng = np.random.default_rng(seed)
    return [
        GenRequest(
            rid=f"r{i}",
            prompt_ids=rng.integers(0, VOCAB, size=int(rng.integers(3, 30))).tolist(),
            max_new_tokens=int(rng.integers(5, 40)),
            temperature=temperature,
            seed=7 + i,
            arrival_step=int(rng.integers(0, 4)),
        )
        for i in range(n)
    ]


def _plain_greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    cache = target.new_cache(len(prompt) + n + 1)
    out = target.forward([torch.tensor(prompt)], [cache])
    seq = []
    for _ in range(n):
        seq.append(int(torch.argmax(out.logits[0][-1])))
        out = target.forward([torch.tensor([seq[-1]])], [cache])
    return seq


def test_tier_of_pads_up_and_passes_through_past_the_largest() -> None:
    assert [tier_of(n, (1, 2, 4, 8)) for n in (1, 3, 4, 5, 8)] == [1, 4, 4, 8, 8]
    assert tier_of(9, (1, 2, 4, 8)) == 9  # off the grid: that step runs eagerly


def test_pack_places_rows_on_their_grid_cells_and_padding_in_scratch() -> None:
    pack = Pack.build([2, 0], [[5, 6, 7], [9]], [10, 4], q=3, batch=4, rows=6, trash=4)
    assert pack.n == 4 and pack.tokens.tolist() == [5, 6, 7, 9, 0, 0]
    assert pack.slot.tolist() == [2, 2, 2, 0, 4, 4]
    assert pack.pos.tolist() == [10, 11, 12, 4, 0, 0]
    assert pack.qidx.tolist() == [6, 7, 8, 0, 12, 12]  # padding -> the grid's spare cell
    assert pack.past.tolist() == [4, 0, 10, 0]
    gathered = Pack.build([2, 0], [[5], [9]], [10, 4], q=1, batch=2, rows=2, trash=4, gather=True)
    assert gathered.qidx.tolist() == [0, 1] and gathered.row_slot.tolist() == [2, 0]
    with pytest.raises(ValueError, match="does not fit"):
        Pack.build([0], [[1, 2, 3, 4]], [0], q=3, batch=1, rows=4, trash=1)


def test_packed_forward_equals_the_reference_target_through_rollbacks_and_moves() -> None:
    target, drafter = _models()
    rt = BatchedRuntime(target, drafter, max_batch=4, max_len=128, gamma=3)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [1, 1, 2, 3, 5, 0, 7]]
    caches = [target.new_cache(128) for _ in prompts]
    slots = [rt.acquire() for _ in prompts]
    first = rt.prefill(slots, prompts)
    for i, p in enumerate(prompts):
        ref = target.prefill(p, caches[i])
        torch.testing.assert_close(first[i], ref.logits[0][-1], rtol=1e-9, atol=1e-9)
    rng = np.random.default_rng(0)
    for step in range(6):
        tokens = [rng.integers(0, VOCAB, size=int(rng.integers(1, 5))).tolist() for _ in slots]
        out = rt.forward(slots, tokens)
        ref = target.forward([torch.tensor(t) for t in tokens], caches)
        for got, want in zip(out.split()[0], ref.logits, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        for i, s in enumerate(slots):  # roll back a random number of the new positions
            keep = caches[i].length - int(rng.integers(0, len(tokens[i])))
            caches[i].truncate(keep)
            rt.commit(s, keep, 0)
        if step == 2:  # the middle request finishes: the highest slot moves into its place
            assert rt.release(slots[1]) == 2
            caches, slots = [caches[0], caches[2]], [0, 1]


def test_prefill_plan_covers_every_prompt_in_order_within_its_caps() -> None:
    lengths = [5, 2, 9, 1, 4]
    plan = prefill_plan(lengths, 4, 6)
    seen: dict[int, int] = dict.fromkeys(range(len(lengths)), 0)  # prompt -> tokens so far
    for segments in plan:
        assert sum(end - start for _, start, end in segments) <= 6
        assert len({i for i, _, _ in segments}) == len(segments)  # one segment per prompt
        for i, start, end in segments:
            assert start == seen[i] and 0 < end - start <= 4  # chunk r after chunk r - 1
            seen[i] = end
    assert seen == dict(enumerate(lengths))
    assert [len(f) for f in plan] == [2, 2, 1, 2, 1]  # 4+2 | 4+1 | 4 ; 1+4 | 1
    assert prefill_plan([3, 7], 7, None) == [[(0, 0, 3), (1, 0, 7)]]  # eager: one forward
    with pytest.raises(ValueError, match="forwards of 2"):
        prefill_plan([3], 4, 2)


def test_prefill_in_many_forwards_equals_the_reference_target_and_drafter() -> None:
    """Capped prefill forwards (what graphs do with long prompts or many at once) leave the
    same logits, target cache and drafter context as one reference prefill per prompt."""
    target, drafter = _models(2)
    rt = BatchedRuntime(target, drafter, max_batch=5, max_len=128, gamma=3)
    rt.prefill_widths, rt.prefill_tokens = (2, 4), 6
    prompts = [[1, 2, 3, 4, 5], [6, 7], [1, 1, 2, 3, 5, 0, 7, 2, 4], [3], [4, 4, 0, 1]]
    caches, dcs = [target.new_cache(128) for _ in prompts], [drafter.new_cache() for _ in prompts]
    slots = [rt.acquire() for _ in prompts]
    first = rt.prefill(slots, prompts)
    for i, p in enumerate(prompts):
        ref = target.prefill(p, caches[i], drafter.hidden_layers)
        torch.testing.assert_close(first[i], ref.logits[0][-1], rtol=1e-9, atol=1e-9)
        drafter.extend(dcs[i], ref.hidden[0])
        rt.set_anchor(slots[i], i + 1)
    got = rt.draft([0.0] * len(slots), sts=np.ones((len(slots), 3)))
    want = drafter.draft_batch(dcs, [1, 2, 3, 4, 5], 3, 0.0)
    assert torch.equal(got.tokens, want.tokens)
    rows = [[i + 1, *got.tokens[i].tolist()] for i in range(len(slots))]
    out = rt.forward(slots, rows)
    ref = target.forward([torch.tensor(r) for r in rows], caches)
    for a, b in zip(out.split()[0], ref.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_drafts_equal_the_reference_drafter_after_commits_and_a_slot_move() -> None:
    target, drafter = _models(1)
    rt = BatchedRuntime(target, drafter, max_batch=3, max_len=128, gamma=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6], [3, 3]]
    caches, dcs = [target.new_cache(128) for _ in prompts], [drafter.new_cache() for _ in prompts]
    slots = [rt.acquire() for _ in prompts]
    rt.prefill(slots, prompts)
    for i, p in enumerate(prompts):
        drafter.extend(dcs[i], target.prefill(p, caches[i], drafter.hidden_layers).hidden[0])
        rt.set_anchor(slots[i], i + 1)
    anchors = [1, 2, 3]
    for step in range(4):
        got = rt.draft([0.0] * len(slots), sts=np.ones((len(slots), 4)))
        want = drafter.draft_batch(dcs, anchors, 4, 0.0)
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.confidence, want.confidence, rtol=1e-9, atol=1e-9)
        rows = [[a, *got.tokens[i].tolist()] for i, a in enumerate(anchors)]
        rt.forward(slots, rows)
        ref = target.forward([torch.tensor(r) for r in rows], caches, drafter.hidden_layers)
        for i, s in enumerate(slots):  # accept i % 3 drafts, then a new anchor
            keep = 1 + (i + step) % 3
            length = caches[i].length - len(rows[i]) + keep
            caches[i].truncate(length)
            drafter.extend(dcs[i], ref.hidden[i][:keep])
            anchors[i] = (anchors[i] + 3) % VOCAB
            rt.commit(s, length, anchors[i])
        if step == 1:  # context past the drafter's window of 16, then a move
            rt.release(0)
            caches, dcs, anchors, slots = caches[2:] + caches[1:2], dcs[2:] + dcs[1:2], \
                anchors[2:] + anchors[1:2], [0, 1]


def test_both_runtimes_agree_call_for_call_through_the_one_interface() -> None:
    """The loop's contract, driven identically on both runtimes: prefill, draft, a verify
    forward, commits that keep some drafts, a cap-accept style tail forward, a slot move."""
    target, drafter = _models(4)
    runtimes: list[Runtime] = [
        BatchedRuntime(target, drafter, max_batch=3, max_len=128, gamma=4),
        ReferenceRuntime(target, drafter, gamma=4),
    ]
    runtimes[1].reserve(3, 128)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [3, 3]]
    seen: list[list] = [[], []]
    for rt, log in zip(runtimes, seen, strict=True):
        slots = [rt.acquire() for _ in prompts]
        log.append(rt.prefill(slots, prompts))
        for s in slots:
            rt.set_anchor(s, s + 1)
        for step in range(4):
            blk = rt.draft([0.0] * len(slots))
            log.append((blk.tokens, blk.confidence))
            before = [rt.length(s) for s in slots]
            rows = [[s + 1, *blk.tokens[s, :3].tolist()] for s in slots]
            logits, argmax = rt.forward(slots, rows).split()
            log.append((torch.cat(logits), np.concatenate(argmax)))
            tail, _ = rt.forward([slots[0]], [blk.tokens[0, 3:].tolist()]).split()
            log.append(tail[0].clone())
            for s in slots:
                rt.commit(s, before[s] + 1 + (s + step) % 3, int(argmax[s][0]))
            log.append([rt.length(s) for s in slots])
            if step == 1:
                assert rt.release(0) == len(slots) - 1  # the last slot moves into 0
                slots = slots[:-1]
    for a, b in zip(*seen, strict=True):
        if isinstance(a, list):
            assert a == b
        elif isinstance(a, tuple):  # draft tokens are exact (integers), like argmax
            torch.testing.assert_close(a[0], b[0], rtol=1e-9, atol=1e-9)
            if isinstance(a[1], np.ndarray):
                assert np.array_equal(a[1], b[1])
            else:
                torch.testing.assert_close(a[1], b[1], rtol=1e-9, atol=1e-9)
        else:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mode", ["static", "compact", "cap-accept"])
def test_greedy_outputs_equal_plain_greedy_on_both_backends_and_with_overlap_off(
    mode: str,
) -> None:
    from tests.test_engine_loop import _trimming_table

    target, drafter = _models(2)
    reqs = _requests(7, seed=3)
    want = {r.rid: _plain_greedy(target, r.prompt_ids, r.max_new_tokens) for r in reqs}
    for backend in ("batched", "reference"):
        nospec = run_no_spec(target, reqs, max_batch=3, backend=backend)
        assert nospec.outputs == want and set(nospec.times) == set(want), backend
    for backend, overlap in (("reference", True), ("batched", True), ("batched", False)):
        cfg = EngineConfig(mode=mode, max_batch=3, backend=backend, overlap=overlap,
                           cost_table=_trimming_table())
        res = Engine(target, drafter, cfg).run(reqs, FanOut([MemorySink()]).emit, "g")
        assert res.outputs == want, (backend, overlap)


def test_overlap_defers_record_building_without_changing_a_record() -> None:
    from tests.test_engine_loop import _trimming_table

    target, drafter = _models(3)
    reqs = _requests(6, seed=4, temperature=1.0)
    tables = []
    for overlap in (True, False):
        sink = MemorySink()
        cfg = EngineConfig(
            mode="compact", max_batch=4, overlap=overlap, cost_table=_trimming_table(),
            backend="batched",
        )
        Engine(target, drafter, cfg).run(reqs, FanOut([sink]).emit, "o")
        rows = sink.table("req_steps").drop_columns(["ts"]).to_pylist()
        tables.append(sorted(rows, key=lambda r: (r["forward_ct"], r["rid"])))
        assert sink.table("requests").num_rows == len(reqs)
    assert tables[0] == tables[1]
    assert any(r["pg"] for r in tables[0]) and any(r["verify_len"] < 6 for r in tables[0])


def test_estimator_fields_agree_between_the_backends() -> None:
    from tests.test_engine_loop import _trimming_table

    target, drafter = _models(4)
    reqs = _requests(6, seed=5)
    out = {}
    for backend in ("reference", "batched"):
        sink = MemorySink()
        cfg = EngineConfig(mode="compact", max_batch=3, backend=backend,
                           cost_table=_trimming_table())
        Engine(target, drafter, cfg).run(reqs, FanOut([sink]).emit, "e")
        out[backend] = {
            (r["rid"], r["forward_ct"]): r for r in sink.table("req_steps").to_pylist()
        }
    ref, got = out["reference"], out["batched"]
    assert ref.keys() == got.keys()
    pgs = 0
    for key, row in ref.items():
        other = got[key]
        assert (row["trimmed_tokens"], row["q_lp"]) == (other["trimmed_tokens"], other["q_lp"])
        a, b = row["pg"] or [], got[key]["pg"] or []
        assert [(e["src_fct"], e["k"], e["draft_token"], e["realized_token"]) for e in a] == [
            (e["src_fct"], e["k"], e["draft_token"], e["realized_token"]) for e in b
        ]
        for ea, eb in zip(a, b, strict=True):
            assert ea["target_logprob"] == pytest.approx(eb["target_logprob"], rel=1e-6, abs=1e-6)
        pgs += len(a)
    assert pgs > 0


def test_sampling_companion_commits_what_compact_commits_on_the_batched_backend() -> None:
    from tests.test_engine_loop import _trimming_table

    target, drafter = _models(5)
    reqs = _requests(6, seed=6, temperature=0.8)
    outs = {}
    for mode in ("compact", "cap-accept"):
        cfg = EngineConfig(mode=mode, max_batch=4, cost_table=_trimming_table(), backend="batched")
        outs[mode] = Engine(target, drafter, cfg).run(reqs, FanOut([MemorySink()]).emit, mode)
    assert outs["compact"].outputs == outs["cap-accept"].outputs


def test_the_runtime_is_shared_across_runs_and_a_busy_one_is_not_handed_out() -> None:
    target, drafter = _models(6)
    a = shared_runtime(target, drafter, max_batch=2, max_len=64, gamma=3)
    a.busy = False
    b = shared_runtime(target, drafter, max_batch=4, max_len=300, gamma=3)
    assert b is a and b.pool.slots >= 4 and b.pool.max_len >= 300  # grown, graphs recaptured
    c = shared_runtime(target, drafter, max_batch=2, max_len=64, gamma=3)
    assert c is not a  # a is still busy
    eng = Engine(target, drafter, EngineConfig(gamma=3, max_batch=2, backend="batched"))
    eng.run(_requests(2), FanOut([MemorySink()]).emit, "s1")
    first = eng._runtime
    eng.run(_requests(2, seed=1), FanOut([MemorySink()]).emit, "s2")
    assert eng._runtime is first and not first.busy


def test_a_longer_request_arriving_mid_run_grows_the_pool_and_stays_exact() -> None:
    target, drafter = _models(7)
    early = _requests(2, seed=8)
    late = replace(_requests(1, seed=9)[0], rid="late", max_new_tokens=200)
    fed = []

    def source(idle: bool) -> list[GenRequest] | None:
        if not fed:
            fed.append(1)
            return [late]
        return None

    res = Engine(target, drafter, EngineConfig(max_batch=3, backend="batched")).run(
        early, FanOut([MemorySink()]).emit, "grow", source=source
    )
    for r in [*early, late]:
        assert res.outputs[r.rid] == _plain_greedy(target, r.prompt_ids, r.max_new_tokens)


def test_graph_keys_cover_every_decode_step_shape_and_capture_is_a_no_op_on_cpu() -> None:
    target, drafter = _models(8)
    rt = BatchedRuntime(target, drafter, max_batch=16, max_len=256, gamma=5)
    keys = {k for bank, k in rt.graph_keys(256) if bank == "verify"}
    block = {k for bank, k in rt.graph_keys(256) if bank == "block"}
    trimmed = {k for bank, k in rt.graph_keys(256, trims=True) if bank == "block"}
    rest = {k for bank, k in rt.graph_keys(256, trims=True, rest=True) if bank == "rest"}
    assert not any(bank == "rest" for bank, _ in rt.graph_keys(256, trims=True))
    span = rt._span(256)
    for batch in range(1, 17):
        bt = tier_of(batch, rt.batch_tiers)
        for n in range(batch, 6 * batch + 1):
            assert (6, bt, tier_of(n, rt.token_tiers), span, False) in keys
            # a compact budget of n - batch drafts packs n tokens on the device
            assert (6, bt, tier_of(n, rt.token_tiers), span) in trimmed
        for n in range(1, 5 * batch + 1):  # cap-accept: n drafts past the windows
            assert (6, bt, tier_of(n, rt.token_tiers), span) in rest
        assert (6, bt, tier_of(6 * batch, rt.token_tiers), span) in block
    assert block < trimmed
    assert rt.capture(256) == 0  # graphs are off on the CPU


def test_auto_picks_the_batched_runtime_and_reference_only_when_asked() -> None:
    target, drafter = _models(9)
    assert Engine(target, drafter, EngineConfig()).batched  # on the CPU too (it measured faster)
    assert Engine(target, drafter, EngineConfig(backend="batched")).batched
    assert not Engine(target, drafter, EngineConfig(backend="reference")).batched


def test_bad_tiers_and_backend_are_refused() -> None:
    with pytest.raises(EngineError, match="backend"):
        EngineConfig(backend="fast")
    with pytest.raises(EngineError, match="token_tiers"):
        EngineConfig(token_tiers=(0, 4))


def test_layers_compile_with_inductors_disk_caches_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled layer loaded from inductor's on-disk cache, written by a process with
    another pool length, stopped on a size assertion on an H200: the runtime's functions
    compile with those caches off (and the raised recompile limit), and only while they
    compile."""
    import torch._inductor.config as inductor

    seen = []

    def backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        seen.append((inductor.force_disable_caches, torch._dynamo.config.recompile_limit))
        return gm.forward

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    monkeypatch.setattr(packed, "_COMPILED", {})
    target, drafter = _models(3)
    rt = BatchedRuntime(target, drafter, max_batch=2, max_len=64, gamma=3, cuda_graphs=False,
                        compiled=True)  # fmt: skip
    slot = rt.acquire()
    rt.prefill([slot], [[1, 2, 3]])
    rt.set_anchor(slot, 4)
    rt.draft([0.0])
    assert len(seen) >= 4  # the target layer, the context write, a drafter layer, the chain
    assert set(seen) == {(True, packed._GRAPHS_PER_FUNCTION)}
    assert not inductor.force_disable_caches


def test_compiled_layers_compute_what_the_eager_ones_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compiled=True`` (what CUDA runs: each target layer and each drafter layer under
    ``torch.compile``, one whole graph each) against the same runtime eager: the pool
    writes, the logits and the drafts agree. Traced through dynamo and AOT autograd
    (``aot_eager``: the graphs, the in-place scatters into the pool planes), not inductor's
    code generation, which the GPU benches run (here it doubles the test's time; it agreed
    at 1e-5 when run once; ``bench/check_compiled.py`` runs inductor on the GPU)."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", functools.partial(real, backend="aot_eager"))
    monkeypatch.setattr(packed, "_COMPILED", {})
    target, drafter = _models(3)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [1, 1, 2, 3, 5, 0, 7]]
    steps = [[[1, 2], [3], [4, 5, 6]], [[7], [0, 1, 2], [3]]]
    runs = eager_and_compiled(target, drafter, prompts, steps, gamma=3, max_len=64)
    eager, comp = runs[False], runs[True]
    for a, b in zip(eager.logits, comp.logits, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comp.kv, eager.kv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comp.dkv, eager.dkv, rtol=1e-5, atol=1e-5)
    assert torch.equal(comp.block.tokens, eager.block.tokens)
    torch.testing.assert_close(comp.block.confidence, eager.block.confidence, rtol=1e-5, atol=1e-5)
