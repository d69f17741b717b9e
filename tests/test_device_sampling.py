"""Device sampling twins: bit-for-bit equal to the host rules of acceptance.py on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_obs.engine.acceptance import _inverse_cdf, process_logits, sample_accept
from dspark_obs.engine.device_sampling import (
    coin_flags,
    final_draw,
    leading_true,
    process_rows,
    sample_rows,
)

ONE_BELOW = float(np.nextafter(1.0, 0.0))  # largest float64 < 1: what torch.rand can reach

# (temperature, top_p, top_k) per row kind; -1 / 1.0 disable, "V" marks top_k >= vocab.
ROW_KINDS = [
    (0.0, 1.0, -1),  # greedy
    (0.0, 0.5, 7),  # greedy ignores its filters
    (1e-7, 1.0, -1),  # below SAMPLING_EPS: greedy
    (1.0, 1.0, -1),  # plain sampling
    (0.7, 1.0, -1),
    (1.3, 1.0, 5),  # top-k only
    (0.9, 1.0, 1),  # top-k 1
    (0.8, 0.9, -1),  # top-p only
    (1.1, 0.3, -1),
    (0.6, 0.8, 20),  # both
    (1.0, 0.95, "V"),  # top_k >= vocab: top-p only
    (1.2, 1.0, "V+"),  # top_k > vocab, top_p = 1: plain softmax
    (0.75, 1.0, 12),  # top_p = 1 with top_k: not renormalized by top-p
]


def _params(kinds: list[tuple], vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ks = {"V": vocab, "V+": vocab + 9}
    t = torch.tensor([k[0] for k in kinds], dtype=torch.float32)
    p = torch.tensor([k[1] for k in kinds], dtype=torch.float32)
    k = torch.tensor([ks.get(k[2], k[2]) for k in kinds], dtype=torch.int64)
    return t, p, k


def _host_rows(logits: torch.Tensor, t: torch.Tensor, p: torch.Tensor, k: torch.Tensor):
    return [
        process_logits(logits[n].double(), float(t[n]), float(p[n]), int(k[n]))
        for n in range(logits.shape[0])
    ]


def _logits(gen: torch.Generator, n: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(n, vocab, generator=gen) * 3.0
    x[::3] = torch.round(x[::3])  # integer logits: ties for argmax, top-k and top-p sorts
    return x.to(dtype)


@pytest.mark.parametrize(
    ("vocab", "dtype"), [(50, torch.float64), (131, torch.float32), (300, torch.bfloat16)]
)
def test_process_rows_equals_process_logits_bitwise(vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    kinds = ROW_KINDS * 3
    t, p, k = _params(kinds, vocab)
    logits = _logits(gen, len(kinds), vocab, dtype)
    out = process_rows(logits, t, p, k)
    assert out.dtype == torch.float64 and out.shape == logits.shape
    assert torch.isfinite(out).all()
    for n, ref in enumerate(_host_rows(logits, t, p, k)):
        assert torch.equal(out[n], ref), (n, kinds[n])
    # The filters really did something on the rows meant to be filtered.
    support = (out > 0).sum(-1)
    assert (support[t < 1e-6] == 1).all()
    assert support[kinds.index((1.3, 1.0, 5))] == 5
    assert support[kinds.index((0.8, 0.9, -1))] < vocab


def test_process_rows_temperature_edges_and_float64_compare() -> None:
    vocab = 64
    gen = torch.Generator().manual_seed(1)
    logits = _logits(gen, 6, vocab, torch.float32)
    logits[0, 3] = float("inf")  # greedy row with an infinite logit: still a clean one-hot
    logits[1:4, 9] = logits[1:4, 7] = logits[1:4].max() + 1.0  # tied maxima: greedy != T=1e-6
    # 1e-6 is not a float32: compare in float64 as the host does (float(t) of the tensor).
    t = torch.tensor([0.0, 1e-6, 0.999999e-6, 1.000001e-6, 50.0, 1e-3], dtype=torch.float32)
    p = torch.tensor([1.0, 0.9, 1.0, 0.7, 0.99, 1.0], dtype=torch.float32)
    k = torch.tensor([-1, 3, -1, -1, 2, -1])
    out = process_rows(logits, t, p, k)
    assert not torch.isnan(out).any()
    assert out[0, 3] == 1.0
    assert out[1, 7] == 1.0 and out[2, 7] == 1.0  # greedy: the first of the tied maxima
    assert out[3, 7] == out[3, 9] == 0.5  # just above SAMPLING_EPS: a sampled row
    for n, ref in enumerate(_host_rows(logits, t, p, k)):
        assert torch.equal(out[n], ref), n


def test_skipping_a_filter_no_row_uses_changes_nothing() -> None:
    vocab = 211
    gen = torch.Generator().manual_seed(2)
    logits = _logits(gen, 10, vocab, torch.float32)
    t = torch.tensor([0.0, 1.0, 0.5, 1.7, 1e-8, 0.9, 1.0, 2.5, 0.3, 1.0])
    p = torch.ones(10)
    k = torch.full((10,), -1)
    fast = process_rows(logits, t, p, k, use_top_k=False, use_top_p=False)
    assert torch.equal(fast, process_rows(logits, t, p, k))
    for n, ref in enumerate(_host_rows(logits, t, p, k)):
        assert torch.equal(fast[n], ref)
    top_p = torch.tensor([1.0, 0.8, 1.0, 0.5, 1.0, 0.95, 1.0, 0.3, 1.0, 0.7])
    assert torch.equal(process_rows(logits, t, top_p, k, use_top_k=False),
                       process_rows(logits, t, top_p, k))  # fmt: skip
    top_k = torch.tensor([-1, 3, -1, 50, 1, -1, 7, vocab, -1, 2])
    assert torch.equal(process_rows(logits, t, p, top_k, use_top_p=False),
                       process_rows(logits, t, p, top_k))  # fmt: skip


def test_coin_flags_and_leading_true() -> None:
    p = torch.tensor([[0.5, 0.2, 0.3, 0.0, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.4, 0.0, 0.1, 1.5]], dtype=torch.float64)
    u = torch.tensor([[ONE_BELOW, 0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    # u*q < p; 0.5*0.4 == 0.2 is not < 0.2; q == 0 and q > 1 reject whatever u is.
    assert coin_flags(p, q, u).tolist() == [[True, False, False, False, False]]
    ok = torch.tensor(
        [[True, True, False, True], [False, True, True, True], [True, True, True, True]]
    )
    assert leading_true(ok).tolist() == [2, 0, 4]
    assert leading_true(torch.zeros(3, 0, dtype=torch.bool)).tolist() == [0, 0, 0]


def test_final_draw_matches_inverse_cdf_including_fallbacks() -> None:
    vocab = 40
    gen = torch.Generator().manual_seed(3)
    rows = []
    for i in range(120):
        p = torch.rand(vocab, generator=gen, dtype=torch.float64)
        p[torch.randperm(vocab, generator=gen)[: i % 30]] = 0.0  # zeros, trailing ones too
        if i % 4:
            p[-(i % 4) :] = 0.0
        p = p / p.sum()
        kind = i % 6
        if kind == 0:  # p == q: zero residual, falls back to p
            q = p.clone()
        elif kind == 1:  # q with extra mass everywhere p has any: zero residual too
            q = p * 2.0
        elif kind == 2:  # garbage q (NaN, negative, > 1): counts as 0 -> residual is p
            q = torch.full_like(p, float("nan"))
            q[::3], q[1::3] = -0.5, 1.5
        elif kind == 3:  # subnormal residual mass: v * total rounds back to total
            q = p.clone()
            q[5], p[5] = 0.0, 1e-310
        else:
            q = torch.rand(vocab, generator=gen, dtype=torch.float64)
            q = q / q.sum()
        v = [0.0, 0.37, ONE_BELOW, 1.0, 1 - 1e-17, float(torch.rand(1, generator=gen))]
        v = v[(i // 6) % 6]
        rows.append((p, q, bool(i % 5), v))
    p_row = torch.stack([r[0] for r in rows])
    q_row = torch.stack([r[1] for r in rows]).to(torch.float32)  # float q is widened, as _np64
    residual = torch.tensor([r[2] for r in rows])
    v = torch.tensor([r[3] for r in rows], dtype=torch.float64)
    got = final_draw(p_row, q_row, residual, v)
    assert got.dtype == torch.int64
    fallback = 0
    for b, (p, _, res, vb) in enumerate(rows):
        pn = p.numpy()
        qn = q_row[b].double().numpy()
        w = pn
        if res:
            qc = np.where((qn >= 0) & (qn <= 1), qn, 0.0)
            w = np.maximum(pn - qc, 0.0)
            if not w.sum() > 0:
                w = pn
        cs = np.cumsum(w)
        fallback += int(np.searchsorted(cs, vb * cs[-1], side="right") >= vocab)
        assert int(got[b]) == _inverse_cdf(w, vb), b
        assert w[int(got[b])] > 0
    assert fallback >= 20  # v == 1 and the subnormal rows did reach the fallback branch


def _case(gen: torch.Generator, bsz: int, gamma: int, vocab: int, draft_dtype: torch.dtype):
    """A random batch: target rows from every sampler kind, drafts of several shapes, garbage
    past ``verified``, windows below ``verified`` and coins at the edges of [0, 1]."""
    rows = gamma + 1
    kinds = [ROW_KINDS[i % len(ROW_KINDS)] for i in range(bsz * rows)]
    t, tp, tk = _params(kinds, vocab)
    logits = _logits(gen, bsz * rows, vocab, torch.float32)
    probs = process_rows(logits, t, tp, tk).view(bsz, rows, vocab)
    verified = torch.randint(1, rows + 1, (bsz,), generator=gen)
    verified[: bsz // 4] = rows  # plenty of full blocks
    window = torch.stack([torch.randint(1, int(w) + 1, (1,), generator=gen)[0] for w in verified])
    window[bsz // 4 : bsz // 2] = verified[bsz // 4 : bsz // 2]  # compact: window == verified

    near = torch.softmax(logits.view(bsz, rows, vocab)[:, :gamma] / 1.1, dim=-1)
    draft = torch.empty(bsz, gamma, vocab, dtype=torch.float64)
    tokens = torch.empty(bsz, gamma, dtype=torch.int64)
    for b in range(bsz):
        kind = b % 5
        for j in range(gamma):
            pj = probs[b, j]
            if kind == 0:  # close to the target: long accepted runs
                q = 0.8 * pj + 0.2 * near[b, j].double()
            elif kind == 1:  # one-hot draft
                q = torch.zeros(vocab, dtype=torch.float64)
                q[torch.multinomial(pj + 1e-3, 1, generator=gen)] = 1.0
            elif kind == 2:  # q == p: always accepted when drafted from p
                q = pj.clone()
            elif kind == 3:  # q >= p everywhere: rejections leave a zero residual
                q = (pj * 1.5).clamp_max(1.0)
            else:
                q = near[b, j].double()
            draft[b, j] = q
            tokens[b, j] = torch.multinomial(q.clamp_min(0) + 1e-12, 1, generator=gen)[0]
        if kind == 2 and gamma:  # a draft q never proposed: rejected, p - q == 0
            zero = (draft[b, 0] == 0).nonzero()
            if len(zero):
                tokens[b, 0] = zero[0, 0]
    coins = torch.rand(bsz, rows, generator=gen, dtype=torch.float64)
    edge = torch.tensor([0.0, ONE_BELOW, 1.0, 1 - 1e-17], dtype=torch.float64)
    pick = torch.rand(bsz, rows, generator=gen) < 0.15
    coins = torch.where(pick, edge[torch.randint(0, 4, (bsz, rows), generator=gen)], coins)
    coins[::7, -1] = 1.0  # final coin at the top: the inverse-CDF fallback

    # Garbage where nothing may look: unverified target rows, unverified draft rows.
    for b in range(bsz):
        n = int(verified[b])
        probs[b, n:] = float("nan")
        draft[b, n - 1 :] = [float("nan"), 3.0, -1.0][b % 3]
    return probs, tokens, draft.to(draft_dtype), coins, verified, window


def _host_ok(probs, tokens, draft, coins, n: int) -> np.ndarray:
    """The coin test exactly as sample_accept writes it, for the first ``n`` drafts."""
    p = probs[:n].numpy()
    q = draft[:n].double().numpy()
    d = tokens[:n].numpy()
    u = coins[:n].numpy()
    ar = np.arange(n)
    return (q[ar, d] > 0) & (q[ar, d] <= 1) & (u * q[ar, d] < p[ar, d])


def _check_against_host(probs, tokens, draft, coins, verified, window) -> dict[str, int]:
    ok, correct_full, token = sample_rows(probs, tokens, draft, coins, verified, window)
    bsz, gamma = tokens.shape
    assert ok.shape == (bsz, gamma) and ok.dtype == torch.bool
    assert correct_full.dtype == torch.int64 and token.dtype == torch.int64
    seen = {"cap": 0, "residual": 0, "from_p": 0, "zero_residual": 0, "v_one": 0}
    for b in range(bsz):
        n, w = int(verified[b]), int(window[b])
        ref = sample_accept(probs[b, :n], tokens[b], draft[b], uniforms=coins[b], window=w)
        expect_ok = np.zeros(gamma, dtype=bool)
        expect_ok[: n - 1] = _host_ok(probs[b], tokens[b], draft[b], coins[b], n - 1)
        assert ok[b].tolist() == expect_ok.tolist(), b
        assert int(correct_full[b]) == ref.correct_full, b
        assert int(token[b]) == ref.bonus_token, b
        c = min(int(correct_full[b]), w - 1)
        assert ref.correct_drafts == c
        assert ref.tokens == [*tokens[b, :c].tolist(), int(token[b])]
        seen["cap"] += ref.cap_trim > 0
        if c < w - 1:
            seen["residual"] += 1
            p, q = probs[b, c].numpy(), draft[b, c].double().numpy()
            qc = np.where((q >= 0) & (q <= 1), q, 0.0)
            seen["zero_residual"] += not np.maximum(p - qc, 0.0).sum() > 0
        else:
            seen["from_p"] += 1
        seen["v_one"] += float(coins[b, -1]) == 1.0
    return seen


@pytest.mark.parametrize(
    ("gamma", "vocab", "draft_dtype"),
    [
        (0, 50, torch.float64),
        (1, 97, torch.float32),
        (3, 64, torch.float64),
        (5, 128, torch.float32),
        (7, 300, torch.float64),
    ],
)
def test_sample_rows_equals_sample_accept(gamma: int, vocab: int, draft_dtype) -> None:
    gen = torch.Generator().manual_seed(100 * gamma + vocab)
    seen = {}
    for _ in range(3):
        case = _case(gen, 48, gamma, vocab, draft_dtype)
        for key, val in _check_against_host(*case).items():
            seen[key] = seen.get(key, 0) + val
    # The trials reached every branch: cap binding, residual, zero residual, draw from p.
    assert seen["from_p"] > 0 and seen["v_one"] > 0
    if gamma >= 3:
        assert seen["cap"] > 0 and seen["residual"] > 0 and seen["zero_residual"] > 0


def test_sample_rows_cap_accept_equals_compact() -> None:
    """The module docstring's invariant holds batched: capping a full block to window w
    commits what verifying only w rows commits, under the same coins."""
    gen = torch.Generator().manual_seed(7)
    probs, tokens, draft, coins, _, window = _case(gen, 64, 5, 80, torch.float64)
    full = torch.full_like(window, 6)
    for b in range(64):  # a real target row everywhere (the case put NaN past verified)
        probs[b] = torch.nan_to_num(probs[b], nan=1.0 / 80)
        draft[b] = torch.nan_to_num(draft[b], nan=1.0 / 80)
    _, cf_cap, tok_cap = sample_rows(probs, tokens, draft, coins, full, window)
    ok_c, cf_compact, tok_compact = sample_rows(probs, tokens, draft, coins, window, window)
    assert torch.equal(tok_cap, tok_compact)
    assert torch.equal(torch.minimum(cf_cap, window - 1), cf_compact)
    assert not ok_c[torch.arange(5)[None, :] >= (window - 1)[:, None]].any()


def test_sample_rows_hand_case() -> None:
    """One readable batch: accept-all, reject-first, cap, zero residual."""
    p = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [0.5, 0.25, 0.25]], dtype=torch.float64)
    probs = p.expand(4, 3, 3).clone()
    tokens = torch.tensor([[1, 2], [0, 2], [1, 2], [1, 1]])
    draft = torch.zeros(4, 2, 3, dtype=torch.float64)
    draft[:, 0, 1] = draft[:, 1, 2] = 1.0  # one-hot drafts of 1 then 2
    draft[3] = p[:2]  # q == p
    draft[3, 0, 1] = 0.9  # row 0: q >= p everywhere, q > p at the draft
    coins = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0.5, 0.5, 0.99], [0.99, 0.0, 0.0]])
    verified = torch.tensor([3, 3, 3, 3])
    window = torch.tensor([3, 3, 2, 3])
    ok, cf, tok = sample_rows(probs, tokens, draft, coins, verified, window)
    assert ok.tolist() == [[True, True], [False, True], [True, True], [False, True]]
    assert cf.tolist() == [2, 0, 2, 0]
    # r0: all accepted: p row 2 = [.5, .25, .25], v = 0.5 -> first cumsum > 0.5 -> 1;
    # r1: q(0) = 0 rejects: residual [.1, 0, .3] at row 0, 0.5 * 0.4 -> 2;
    # r2: cap to window 2: p row 1 = [.2, .2, .6] with v = 0.99 -> 2;
    # r3: 0.99 * 0.9 >= 0.6 rejects, max(0, p - q) == 0 -> p row 0 with v = 0 -> 0.
    assert tok.tolist() == [1, 2, 2, 0]
    _check_against_host(probs, tokens, draft, coins, verified, window)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu_and_captures_in_a_graph() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(11)
    vocab, gamma = 256, 5
    kinds = ROW_KINDS * 4
    t, tp, tk = _params(kinds, vocab)
    logits = _logits(gen, len(kinds), vocab, torch.float32)
    cpu = process_rows(logits, t, tp, tk)
    args = [x.to(dev) for x in (logits, t, tp, tk)]
    on_dev = process_rows(*args)
    torch.testing.assert_close(on_dev.cpu(), cpu, rtol=1e-12, atol=1e-15)
    assert torch.equal(on_dev.cpu() > 0, cpu > 0)

    case = _case(gen, 64, gamma, vocab, torch.float32)
    # A parallel cumsum rounds differently: a final coin of 1 - 2**-53 lands on the first
    # index that reaches the rounded total, which can differ from the CPU's sequential sum.
    v = case[3][:, -1]
    case[3][:, -1] = torch.where(v == ONE_BELOW, 0.5, v)
    expect = sample_rows(*case)
    dev_case = [x.to(dev) for x in case]
    got = sample_rows(*dev_case)
    for e, g in zip(expect, got, strict=True):
        assert torch.equal(e, g.cpu())

    # Both functions capture into one CUDA graph and replay to the eager results.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            process_rows(*args)
            sample_rows(*dev_case)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_probs = process_rows(*args)
        g_out = sample_rows(*dev_case)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_probs, on_dev)
    for e, g in zip(got, g_out, strict=True):
        assert torch.equal(e, g)
