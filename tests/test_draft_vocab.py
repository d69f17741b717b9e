"""A reduced draft vocabulary: drafts and q stay exact over the kept ids, and the engine stays
lossless with it (greedy token for token, sampling in distribution) on both backends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dspark_obs.engine.draft_vocab import (
    CPU_DRAFT_VOCAB,
    default_draft_vocab,
    draft_vocab,
    load_ranking,
    rank_tokens,
    resolve_draft_vocab,
    save_ranking,
)
from dspark_obs.engine.drafter import Drafter
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.model import Target
from dspark_obs.engine.types import EngineConfig, GenRequest
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.testing.tiny_models import tiny_pair
from tests.test_engine_loop import _trimming_table
from tests.test_engine_requests import _exact_two_token_law, _masked_greedy, _requests

VOCAB = 6
KEPT = [0, 2, 3, 5]


def _models(seed: int = 0) -> tuple[Target, Drafter]:
    # a drafter far from its init, so drafts vary
    return tiny_pair(seed, vocab_size=VOCAB, context_window=16, perturb=0.3)


def _block(drafter: Drafter, temperature: float, seed: int = 3):
    torch.manual_seed(seed)
    hidden = torch.randn(7, drafter.fc.in_features, dtype=torch.float64)
    gens = [torch.Generator().manual_seed(seed + i) for i in range(2)]
    caches = [drafter.new_cache(), drafter.new_cache()]
    return drafter.draft_batch(caches, [1, 4], 5, temperature, gens, [hidden, hidden[:4]])


def test_the_whole_vocabulary_as_draft_vocabulary_changes_nothing() -> None:
    _, drafter = _models(1)
    for t in (0.0, 0.8):
        plain = _block(drafter, t)
        drafter.set_draft_vocab(range(VOCAB))
        same = _block(drafter, t)
        drafter.set_draft_vocab(None)
        assert torch.equal(plain.tokens, same.tokens)
        torch.testing.assert_close(same.probs, plain.probs, rtol=0, atol=1e-12)
        torch.testing.assert_close(same.confidence, plain.confidence, rtol=0, atol=1e-12)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_drafts_come_from_the_kept_ids_with_exact_q(temperature: float) -> None:
    _, drafter = _models(2)
    drafter.set_draft_vocab(KEPT)
    blk = _block(drafter, temperature)
    drafter.set_draft_vocab(None)
    assert set(blk.tokens.flatten().tolist()) <= set(KEPT)
    dropped = [t for t in range(VOCAB) if t not in KEPT]
    assert torch.all(blk.probs[..., dropped] == 0)
    torch.testing.assert_close(blk.probs.sum(-1), torch.ones_like(blk.probs.sum(-1)))
    at = blk.probs.gather(-1, blk.tokens[..., None])[..., 0]
    torch.testing.assert_close(blk.logprobs, at.log())
    # position 0 (no earlier draft): q is the full drafter's q restricted and renormalized
    full = _block(drafter, temperature).probs[:, 0, KEPT]
    torch.testing.assert_close(blk.probs[:, 0, KEPT], full / full.sum(-1, keepdim=True))


@pytest.mark.parametrize("backend", ["reference", "batched"])
def test_greedy_with_a_draft_vocabulary_equals_plain_greedy(backend: str) -> None:
    target, drafter = _models(3)
    reqs = _requests(6, seed=5)
    drafter.set_draft_vocab(KEPT)
    try:
        cfg = EngineConfig(
            mode="compact", max_batch=3, backend=backend, cost_table=_trimming_table()
        )
        res = Engine(target, drafter, cfg).run(reqs, FanOut([MemorySink()]).emit, "dv")
    finally:
        drafter.set_draft_vocab(None)
    for r in reqs:
        assert res.outputs[r.rid] == _masked_greedy(target, r.prompt_ids, r.max_new_tokens, set())


@pytest.mark.parametrize("backend", ["reference", "batched"])
def test_sampling_with_a_draft_vocabulary_follows_the_target_distribution(backend: str) -> None:
    target, drafter = _models(4)
    prompt, t, n = [1, 4, 2, 0], 1.0, 600  # fixed seeds: deterministic, bound ~4x the noise
    reqs = [
        GenRequest(rid=f"s{i}", prompt_ids=prompt, max_new_tokens=2, temperature=t, seed=2000 + i)
        for i in range(n)
    ]
    drafter.set_draft_vocab(KEPT[:2])  # most target mass lies outside: the residual covers it
    try:
        cfg = EngineConfig(mode="static", max_batch=64, backend=backend)
        res = Engine(target, drafter, cfg).run(reqs, FanOut([]).emit, "law")
    finally:
        drafter.set_draft_vocab(None)
    seen: dict[tuple[int, int], int] = {}
    for out in res.outputs.values():
        seen[(out[0], out[1])] = seen.get((out[0], out[1]), 0) + 1
    law = _exact_two_token_law(target, prompt, [], t)
    tv = 0.5 * sum(abs(seen.get(k, 0) / n - p) for k, p in law.items())
    assert tv < 0.12, tv
    assert any(out[1] not in KEPT[:2] for out in res.outputs.values())  # the residual drew


def test_ranking_by_frequency_and_vocabulary_of_size_n(tmp_path: Path) -> None:
    ranking = rank_tokens([[5, 5, 3], [3, 5, 9], [1]])
    assert ranking == [5, 3, 1, 9]  # ties broken by the lower id
    assert draft_vocab(ranking, 2, always=[0]) == [0, 3, 5]
    path = save_ranking(tmp_path / "v.json", ranking, "test")
    assert load_ranking(path) == ranking
    with pytest.raises(ValueError, match="n >= 1"):
        draft_vocab(ranking, 0)
    with pytest.raises(ValueError, match="no draft vocabulary ranking"):
        load_ranking(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"ranking": "x"}))
    with pytest.raises(ValueError, match="not a draft vocabulary ranking"):
        load_ranking(tmp_path / "bad.json")
    _, drafter = _models(0)
    with pytest.raises(ValueError, match="0..5"):
        drafter.set_draft_vocab([0, VOCAB])


def test_the_cpu_drafts_from_a_reduced_vocabulary_by_default_and_a_gpu_from_the_whole() -> None:
    assert default_draft_vocab("cpu") == CPU_DRAFT_VOCAB == 16384
    assert default_draft_vocab("cuda") == default_draft_vocab("cuda:1") == 0
    assert resolve_draft_vocab(None, "cpu") == 16384 and resolve_draft_vocab(None, "cuda") == 0
    assert resolve_draft_vocab(0, "cpu") == 0  # asked for: the whole vocabulary
    with pytest.raises(ValueError, match="--draft-vocab must be >= 0"):
        resolve_draft_vocab(-1, "cpu")
