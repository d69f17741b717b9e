"""DSpark drafter: exact left-to-right draft probabilities, confidence/STS, caches, persistence,
and the shipped checkpoint against the real SmolLM2 (skipped only without the GGUF)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_obs.analytics.calibration import auroc, ece
from dspark_obs.engine.drafter import Drafter
from dspark_obs.engine.drafter_config import DrafterConfig
from dspark_obs.engine.drafter_eval import _accept, speculative_run
from dspark_obs.engine.model import KVCache, ModelConfig, Target

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "runtime" / "drafter"


def _target(**kw: object) -> Target:
    torch.manual_seed(0)
    return Target(ModelConfig.tiny(**kw)).eval()


def _drafter(target: Target, **kw: object) -> Drafter:
    torch.manual_seed(1)
    cfg = DrafterConfig.for_target(target, gamma_max=4, num_layers=2, markov_rank=8, **kw)
    d = Drafter(cfg, target).eval()
    with torch.no_grad():  # a non-trivial Markov head and confidence head
        d.markov_v.normal_(std=0.5)
        d.markov_u.weight.normal_(std=0.5)
        d.conf_head.weight.normal_(std=0.5)
    return d


def _context(target: Target, drafter: Drafter, n: int, seed: int = 0) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, target.cfg.vocab_size, (n,), generator=g)
    out = target.forward([toks], [KVCache(target.cfg, n + 8)], drafter.hidden_layers)
    return out.hidden[0], int(out.logits[0][-1].argmax())


def test_draft_probabilities_are_exact_left_to_right() -> None:
    tgt = _target()
    d = _drafter(tgt)
    hidden, anchor = _context(tgt, d, 9)
    temp = 0.7
    blk = d.draft(
        hidden, anchor, gamma=4, temperature=temp, generator=torch.Generator().manual_seed(3)
    )
    assert blk.tokens.shape == (4,) and blk.probs.shape == (4, tgt.cfg.vocab_size)
    assert torch.allclose(blk.probs.sum(-1), torch.ones(4), atol=1e-5)
    # teacher-forced recomputation with the drafted tokens as the realized block
    n = hidden.shape[0]
    seq = torch.cat([torch.zeros(n, dtype=torch.long), torch.tensor([anchor]), blk.tokens])[None]
    feats = torch.zeros(1, seq.shape[1], hidden.shape[1])
    feats[0, :n] = hidden
    with torch.no_grad():
        _, logits, z = d.forward_train(feats, seq, torch.tensor([[n]]), d.cfg.gamma_max)
    q = torch.softmax(logits[0, 0] / temp, -1)  # [gamma, V]
    assert torch.allclose(q, blk.probs, atol=1e-5)
    q_tok = q.gather(1, blk.tokens[:, None])[:, 0]
    assert torch.allclose(q_tok.log(), blk.logprobs, atol=1e-5)
    assert torch.allclose(z[0, 0], blk.conf_logits, atol=1e-5)


def test_markov_head_changes_later_positions_with_the_previous_draft() -> None:
    tgt = _target()
    d = _drafter(tgt)
    hidden, anchor = _context(tgt, d, 7)
    a = d.draft(
        hidden, anchor, gamma=3, temperature=1.0, generator=torch.Generator().manual_seed(0)
    )
    b = d.draft(
        hidden, anchor, gamma=3, temperature=1.0, generator=torch.Generator().manual_seed(5)
    )
    assert torch.allclose(a.probs[0], b.probs[0])  # position 1 only depends on the anchor
    if a.tokens[0] != b.tokens[0]:
        assert not torch.allclose(a.probs[1], b.probs[1])


def test_greedy_takes_argmax_and_shorter_gamma_is_a_prefix() -> None:
    tgt = _target()
    d = _drafter(tgt)
    hidden, anchor = _context(tgt, d, 6)
    full = d.draft(hidden, anchor, gamma=4, temperature=0.0)
    assert torch.equal(full.tokens, full.probs.argmax(-1))
    short = d.draft(hidden, anchor, gamma=2, temperature=0.0)
    assert torch.equal(short.tokens, full.tokens[:2])
    assert torch.allclose(short.confidence, full.confidence[:2])
    with pytest.raises(ValueError, match="gamma"):
        d.draft(hidden, anchor, gamma=5)


@pytest.mark.parametrize("draft_vocab", [None, [0, 3, 5, 7, 11]])
def test_greedy_chain_without_probs_drafts_the_same_block(draft_vocab: list[int] | None) -> None:
    """The graph path's greedy chain skips q (greedy acceptance never reads it): the same
    tokens, log q at the drafts and confidences, with ``probs`` left empty."""
    tgt = _target()
    d = _drafter(tgt)
    d.set_draft_vocab(draft_vocab)
    g = torch.Generator().manual_seed(4)
    h = torch.randn(3, 4, tgt.cfg.hidden_size, generator=g)
    base = d.draft_logits(h).float()
    anchors, temps = torch.tensor([1, 2, 3]), torch.zeros(3)
    full = d.chain(h, base, anchors, temps, all_greedy=True)
    lean = d.chain(h, base, anchors, temps, all_greedy=True, with_probs=False)
    assert torch.equal(lean.tokens, full.tokens) and lean.probs.numel() == 0
    torch.testing.assert_close(lean.logprobs, full.logprobs, rtol=1e-5, atol=1e-5)
    assert torch.equal(lean.confidence, full.confidence)


def test_per_request_generators_are_batch_independent() -> None:
    tgt = _target()
    d = _drafter(tgt)
    (h1, a1), (h2, a2) = _context(tgt, d, 5, seed=1), _context(tgt, d, 8, seed=2)
    g_greedy, g_samp = torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)
    batch = d.draft_batch(
        [d.new_cache(), d.new_cache()], [a1, a2], 3, [0.0, 1.0], [g_greedy, g_samp], [h1, h2]
    )
    assert torch.equal(g_greedy.get_state(), torch.Generator().manual_seed(11).get_state())
    alone = d.draft(h2, a2, gamma=3, temperature=1.0, generator=torch.Generator().manual_seed(12))
    assert torch.equal(batch.tokens[1], alone.tokens)
    assert torch.equal(batch.tokens[0], d.draft(h1, a1, gamma=3).tokens)


def test_confidence_in_unit_interval_and_sts_applied(tmp_path: Path) -> None:
    tgt = _target()
    d = _drafter(tgt)
    hidden, anchor = _context(tgt, d, 8)
    blk = d.draft(hidden, anchor, gamma=4)
    assert ((blk.confidence > 0) & (blk.confidence < 1)).all()
    assert torch.allclose(blk.confidence, torch.sigmoid(blk.conf_logits))
    assert torch.allclose(blk.survival, torch.cumprod(blk.confidence, 0))
    temps = [0.5, 2.0, 3.0, 4.0]
    sts = tmp_path / "sts.json"
    sts.write_text(json.dumps({"temperatures": temps, "dataset": "x", "num_samples": 3}))
    d.set_sts(sts)
    blk2 = d.draft(hidden, anchor, gamma=4)
    assert torch.allclose(blk2.conf_logits, blk.conf_logits)
    assert torch.allclose(blk2.confidence, torch.sigmoid(blk.conf_logits / torch.tensor(temps)))
    d.set_sts([1.0])  # fewer temperatures than gamma: refused at draft time
    with pytest.raises(ValueError, match="STS"):
        d.draft(hidden, anchor, gamma=2)


@pytest.mark.parametrize(
    "payload",
    [{"temps": [1.0]}, {"temperatures": []}, {"temperatures": [1.0, -1.0]},
     {"temperatures": [1.0, "x"]}, {"temperatures": [float("inf")]}, [1.0]],
)  # fmt: skip
def test_set_sts_rejects_bad_files_and_keeps_what_it_had(tmp_path: Path, payload: object) -> None:
    d = _drafter(_target())
    d.set_sts([0.5, 2.0])
    p = tmp_path / "sts.json"
    p.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="sts.json"):
        d.set_sts(p)
    assert d.sts_temperatures.tolist() == [0.5, 2.0]


def test_set_sts_judges_a_served_file_as_sglang_does(tmp_path: Path) -> None:
    """Only the temperatures decide (SGLang ignores the rest): ECE lists of another length,
    as drafter v2's sts_greedy.json had, do not stop serving; the full record reader refuses."""
    from dspark_obs.sts_file import StsCalibration, StsFileError

    p = tmp_path / "sts.json"
    p.write_text(json.dumps({"temperatures": [0.5, 2.0, 1.5], "ece_before": [0.1, 0.2]}))
    d = _drafter(_target())
    d.set_sts(p, regime="greedy")
    assert d.sts(3, greedy=True).tolist() == [0.5, 2.0, 1.5]
    with pytest.raises(StsFileError, match="'ece_before' has 2 values but there are 3"):
        StsCalibration.load(p)


