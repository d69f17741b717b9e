"""Drafter training: the DSpark loss on hand-computed cases, the padded target runner against
the engine's ragged forward, a CPU smoke run that lowers the loss, and exact resume."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from dspark_obs.engine.drafter import Drafter
from dspark_obs.engine.model import KVCache, ModelConfig, Target
from dspark_obs.engine.train import train_drafter
from dspark_obs.engine.train_data import batch_indices, sample_anchors
from dspark_obs.engine.train_loss import drafter_loss, position_weights, tv_distance
from dspark_obs.engine.train_runner import PaddedRunner


def test_tv_and_position_weights_by_hand() -> None:
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.25, 0.25, 0.5])
    assert math.isclose(float(tv_distance(p, q)), 0.5)
    assert float(tv_distance(p, p)) == 0.0
    w = position_weights(3, 2.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))


def test_loss_matches_hand_computation() -> None:
    # one block, gamma = 2, vocab = 2
    logits = torch.log(torch.tensor([[[0.75, 0.25], [0.5, 0.5]]])).requires_grad_(True)
    tlogits = torch.log(torch.tensor([[[0.25, 0.75], [0.5, 0.5]]]))
    z = torch.tensor([[0.0, 2.0]], requires_grad=True)
    nxt = torch.tensor([[1, 0]])
    valid = torch.tensor([[True, True]])
    parts = drafter_loss(logits, z, tlogits, nxt, valid, gamma_decay=1.0)
    tv = [0.5, 0.0]  # 0.5*(|.75-.25|+|.25-.75|), identical rows
    ce = [-math.log(0.25), -math.log(0.5)]
    acc = [1 - t for t in tv]  # BCE targets 1 - TV

    def bce(x: float, y: float) -> float:
        s = 1 / (1 + math.exp(-x))
        return -(y * math.log(s) + (1 - y) * math.log(1 - s))

    per = [0.1 * ce[k] + 0.9 * tv[k] + bce([0.0, 2.0][k], acc[k]) for k in range(2)]
    w = [1.0, math.exp(-1.0)]
    want = (per[0] * w[0] + per[1] * w[1]) / (w[0] + w[1])
    assert math.isclose(float(parts.loss.detach()), want, rel_tol=1e-5)
    assert parts.accept_1mtv == pytest.approx([0.5, 1.0])
    assert parts.greedy_match == pytest.approx([0.0, 1.0])  # argmax ties break to index 0
    # the BCE target is detached: with CE and TV switched off, logits get no gradient
    only_bce = drafter_loss(logits, z, tlogits, nxt, valid, 1.0, w_ce=0.0, w_tv=0.0)
    only_bce.loss.backward()
    assert logits.grad is not None and float(logits.grad.abs().sum()) == 0.0
    assert z.grad is not None and float(z.grad.abs().sum()) > 0
    # invalid positions do not count
    masked = drafter_loss(logits, z, tlogits, nxt, torch.tensor([[True, False]]), 1.0)
    assert math.isclose(float(masked.loss.detach()), per[0], rel_tol=1e-5)


def test_batch_order_and_anchors_are_deterministic() -> None:
    a = batch_indices(10, 4, 3, seed=7)
    assert a == batch_indices(10, 4, 3, seed=7) and len(a) == 4
    epoch = sum((batch_indices(10, 5, s, 1) for s in range(2)), [])
    assert sorted(epoch) == list(range(10))  # one epoch = a permutation
    anc = sample_anchors([3, 5], [10, 8], 4, torch.Generator().manual_seed(0))
    assert anc.shape == (2, 4)
    assert (anc[0] >= 3).all() and (anc[0] <= 8).all()
    assert (anc[1] >= 5).all() and (anc[1] <= 6).all()


def _tiny_target() -> Target:
    torch.manual_seed(0)
    tgt = Target(ModelConfig.tiny()).eval()
    with torch.no_grad():  # sharper distributions than the 0.02 init: something to learn
        tgt.tok_embeddings.weight.mul_(40.0)
    return tgt


def test_padded_runner_matches_ragged_forward() -> None:
    tgt = _tiny_target()
    run = PaddedRunner(tgt, "cpu")
    seqs = [torch.randint(0, 128, (n,)) for n in (6, 11, 3)]
    toks = torch.zeros(3, 11, dtype=torch.long)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
    hid, last = run.features(toks, (0, 1))
    for i, s in enumerate(seqs):
        out = tgt.forward([s], [KVCache(tgt.cfg, 16)], (0, 1))
        assert torch.allclose(out.hidden[0], hid[i, : len(s)], atol=1e-4)
        assert torch.allclose(out.logits[0], tgt.lm_head(last[i, : len(s)]), atol=1e-3)
    gen = run.generate([s.tolist() for s in seqs], 8, 0.0, torch.Generator(), eos_ids=[])
    for i, s in enumerate(seqs):
        cache = KVCache(tgt.cfg, 32)
        out = tgt.forward([s], [cache])
        ref = []
        for _ in range(8):
            t = int(out.logits[0][-1].argmax())
            ref.append(t)
            out = tgt.forward([torch.tensor([t])], [cache])
        assert gen[i] == ref


def _prompts(n: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(0)
    return [
        ("math", [rng.randrange(3, 128) for _ in range(rng.randrange(4, 10))]) for _ in range(n)
    ]


def _train(out: Path, steps: int, resume: bool = False, stop_after: int | None = None):  # noqa: ANN202
    return train_drafter(
        _tiny_target(),
        out_dir=out,
        prompts=_prompts(12),
        gamma=3,
        steps=steps,
        batch_size=6,
        lr=3e-3,
        warmup=3,
        resume=resume,
        stop_after=stop_after,
        max_new_tokens=20,
        blocks_per_seq=4,
        gen_batch_size=12,
        ckpt_every=5,
        log_every=5,
        eos_ids=[1],
        drafter_config={"num_layers": 1, "markov_rank": 8},
        log=lambda s: None,
    )


def test_smoke_training_lowers_loss_and_exports(tmp_path: Path) -> None:
    res = _train(tmp_path / "a", steps=30)
    first, last = res.history[0], res.history[-1]
    assert last["loss"] < first["loss"]
    assert last["tv"] < first["tv"]
    assert (res.export_dir / "drafter.safetensors").exists()
    assert res.drafter.cfg.gamma_max == 3


def test_resume_continues_exactly(tmp_path: Path) -> None:
    full = _train(tmp_path / "full", steps=10)
    cut = _train(tmp_path / "part", steps=10, stop_after=5)
    assert cut.step == 5
    resumed = _train(tmp_path / "part", steps=10, resume=True)
    assert resumed.step == 10
    a, b = full.drafter.state_dict(), resumed.drafter.state_dict()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


def test_greedy_head_loss_adds_bce_to_the_argmax_match() -> None:
    logits = torch.log(torch.tensor([[[0.75, 0.25], [0.5, 0.5]]]))
    tlogits = torch.log(torch.tensor([[[0.25, 0.75], [0.5, 0.5]]]))
    nxt = torch.tensor([[1, 0]])
    valid = torch.tensor([[True, True]])
    z1 = torch.tensor([[0.0, 2.0]])
    zg = torch.tensor([[1.0, -1.0]])
    one = drafter_loss(logits, z1, tlogits, nxt, valid, 1.0)
    two = drafter_loss(logits, torch.stack([z1, zg], -1), tlogits, nxt, valid, 1.0)
    match = [0.0, 1.0]  # argmax q = 0 vs p = 1; tie -> 0 == 0

    def bce(x: float, y: float) -> float:
        s = 1 / (1 + math.exp(-x))
        return -(y * math.log(s) + (1 - y) * math.log(1 - s))

    w = [1.0, math.exp(-1.0)]
    extra = sum(w[k] * bce([1.0, -1.0][k], match[k]) for k in range(2)) / sum(w)
    assert math.isclose(float(two.loss - one.loss), extra, rel_tol=1e-5)
    assert math.isclose(two.bce_greedy, extra, rel_tol=1e-5)
    assert two.conf_greedy_mean == pytest.approx([1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))])


def test_init_from_saved_drafter_with_a_new_greedy_head_and_snapshots(tmp_path: Path) -> None:
    base = _train(tmp_path / "base", steps=5)
    seen: list[tuple[int, dict[str, torch.Tensor]]] = []

    def snap(step: int, drafter: Any) -> None:
        assert not drafter.training
        seen.append((step, {k: v.clone() for k, v in drafter.state_dict().items()}))

    res = train_drafter(
        _tiny_target(),
        out_dir=tmp_path / "v2",
        prompts=_prompts(12),
        gamma=3,
        steps=6,
        batch_size=6,
        lr=3e-3,
        warmup=2,
        max_new_tokens=20,
        blocks_per_seq=4,
        gen_batch_size=12,
        eos_ids=[1],
        init_from=base.export_dir,
        drafter_config={"greedy_confidence": True},
        on_snapshot=snap,
        snapshot_every=3,
        log=lambda s: None,
    )
    assert [s for s, _ in seen] == [0, 3, 6]
    start = seen[0][1]
    saved = Drafter.load(base.export_dir, _tiny_target()).state_dict()
    for k, v in saved.items():  # step 0 is the saved drafter (bf16 on disk)
        assert torch.allclose(start[k], v, atol=1e-6), k
    assert torch.equal(start["conf_head_greedy.weight"], start["conf_head.weight"])
    assert res.drafter.cfg.greedy_confidence and res.drafter.cfg.num_layers == 1
    assert res.history[-1]["conf_greedy_mean"]  # the greedy head was trained and logged
    assert not torch.equal(seen[-1][1]["conf_head_greedy.weight"], start["conf_head.weight"])
    with pytest.raises(ValueError, match="cannot initialize"):
        train_drafter(
            _tiny_target(), out_dir=tmp_path / "bad", prompts=_prompts(4), steps=1, gamma=3,
            init_from=base.export_dir, drafter_config={"markov_rank": 4}, eos_ids=[1],
            max_new_tokens=8, log=lambda s: None,
        )  # fmt: skip


def test_kl_term_and_regime_heads_by_hand() -> None:
    logits = torch.log(torch.tensor([[[0.75, 0.25], [0.5, 0.5]]]))
    tlogits = torch.log(torch.tensor([[[0.25, 0.75], [0.5, 0.5]]]))
    nxt = torch.tensor([[1, 0]])
    valid = torch.tensor([[True, True]])
    w = [1.0, math.exp(-1.0)]
    base = drafter_loss(logits, torch.zeros(1, 2), tlogits, nxt, valid, 1.0)
    with_kl = drafter_loss(logits, torch.zeros(1, 2), tlogits, nxt, valid, 1.0, w_kl=0.5)
    kl = [0.25 * math.log(0.25 / 0.75) + 0.75 * math.log(0.75 / 0.25), 0.0]  # KL(p || q)
    want = 0.5 * (w[0] * kl[0] + w[1] * kl[1]) / sum(w)
    assert math.isclose(float(with_kl.loss - base.loss), want, rel_tol=1e-5)
    # two heads, one row per regime: each head's BCE counts on its own regime's row only
    two_rows = (logits.repeat(2, 1, 1), tlogits.repeat(2, 1, 1), nxt.repeat(2, 1))
    z = torch.stack([torch.tensor([[0.0, 2.0]] * 2), torch.tensor([[1.0, -1.0]] * 2)], -1)
    regime = torch.tensor([True, False])  # row 0 greedy text, row 1 sampled text
    both = drafter_loss(two_rows[0], z, two_rows[1], two_rows[2], valid.repeat(2, 1), 1.0)
    split = drafter_loss(
        two_rows[0], z, two_rows[1], two_rows[2], valid.repeat(2, 1), 1.0, regime=regime
    )

    def bce(x: float, y: float) -> float:
        s = 1 / (1 + math.exp(-x))
        return -(y * math.log(s) + (1 - y) * math.log(1 - s))

    sample_bce = [bce(0.0, 0.5), bce(2.0, 1.0)]  # targets 1 - TV
    greedy_bce = [bce(1.0, 0.0), bce(-1.0, 1.0)]  # targets argmax match
    dropped = sum(w[k] * (sample_bce[k] + greedy_bce[k]) for k in range(2)) / (2 * sum(w))
    assert math.isclose(float(both.loss - split.loss), dropped, rel_tol=1e-5)


def test_loss_weights_parse_and_name_a_bad_term() -> None:
    from dspark_obs.engine.train import parse_loss_weights

    assert parse_loss_weights("ce=0.1, tv=0.5,kl=0.4") == {"ce": 0.1, "tv": 0.5, "kl": 0.4}
    assert parse_loss_weights(None) == {}
    with pytest.raises(ValueError, match="'mse=1'"):
        parse_loss_weights("mse=1")
    with pytest.raises(ValueError, match="'x' is not a number"):
        parse_loss_weights("kl=x")


def test_deeper_drafter_starts_exactly_where_the_saved_one_is(tmp_path: Path) -> None:
    base = _train(tmp_path / "base", steps=3)
    deep = train_drafter(
        _tiny_target(), out_dir=tmp_path / "deep", prompts=_prompts(6), gamma=3, steps=1,
        stop_after=0, init_from=base.export_dir, drafter_config={"num_layers": 2},
        eos_ids=[1], max_new_tokens=12, gen_batch_size=6, log=lambda s: None,
    )  # fmt: skip
    shallow = Drafter.load(base.export_dir, _tiny_target())
    assert deep.drafter.cfg.num_layers == 2 and shallow.cfg.num_layers == 1
    torch.manual_seed(0)
    hidden = torch.randn(1, 9, len(shallow.hidden_layers) * shallow.cfg.hidden_size)
    tokens = torch.randint(0, shallow.cfg.vocab_size, (1, 9))
    anchors = torch.tensor([[2, 5]])
    _, lg_a, z_a = shallow.forward_train(hidden, tokens, anchors, 3)
    _, lg_b, z_b = deep.drafter.forward_train(hidden, tokens, anchors, 3)
    assert torch.allclose(lg_a, lg_b, atol=1e-5) and torch.allclose(z_a, z_b, atol=1e-5)


def test_one_mode_per_prompt_and_target_written_variants() -> None:
    from dspark_obs.engine.train_data import build_train_data, variant_prompts

    class Echo:  # a runner that answers each prompt with its last three ids (+ EOS for odd)
        device = torch.device("cpu")

        def generate(self, prompts: Any, n: int, t: float, g: Any, eos: Any) -> list[list[int]]:
            return [list(p[-3:]) + ([1] if len(p) % 2 else []) for p in prompts]

    prompts = [("math", [5, 6, 7, 8]), ("chat", [9, 10, 11]), ("math", [12, 13, 14, 15, 16])]
    data = build_train_data(Echo(), prompts, 8, ("greedy", "sample"), [1], 0, 2,
                            log=lambda s: None, one_mode_per_prompt=True)  # fmt: skip
    assert sorted(zip(data.modes, map(tuple, data.seqs), strict=True)) == [
        ("greedy", (5, 6, 7, 8, 6, 7, 8)),
        ("greedy", (12, 13, 14, 15, 16, 14, 15, 16, 1)),
        ("sample", (9, 10, 11, 9, 10, 11, 1)),
    ]
    wraps = {"math": ([100], [101, 102]), "chat": ([], [103])}
    got = variant_prompts(Echo(), prompts, wraps, 8, 0.7, [1], 0, 2, min_tokens=2,
                          log=lambda s: None)  # fmt: skip
    # prompt 0 (even length) was cut at the limit: no EOS, dropped; EOS is stripped
    assert sorted(got) == [("chat", [9, 10, 11, 103]), ("math", [100, 14, 15, 16, 101, 102])]
