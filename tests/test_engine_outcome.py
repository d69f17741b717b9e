"""A step's column-wise outcome (``engine/outcome.py``) against the per-request rule it
replaces: the first stop id finishes a request ("stop", the stop token committed), and no
request commits past ``max_new_tokens`` ("length", reaching it exactly finishes it too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_obs.engine.acceptance import BatchAccept, greedy_accept_argmax
from dspark_obs.engine.live import Live
from dspark_obs.engine.outcome import cut_at_stops
from dspark_obs.engine.types import GenRequest

GAMMA = 5
EOS = 2


def _live(output_len: int, max_new: int, *, stop_ids=(), ignore_eos=False) -> Live:
    req = GenRequest(
        "r", [1, 2, 3], max_new, ignore_eos=ignore_eos, stop_token_ids=tuple(stop_ids)
    )
    return Live(
        req, torch.Generator(), 0, [7] * output_len, 0.0, 0.0, 0,
        stops=frozenset({EOS, *stop_ids}),
    )  # fmt: skip


def _one_by_one(tokens: list[int], live: Live) -> tuple[int, str | None]:
    """The rule as the split step wrote it, one request at a time (the oracle)."""
    remaining = live.req.max_new_tokens - len(live.output)
    cut, reason = len(tokens), None
    for j, tok in enumerate(tokens):
        if live.stops_at(tok):
            cut, reason = j + 1, "stop"
            break
    if cut > remaining or (reason is None and cut == remaining):
        cut, reason = remaining, "length"
    return cut, reason


def _batch(rows: list[tuple[list[int], int]]) -> BatchAccept:
    """Rows of (drafts, correct) with bonus 9 after the accepted drafts."""
    drafts = np.array([d for d, _ in rows])
    correct = np.array([c for _, c in rows])
    return BatchAccept.of_drafts(drafts, correct, correct, np.full(len(rows), 9), correct + 1)


def test_a_stop_inside_the_accepted_tokens_cuts_there_and_one_past_them_does_not():
    accepted = _batch([([4, EOS, 5, 6, 7], 3), ([4, 5, 6, 7, EOS], 2), ([4, 5, 6, 7, 8], 5)])
    out = cut_at_stops(accepted, [_live(0, 50), _live(0, 50), _live(0, 50)])
    assert out.committed.tolist() == [2, 3, 6]
    assert out.reasons == ["stop", None, None]
    assert out.full(0) == [4, EOS, 5, 9]  # uncut: what the estimator resolves against
    assert out.finished.tolist() == [True, False, False]


def test_the_length_limit_cuts_and_reaching_it_exactly_finishes():
    accepted = _batch([([4, 5, 6, 7, 8], 5)] * 3)
    out = cut_at_stops(accepted, [_live(46, 50), _live(44, 50), _live(40, 50)])
    assert out.committed.tolist() == [4, 6, 6]
    assert out.reasons == ["length", "length", None]


def test_a_stop_on_the_last_allowed_token_is_a_stop_and_one_past_it_is_length():
    accepted = _batch([([4, 5, EOS, 6, 7], 4), ([4, 5, 6, EOS, 7], 4)])
    out = cut_at_stops(accepted, [_live(47, 50), _live(47, 50)])
    assert out.committed.tolist() == [3, 3]
    assert out.reasons == ["stop", "length"]


def test_each_request_stops_at_its_own_ids_and_ignore_eos_turns_all_of_them_off():
    accepted = _batch([([4, 11, 5, 6, 7], 4)] * 4 + [([4, EOS, 11, 6, 7], 4)])
    lives = [
        _live(0, 50, stop_ids=[11]),
        _live(0, 50),  # 11 is another request's stop id, not this one's
        _live(0, 50, stop_ids=[11], ignore_eos=True),
        _live(0, 50, stop_ids=[5]),
        _live(0, 50, stop_ids=[11], ignore_eos=True),
    ]
    out = cut_at_stops(accepted, lives)
    assert out.committed.tolist() == [2, 5, 5, 3, 5]
    assert out.reasons == ["stop", None, None, "stop", None]


@pytest.mark.parametrize("seed", range(5))
def test_random_batches_cut_as_the_per_request_rule(seed):
    rng = np.random.default_rng(seed)
    bs, vocab = 64, 12  # a small vocabulary: stop ids are frequent
    drafts = rng.integers(0, vocab, (bs, GAMMA))
    correct = rng.integers(0, GAMMA + 1, bs)
    window = np.minimum(correct + 1 + rng.integers(0, 2, bs), GAMMA + 1)
    accepted = BatchAccept.of_drafts(drafts, correct, correct, rng.integers(0, vocab, bs), window)
    lives = [
        _live(
            int(rng.integers(0, 20)), int(rng.integers(1, 24)),
            stop_ids=rng.choice(vocab, int(rng.integers(0, 3)), replace=False).tolist(),
            ignore_eos=bool(rng.random() < 0.2),
        )
        for _ in range(bs)
    ]  # fmt: skip
    out = cut_at_stops(accepted, lives)
    for i, live in enumerate(lives):
        full = accepted.row(i).tokens
        assert out.full(i) == full
        assert (int(out.committed[i]), out.reasons[i]) == _one_by_one(full, live), i


def test_a_batch_is_its_rows_and_stacking_the_rows_gives_the_batch_back():
    rng = np.random.default_rng(3)
    bs, vocab = 16, 10
    drafts = rng.integers(0, vocab, (bs, GAMMA))
    preds = rng.integers(0, vocab, (bs, GAMMA + 1))
    preds[:, :GAMMA] = np.where(rng.random((bs, GAMMA)) < 0.7, drafts, preds[:, :GAMMA])
    windows = rng.integers(1, GAMMA + 2, bs)
    rows = [
        greedy_accept_argmax(preds[i], drafts[i], vocab, window=int(windows[i]))
        for i in range(bs)
    ]
    batch = BatchAccept.stack(rows, GAMMA)
    assert [batch.row(i) for i in range(bs)] == rows
    assert batch.cap_trim.tolist() == [r.cap_trim for r in rows]
    assert batch.bonus.tolist() == [r.bonus_token for r in rows]
    again = BatchAccept.of_drafts(drafts, batch.correct, batch.correct_full, batch.bonus,
                                  batch.window)  # fmt: skip
    assert [again.row(i) for i in range(bs)] == rows