def test_shipped_sts_files_are_whole_sglang_files_for_every_trained_position() -> None:
    """Each regime's shipped STS passes the strict reader and covers the trained block."""
    from dspark_obs.sts_file import StsCalibration

    root = Path(__file__).resolve().parents[1] / "runtime" / "drafter"
    gamma_max = json.loads((root / "config.json").read_text())["drafter"]["gamma_max"]
    for name in ("sts.json", "sts_greedy.json"):
        cal = StsCalibration.load(root / name)
        assert len(cal.temperatures) == gamma_max, name


def test_cache_incremental_equals_one_shot_and_window() -> None:
    tgt = _target()
    d = _drafter(tgt)
    hidden, anchor = _context(tgt, d, 12)
    one = d.new_cache()
    d.extend(one, hidden)
    inc = d.new_cache()
    for s in range(0, 12, 5):
        d.extend(inc, hidden[s : s + 5])
    assert inc.num_positions == one.num_positions == 12
    a = d.draft_batch([one], [anchor], 3)
    b = d.draft_batch([inc], [anchor], 3)
    assert torch.allclose(a.probs, b.probs, atol=1e-6)
    inc.truncate(10)
    assert inc.num_positions == 10 and inc.length == 10
    small = _drafter(tgt, context_window=4)
    c = small.new_cache()
    small.extend(c, hidden)
    assert c.length == 4 and c.num_positions == 12


