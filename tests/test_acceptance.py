"""Greedy and sampling acceptance: hand cases, losslessness (chi-square), cap == compact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from dspark_obs.engine.acceptance import (
    accept,
    draw_uniforms,
    greedy_accept,
    process_logits,
    sample_accept,
)

# --------------------------------------------------------------------------- greedy


def _onehot_rows(ids: list[int], vocab: int = 8) -> np.ndarray:
    return np.eye(vocab)[ids] * 3.0 - 1.0  # logits whose argmax is each id


def test_greedy_all_accepted() -> None:
    r = greedy_accept(_onehot_rows([4, 5, 6, 7]), [4, 5, 6])
    assert (r.correct_drafts, r.tokens, r.bonus_token) == (3, [4, 5, 6, 7], 7)
    assert (r.correct_full, r.cap_trim, r.acc_len, r.verify_len) == (3, 0, 4, 4)


def test_greedy_first_mismatch_gives_target_token() -> None:
    r = greedy_accept(_onehot_rows([4, 5, 6, 7]), [4, 1, 6])  # draft 3 matches but is after a miss
    assert (r.correct_drafts, r.tokens, r.bonus_token, r.correct_full) == (1, [4, 5], 5, 1)
    r = greedy_accept(_onehot_rows([2, 5]), [3])
    assert (r.correct_drafts, r.tokens) == (0, [2])


def test_greedy_anchor_only_window() -> None:
    r = greedy_accept(_onehot_rows([6]), [])
    assert (r.correct_drafts, r.tokens) == (0, [6])


def test_greedy_ties_take_first_argmax() -> None:
    scores = np.array([[0.0, 2.0, 2.0], [1.0, 1.0, 1.0]])
    r = greedy_accept(scores, [2])
    assert (r.correct_drafts, r.tokens) == (0, [1])
    r = greedy_accept(scores, [1])
    assert r.tokens == [1, 0]


def test_greedy_cap_to_window_equals_compact() -> None:
    rows = _onehot_rows([4, 5, 6, 7, 1, 2])
    drafts = [4, 5, 6, 7, 3]  # correct_full = 4
    for w in range(1, 7):
        capped = greedy_accept(rows, drafts, window=w)
        compact = greedy_accept(rows[:w], drafts)  # a longer draft list is allowed
        assert capped.tokens == compact.tokens, w
        assert capped.correct_drafts == compact.correct_drafts == min(4, w - 1)
        assert capped.correct_full == 4
        assert capped.cap_trim == 4 - min(4, w - 1)


def test_greedy_accepts_torch_and_validates() -> None:
    r = accept(torch.tensor(_onehot_rows([1, 2])), torch.tensor([1]), greedy=True)
    assert r.tokens == [1, 2]
    with pytest.raises(ValueError, match="draft tokens"):
        greedy_accept(_onehot_rows([1, 2, 3]), [1])
    with pytest.raises(ValueError, match="out of range"):
        greedy_accept(_onehot_rows([1, 2]), [9])
    with pytest.raises(ValueError, match="window"):
        greedy_accept(_onehot_rows([1, 2]), [1], window=3)


# --------------------------------------------------------------------------- sampling, by hand


def test_sampling_hand_cases() -> None:
    p = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = np.array([[1.0, 0.0, 0.0]])
    # draft 0: accept iff u * 1.0 < 0.5
    r = sample_accept(p, [0], q, uniforms=[0.49, 0.0])
    assert (r.correct_drafts, r.tokens) == (1, [0, 0])  # bonus from p row 1 with v = 0
    r = sample_accept(p, [0], q, uniforms=[0.49, 0.999])
    assert r.tokens == [0, 2]
    r = sample_accept(p, [0], q, uniforms=[0.5, 0.0])  # strict: u*q == p rejects
    assert (r.correct_drafts, r.tokens) == (0, [1])  # residual max(0, p - q) = [0, .5, 0]
    r = sample_accept(p, [0], q, uniforms=[0.9, 0.999])
    assert r.tokens == [1]


def test_sampling_zero_q_or_zero_p_rejects() -> None:
    p = np.array([[0.0, 1.0], [0.5, 0.5]])
    q = np.array([[0.5, 0.5]])
    r = sample_accept(p, [0], q, uniforms=[0.0, 0.3])  # p(x) = 0
    assert (r.correct_drafts, r.tokens) == (0, [1])
    q0 = np.array([[1.0, 0.0]])
    r = sample_accept(p, [1], q0, uniforms=[0.0, 0.3])  # q(x) = 0: not a proposal, reject
    assert (r.correct_drafts, r.tokens) == (0, [1])


def test_sampling_equal_distributions_always_accept() -> None:
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(5), size=4)
    for _ in range(200):
        drafts = [int(rng.choice(5, p=p[j])) for j in range(3)]
        r = sample_accept(p, drafts, p[:3], uniforms=rng.random(4))
        assert r.correct_drafts == 3


def test_inverse_cdf_skips_zero_mass() -> None:
    p = np.array([[0.0, 0.25, 0.0, 0.75, 0.0]])
    assert sample_accept(p, [], np.zeros((0, 5)), uniforms=[0.0]).tokens == [1]
    assert sample_accept(p, [], np.zeros((0, 5)), uniforms=[0.2499]).tokens == [1]
    assert sample_accept(p, [], np.zeros((0, 5)), uniforms=[0.25]).tokens == [3]
    assert sample_accept(p, [], np.zeros((0, 5)), uniforms=[1 - 1e-16]).tokens == [3]


def test_sampling_needs_randomness_and_shapes() -> None:
    p = np.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="uniforms"):
        sample_accept(p, [0], p[:1], uniforms=[0.1])
    with pytest.raises(ValueError, match="draft probs"):
        sample_accept(p, [0], np.ones((1, 4)), uniforms=[0.1, 0.2])
    with pytest.raises(ValueError, match="block_size"):
        sample_accept(p, [0], p[:1], generator=torch.Generator().manual_seed(0), block_size=0)
    with pytest.raises(ValueError, match="draft_probs"):
        accept(p, [0])


# --------------------------------------------------------------------------- losslessness


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit, pooling cells with expected count < 5 into one cell."""
    counts, probs = counts.ravel().astype(float), probs.ravel()
    n = counts.sum()
    expected = probs * n
    assert counts[expected == 0].sum() == 0, "a token with zero target probability appeared"
    small = expected < 5
    obs = np.append(counts[~small], counts[small & (expected > 0)].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep]).pvalue)