def test_batched_draft_matches_single_requests() -> None:
    tgt = _target()
    d = _drafter(tgt)
    (h1, a1), (h2, a2) = _context(tgt, d, 5, seed=1), _context(tgt, d, 11, seed=2)
    c1, c2 = d.new_cache(), d.new_cache()
    batch = d.draft_batch([c1, c2], [a1, a2], 3, 0.0, new_hidden=[h1, h2])
    s1 = d.draft(h1, a1, gamma=3)
    s2 = d.draft(h2, a2, gamma=3)
    assert torch.allclose(batch.probs[0], s1.probs, atol=1e-5)
    assert torch.allclose(batch.probs[1], s2.probs, atol=1e-5)
    assert torch.equal(batch.tokens, torch.stack([s1.tokens, s2.tokens]))


def test_save_load_round_trip_and_mismatch(tmp_path: Path) -> None:
    tgt = _target()
    d = _drafter(tgt)
    with torch.no_grad():  # stored as bf16: make the reference exactly representable
        for p in d.parameters():
            p.copy_(p.bfloat16().float())
    d.set_sts([1.5, 1.0, 1.0, 1.0])
    d.save(tmp_path / "dr", meta={"note": "test"})
    back = Drafter.load(tmp_path / "dr", tgt)
    hidden, anchor = _context(tgt, d, 7)
    a, b = d.draft(hidden, anchor, gamma=4), back.draft(hidden, anchor, gamma=4)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.probs, b.probs, atol=1e-6)
    assert torch.allclose(a.confidence, b.confidence, atol=1e-6)  # STS travelled too
    with pytest.raises(ValueError, match="hidden_size"):
        Drafter.load(tmp_path / "dr", _target(hidden_size=32))
    with pytest.raises(ValueError, match="num_layers"):
        Drafter.load(tmp_path / "dr", _target(num_layers=3))


def test_accept_rules_and_ece() -> None:
    v = 4
    logits = torch.full((3, v), -10.0)
    logits[0, 1] = logits[1, 2] = logits[2, 3] = 10.0
    q = torch.full((2, v), 0.25)
    gen = torch.Generator().manual_seed(0)
    assert _accept(logits, torch.tensor([1, 2]), q, 0.0, gen) == (2, 3)
    assert _accept(logits, torch.tensor([1, 0]), q, 0.0, gen) == (1, 2)
    # p puts ~all mass on the drafted token: min(1, p/q) = 1 -> always accepted
    c, _ = _accept(logits, torch.tensor([1, 2]), q, 1.0, gen)
    assert c == 2
    # hand-computed ECE: two bins
    pred = np.array([0.1, 0.1, 0.9, 0.9])
    lab = np.array([0, 1, 1, 1])
    assert math.isclose(ece(pred, lab), (2 * 0.4 + 2 * 0.1) / 4)


# -- the shipped checkpoint with the real SmolLM2 --------------------------------------------


def test_shipped_checkpoint_drafts_for_smollm2() -> None:
    from dspark_obs.engine.weights import (
        ModelFetchError,
        encode_chat,
        fetch_model,
        load_smollm2,
        stop_token_ids,
    )
    from dspark_obs.workloads import load_prompts

    try:
        path = fetch_model(progress=False)
    except ModelFetchError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")
    target, tok = load_smollm2(path=path)
    drafter = Drafter.load(SHIPPED, target)
    assert drafter.hidden_layers == (2, 15, 27)
    prompts = [encode_chat(tok, p.messages) for p in load_prompts("math", "eval", 3, 0)]
    stats = speculative_run(
        target, drafter, prompts, gamma=5, temperature=0.0, max_new_tokens=48,
        eos_ids=stop_token_ids(tok),
    )  # fmt: skip
    summary = stats.summary()
    assert summary["mean_accept_length"] > 1.5, summary
    # greedy speculative decoding must reproduce plain greedy decoding exactly
    cache = target.new_cache(len(prompts[0]) + 64)
    out = target.forward([torch.tensor(prompts[0])], [cache])
    ref: list[int] = []
    for _ in range(len(stats.outputs[0])):
        t = int(out.logits[0][-1].argmax())
        ref.append(t)
        out = target.forward([torch.tensor([t])], [cache])
    assert stats.outputs[0] == ref


# -- confidence per sampling regime ------------------------------------------------------------