def _case(seed: int, vocab: int = 6) -> dict[str, np.ndarray]:
    """A two-step target/draft pair; q has zeros where p > 0, p has zeros where q > 0."""
    rng = np.random.default_rng(seed)
    p1 = rng.dirichlet(np.full(vocab, 2.0))
    p2 = rng.dirichlet(np.full(vocab, 2.0), size=vocab)  # p2[x1] = p(. | x1)
    p3 = rng.dirichlet(np.full(vocab, 2.0), size=vocab)
    q1 = rng.dirichlet(np.full(vocab, 1.0))
    q1[:2] = 0.0  # the drafter never proposes tokens 0, 1
    q1 /= q1.sum()
    q2 = rng.dirichlet(np.full(vocab, 1.0), size=vocab)
    q2[:, -1] = 0.0
    q2 /= q2.sum(axis=1, keepdims=True)
    p2[:, 0] = 0.0  # and the target never emits token 0 second
    p2 /= p2.sum(axis=1, keepdims=True)
    return {"p1": p1, "p2": p2, "p3": p3, "q1": q1, "q2": q2}


def _simulate(c: dict[str, np.ndarray], n: int, seed: int, window: int | None, rows: int):
    """Draft 2 tokens from q, verify ``rows`` rows (3 = full block, 2 = compact w=2)."""
    rng = np.random.default_rng(seed)
    vocab = c["p1"].size

    def draw(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:  # row-wise inverse CDF
        return np.minimum((u[:, None] >= cdf).sum(axis=1), vocab - 1)

    d1 = draw(np.broadcast_to(np.cumsum(c["q1"]), (n, vocab)), rng.random(n))
    d2 = draw(np.cumsum(c["q2"], axis=1)[d1], rng.random(n))
    targets = np.stack([np.broadcast_to(c["p1"], (n, vocab)), c["p2"][d1], c["p3"][d2]], axis=1)
    drafts = np.stack([np.broadcast_to(c["q1"], (n, vocab)), c["q2"][d1]], axis=1)
    us = rng.random((n, 3))
    x1 = np.empty(n, dtype=np.int64)
    x2 = np.full(n, -1, dtype=np.int64)
    for i in range(n):
        res = sample_accept(
            targets[i, :rows], [d1[i], d2[i]], drafts[i], uniforms=us[i], window=window
        )
        x1[i] = res.tokens[0]
        if len(res.tokens) > 1:
            x2[i] = res.tokens[1]
    # where only one token was committed, the next step draws token 2 from p(. | x1);
    # any lossless step does, so draw it directly
    need = x2 < 0
    x2[need] = draw(np.cumsum(c["p2"], axis=1)[x1[need]], rng.random(int(need.sum())))
    first = np.bincount(x1, minlength=vocab)
    joint = np.bincount(x1 * vocab + x2, minlength=vocab * vocab).reshape(vocab, vocab)
    return first, joint


@pytest.mark.parametrize(
    ("seed", "window", "rows"),
    [(1, None, 3), (2, None, 3), (3, 2, 3), (4, None, 2)],
    ids=["full-a", "full-b", "cap-w2", "compact-w2"],
)
def test_sampling_is_lossless_first_and_joint(seed: int, window: int | None, rows: int) -> None:
    c = _case(seed)
    first, joint = _simulate(c, n=20_000, seed=100 + seed, window=window, rows=rows)
    assert _chi2_pvalue(first, c["p1"]) > 1e-3
    assert _chi2_pvalue(joint, c["p1"][:, None] * c["p2"]) > 1e-3


def test_chi2_has_power_against_the_draft_distribution() -> None:
    # The same harness must reject a sampler that just emits drafts (q instead of p).
    c = _case(1)
    rng = np.random.default_rng(0)
    counts = np.bincount(rng.choice(6, size=20_000, p=c["q1"]), minlength=6)
    assert _chi2_pvalue(counts, c["p1"]) < 1e-6


def test_sampling_rows_are_used_for_the_right_positions() -> None:
    # p1 puts all mass on token 2; with q1 = p1 the draft is always accepted, and the bonus
    # must come from row 1 (one-hot on 4), never from row 0.
    p = np.zeros((2, 5))
    p[0, 2] = 1.0
    p[1, 4] = 1.0
    for v in (0.0, 0.5, 0.99):
        assert sample_accept(p, [2], p[:1], uniforms=[0.3, v]).tokens == [2, 4]


# --------------------------------------------------------------------------- cap == compact


def _random_block(rng: np.random.Generator, gamma: int, vocab: int):
    p = rng.dirichlet(np.full(vocab, 0.5), size=gamma + 1)
    q = 0.5 * p[:gamma] + 0.5 * rng.dirichlet(np.full(vocab, 0.5), size=gamma)
    drafts = np.array([rng.choice(vocab, p=q[j]) for j in range(gamma)])
    return p, drafts, q


def test_cap_to_window_commits_what_compact_commits() -> None:
    rng = np.random.default_rng(42)
    gamma, vocab = 5, 7
    n_trimmed = 0
    for trial in range(600):
        p, drafts, q = _random_block(rng, gamma, vocab)
        w = int(rng.integers(1, gamma + 2))
        seed = int(rng.integers(1 << 30))
        g_full = torch.Generator().manual_seed(seed)
        g_win = torch.Generator().manual_seed(seed)
        full = accept(p, drafts, q, g_full, window=w, block_size=gamma)
        compact = accept(p[:w], drafts, q, g_win, block_size=gamma)
        assert full.tokens == compact.tokens, trial
        assert full.correct_drafts == compact.correct_drafts == min(full.correct_full, w - 1)
        assert full.cap_trim == full.correct_full - full.correct_drafts
        assert compact.cap_trim == 0
        # both modes consumed the same stream: the next step starts from the same state
        assert torch.equal(g_full.get_state(), g_win.get_state())
        uncapped = accept(p, drafts, q, torch.Generator().manual_seed(seed), block_size=gamma)
        assert uncapped.correct_full == full.correct_full
        n_trimmed += full.cap_trim > 0
    assert n_trimmed > 50  # the cap really bit in many trials


def test_draw_uniforms_is_a_fixed_size_stream() -> None:
    g1 = torch.Generator().manual_seed(3)
    g2 = torch.Generator().manual_seed(3)
    a = draw_uniforms(g1, 5)
    assert a.shape == (6,) and np.all((a >= 0) & (a < 1))
    assert np.array_equal(a, torch.rand(6, generator=g2, dtype=torch.float64).numpy())


# --------------------------------------------------------------------------- logits processing


def test_process_logits_temperature_and_greedy() -> None:
    logits = np.array([1.0, 3.0, 3.0, -2.0])
    assert process_logits(logits, 0.0).tolist() == [0.0, 1.0, 0.0, 0.0]  # first argmax
    probs = process_logits(logits, 0.5)
    want = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
    assert probs == pytest.approx(want, rel=1e-6)
    assert isinstance(process_logits(torch.tensor(logits), 1.0), torch.Tensor)


def test_process_logits_top_k_and_top_p() -> None:
    logits = np.log(np.array([0.1, 0.5, 0.2, 0.2]))
    assert process_logits(logits, 1.0, top_k=1).tolist() == [0.0, 1.0, 0.0, 0.0]
    # top-2 with a tie for second place keeps the lower token id
    assert process_logits(logits, 1.0, top_k=2) == pytest.approx([0.0, 5 / 7, 2 / 7, 0.0])
    # top-p keeps a token unless the mass ranked before it exceeds top_p
    assert process_logits(logits, 1.0, top_p=0.5) == pytest.approx([0.0, 5 / 7, 2 / 7, 0.0])
    assert process_logits(logits, 1.0, top_p=0.45) == pytest.approx([0.0, 1.0, 0.0, 0.0])
    # top-k first, then top-p within the renormalized top-k
    assert process_logits(logits, 1.0, top_k=3, top_p=0.7) == pytest.approx(
        [0.0, 5 / 7, 2 / 7, 0.0], rel=1e-6
    )
    batch = process_logits(np.stack([logits, logits[::-1]]), 1.0, top_k=1)
    assert batch.tolist() == [[0, 1, 0, 0], [0, 0, 1, 0]]


def test_process_logits_rejects_bad_parameters() -> None:
    x = np.zeros(3)
    for kwargs in ({"temperature": -1.0}, {"temperature": float("nan")}):
        with pytest.raises(ValueError, match="temperature"):
            process_logits(x, **kwargs)
    with pytest.raises(ValueError, match="top_p"):
        process_logits(x, 1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        process_logits(x, 1.0, top_k=0)


def test_process_logits_then_accept_is_greedy_at_temperature_zero() -> None:
    rng = np.random.default_rng(8)
    for _ in range(50):
        logits = rng.normal(size=(4, 9))
        drafts = [int(np.argmax(logits[0])), int(rng.integers(9)), int(rng.integers(9))]
        p = process_logits(logits, 0.0)
        q = process_logits(rng.normal(size=(3, 9)), 1.0)
        q[np.arange(3), drafts] += 0.1  # drafts have positive draft probability
        q /= q.sum(axis=1, keepdims=True)
        s = sample_accept(p, drafts, q, uniforms=rng.random(4))
        g = greedy_accept(logits, drafts)
        assert s.tokens == g.tokens


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [(1.0, 1.0, -1), (0.7, 0.9, -1), (1.3, 1.0, 2), (1.0, 0.5, 3)],
)
def test_process_logprobs_is_the_log_of_the_processed_distribution(
    temperature: float, top_p: float, top_k: int
) -> None:
    from dspark_obs.engine.acceptance import is_truncated, process_logprobs

    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    p = process_logits(logits, temperature, top_p, top_k)
    lp = process_logprobs(logits, temperature, top_p, top_k)
    assert torch.equal(torch.isneginf(lp), p == 0)
    assert torch.allclose(lp.exp(), p, atol=1e-12)
    if not is_truncated(top_p, top_k):  # bitwise what SGLang's recorder gathers
        assert torch.equal(lp, torch.log_softmax(logits / temperature, dim=-1))
    else:
        assert (p == 0).any()