def test_greedy_requests_read_the_greedy_head_and_their_own_sts(tmp_path: Path) -> None:
    tgt = _target()
    d = _drafter(tgt, greedy_confidence=True)
    assert d.conf_head_greedy is not None
    with torch.no_grad():  # two heads that disagree: sampling says "reject", greedy "accept"
        d.conf_head.weight.zero_()
        d.conf_head.bias.fill_(-3.0)
        d.conf_head_greedy.weight.zero_()
        d.conf_head_greedy.bias.fill_(3.0)
    hidden, anchor = _context(tgt, d, 8)
    caches = [d.new_cache(), d.new_cache()]
    gens = [None, torch.Generator().manual_seed(0)]
    blk = d.draft_batch(caches, [anchor, anchor], 4, [0.0, 1.0], gens, [hidden, hidden])
    sig = torch.sigmoid(torch.tensor(3.0))
    assert torch.allclose(blk.confidence[0], sig.expand(4))  # greedy row: greedy head
    assert torch.allclose(blk.confidence[1], (1 - sig).expand(4))  # sampled row
    assert torch.allclose(blk.conf_logits, torch.tensor([[3.0] * 4, [-3.0] * 4]))
    # STS per regime: the greedy file touches greedy rows only
    d.set_sts([3.0] * 4, regime="greedy")
    blk = d.draft_batch(
        [d.new_cache(), d.new_cache()], [anchor, anchor], 4, [0.0, 1.0], gens, [hidden, hidden]
    )
    assert torch.allclose(blk.confidence[0], torch.sigmoid(torch.tensor(1.0)).expand(4))
    assert torch.allclose(blk.confidence[1], (1 - sig).expand(4))
    d.set_sts([0.5] * 4, regime="sample")
    d.save(tmp_path / "dr")
    saved = {p.name for p in (tmp_path / "dr").iterdir()}
    assert {"sts.json", "sts_greedy.json"} <= saved
    back = Drafter.load(tmp_path / "dr", tgt)
    assert back.sts(4, greedy=True).tolist() == [3.0] * 4 and back.sts(4).tolist() == [0.5] * 4
    # a user-supplied file ("all") applies to every request, greedy ones included
    back.set_sts([2.0] * 4)
    assert back.sts(4, greedy=True).tolist() == [2.0] * 4
    with pytest.raises(ValueError, match="regime"):
        back.set_sts([1.0] * 4, regime="beam")


def test_config_without_greedy_head_still_loads(tmp_path: Path) -> None:
    tgt = _target()
    d = _drafter(tgt)
    d.save(tmp_path / "old")
    conf = json.loads((tmp_path / "old" / "config.json").read_text())
    del conf["drafter"]["greedy_confidence"]  # a config written before the greedy head
    (tmp_path / "old" / "config.json").write_text(json.dumps(conf))
    back = Drafter.load(tmp_path / "old", tgt)
    assert back.conf_head_greedy is None
    hidden, anchor = _context(tgt, d, 6)
    assert back.draft(hidden, anchor, gamma=3).conf_logits.shape == (3,)


def test_auroc_and_calibration_report_by_construction() -> None:
    from dspark_obs.engine.drafter_eval import calibration_report, merge_results

    assert auroc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75
    assert auroc(np.array([0.5, 0.5]), np.array([0, 1])) == 0.5
    assert math.isnan(auroc(np.array([0.5]), np.array([1])))

    def records(seed: int, n: int) -> dict:
        # true per-position logits t; the head reports 3 * t (over-confident): STS should
        # find T ~ 3 at every position
        rng = np.random.default_rng(seed)
        t = rng.normal(0.5, 1.5, (n, 3))
        ok = rng.random((n, 3)) < 1 / (1 + np.exp(-t))
        correct = np.cumprod(ok, 1).sum(1)
        return {"correct": correct.tolist(), "conf_logits": (3 * t).tolist()}

    def res(seed: int) -> dict:
        r = {f"w{i}@T0": records(seed + i, 3000) for i in range(2)}
        summary = {k: {} for k in r}
        return {"gamma": 3, "max_new_tokens": 8, "prompts": {}, "results": summary, "records": r}

    fit = merge_results([res(0)])
    rep = calibration_report(fit, res(10), gamma_max=5)["T0"]
    assert len(rep["sts"]["temperatures"]) == 5  # padded to the drafter's block
    assert all(2.0 < t < 4.5 for t in rep["sts"]["temperatures"][:3])
    pooled = rep["eval"]["pooled"]
    assert max(pooled["ece_sts"]) < 0.03 < min(pooled["ece_raw"][:1])
    assert 0.5 < pooled["auroc_1"] <= 1.0
    with pytest.raises(ValueError, match="gamma"):
        merge_results([res(0), {**res(1), "gamma": 4}])
