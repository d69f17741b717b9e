"""Lossless acceptance of a drafted block against the target, with window capping.

Layout of one request's verify step: ``target_probs`` has ``w`` rows (``w`` = verified
positions, anchor included); row ``i`` is the target distribution of the token after the
anchor and drafts ``1..i``. Draft ``j`` (1-based) is judged against row ``j - 1``; the token
committed after the last accepted draft comes from row ``correct``.

Greedy: drafts are accepted while they equal the row argmax; the bonus is the argmax of the
row after the last accepted draft (SGLang: ``compute_dflash_correct_drafts_and_bonus``).

Sampling (SGLang's chain speculative sampling, token by token): draft ``j`` with draft
probability ``q = q_j(x)`` is accepted iff ``0 < q <= 1`` and ``u_j * q < p_j(x)``, i.e. with
probability ``min(1, p/q)``. At the first rejection the token is drawn from
``norm(max(0, p - q))`` at that row; if every verified draft is accepted it is drawn from ``p``
at the next row. Draws use the inverse CDF: the first token whose cumulative mass exceeds
``v * total``.

Randomness and the cap-accept == compact invariant. Every sampling call consumes a fixed
vector of ``block_size + 1`` uniforms: ``u_1..u_block_size`` (one coin per draft position,
in position order) and one final coin ``v`` (the last element) for the one token drawn
from a distribution. Verifying the full block and capping it to window ``w`` (``window=w``)
therefore sees the same coins for drafts ``1..w-1`` as verifying only ``w`` rows, stops at the
same draft, and draws its final token from the same distribution with the same ``v``:

* rejection inside the window (``correct_full < w - 1``): residual at row ``correct_full``;
* otherwise (all ``w - 1`` window drafts accepted, whatever happened after): ``p`` at row
  ``w - 1``, exactly what compact draws when its window is fully accepted.

So the committed tokens are identical, not just equal in distribution, provided the caller
passes ``block_size = gamma`` in both modes (so the generator advances equally per step).

Differences from SGLang, on purpose: SGLang's cap-accept truncates the full-block result, so
when the cap binds its last committed token is the accepted draft ``w`` (or the residual draw
at row ``w - 1`` when draft ``w`` was rejected) instead of a fresh draw from ``p``; both are
lossless, ours is token-identical to compact under a shared stream. SGLang draws one final
coin per request as well but coins per batch (``rand(bs, gamma)``, ``rand(bs)``); ours are
per request in the order above. When a rejection leaves an all-zero residual (p == q up to
rounding) SGLang emits the last vocabulary id; we draw from ``p`` instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

__all__ = [
    "AcceptResult",
    "BatchAccept",
    "accept",
    "draw_uniforms",
    "greedy_accept",
    "greedy_accept_argmax",
    "greedy_accept_batch",
    "is_truncated",
    "process_logits",
    "process_logprobs",
    "sample_accept",
]

SAMPLING_EPS = 1e-6
"""Temperatures below this are greedy (SGLang's ``_SAMPLING_EPS``)."""

ArrayLike = np.ndarray | torch.Tensor | Sequence[float] | Sequence[Sequence[float]]


@dataclass(frozen=True)
class AcceptResult:
    """What one request commits in one verify step, plus what the cap hid."""

    correct_drafts: int
    """Leading drafts committed (after the window cap): ``acc_len - 1``."""
    tokens: list[int]
    """Committed tokens: the accepted drafts then the bonus / corrected token."""
    bonus_token: int
    correct_full: int
    """Leading drafts accepted among all verified drafts, before the cap."""
    cap_trim: int
    """``correct_full - correct_drafts``: accepted drafts the window cut off."""
    verify_len: int
    """The window committed within (anchor included)."""

    @property
    def acc_len(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, eq=False)  # arrays: compare columns, not objects
class BatchAccept:
    """A batch's acceptance column-wise (row i: request i): what :class:`AcceptResult` holds
    per request, as arrays, so that a step's commit and records read columns instead of one
    object per request."""

    correct: np.ndarray
    """[bs] int64: leading drafts committed (after the window cap)."""
    correct_full: np.ndarray
    """[bs] int64: leading drafts accepted among all verified drafts, before the cap."""
    window: np.ndarray
    """[bs] int64: the window committed within (anchor included)."""
    tokens: np.ndarray
    """[bs, gamma + 1] int64: row i's first ``correct[i]`` entries are its accepted drafts
    and entry ``correct[i]`` its bonus (or corrected) token; later entries mean nothing."""

    @classmethod
    def of_drafts(
        cls,
        drafts: np.ndarray,
        correct: np.ndarray,
        correct_full: np.ndarray,
        bonus: np.ndarray,
        window: np.ndarray,
    ) -> BatchAccept:
        """From the drafts [bs, gamma] and each row's counts and final token."""
        d = np.asarray(drafts, dtype=np.int64)
        bs = d.shape[0]
        c = np.asarray(correct, dtype=np.int64)
        tokens = np.concatenate([d, np.zeros((bs, 1), dtype=np.int64)], axis=1)
        tokens[np.arange(bs), c] = np.asarray(bonus, dtype=np.int64)
        return cls(c, np.asarray(correct_full, dtype=np.int64),
                   np.asarray(window, dtype=np.int64), tokens)  # fmt: skip

    @classmethod
    def stack(cls, results: Sequence[AcceptResult], gamma: int) -> BatchAccept:
        """Per-request results (a split step's) as one batch."""
        bs = len(results)
        tokens = np.zeros((bs, gamma + 1), dtype=np.int64)
        for i, res in enumerate(results):
            tokens[i, : len(res.tokens)] = res.tokens
        return cls(
            np.fromiter((r.correct_drafts for r in results), np.int64, bs),
            np.fromiter((r.correct_full for r in results), np.int64, bs),
            np.fromiter((r.verify_len for r in results), np.int64, bs),
            tokens,
        )

    def __len__(self) -> int:
        return len(self.correct)

    @property
    def bonus(self) -> np.ndarray:
        return self.tokens[np.arange(len(self.correct)), self.correct]

    @property
    def cap_trim(self) -> np.ndarray:
        """Accepted drafts the window cut off."""
        return self.correct_full - self.correct

    def row(self, i: int) -> AcceptResult:
        """Request i's acceptance as one object."""
        c = int(self.correct[i])
        tokens = self.tokens[i, : c + 1].tolist()
        cf = int(self.correct_full[i])
        return AcceptResult(c, tokens, tokens[-1], cf, cf - c, int(self.window[i]))


def _np64(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _tokens(draft_tokens: ArrayLike, n: int, vocab: int) -> np.ndarray:
    """The first ``n`` draft ids (a longer block is allowed: compact verifies a prefix)."""
    if isinstance(draft_tokens, torch.Tensor):
        draft_tokens = draft_tokens.detach().cpu().numpy()
    d = np.asarray(draft_tokens, dtype=np.int64).reshape(-1)
    if d.shape[0] < n:
        raise ValueError(f"{d.shape[0]} draft tokens for {n + 1} verified rows (need rows - 1)")
    d = d[:n]
    if n and (d.min() < 0 or d.max() >= vocab):
        raise ValueError(f"draft token id out of range [0, {vocab})")
    return d


def _draft_rows(draft_probs: ArrayLike, n: int, vocab: int) -> np.ndarray:
    """The first ``n`` rows of q as float64 (extra rows of a full block are ignored)."""
    q = draft_probs[:n] if isinstance(draft_probs, torch.Tensor | np.ndarray) else draft_probs
    q = _np64(q)
    if q.ndim != 2 or q.shape[1] != vocab or q.shape[0] < n:
        raise ValueError(f"draft probs must be [>= {n}, {vocab}], got shape {q.shape}")
    return q[:n]


def _window(window: int | None, rows: int) -> int:
    if window is None:
        return rows
    if not 1 <= window <= rows:
        raise ValueError(f"window must be in 1..{rows} (verified rows), got {window}")
    return int(window)


def _result(d: np.ndarray, correct_full: int, c: int, bonus: int, window: int) -> AcceptResult:
    tokens = [int(t) for t in d[:c]] + [int(bonus)]
    return AcceptResult(c, tokens, int(bonus), int(correct_full), int(correct_full - c), window)


def _leading_true(ok: np.ndarray) -> int:
    return int(ok.size if ok.all() else np.argmin(ok))


def greedy_accept(
    target_scores: ArrayLike, draft_tokens: ArrayLike, *, window: int | None = None
) -> AcceptResult:
    """Argmax-match acceptance. ``target_scores`` [w, vocab]: logits or probs (only the argmax
    is used; pass logits to avoid ties that softmax rounding can create). Consumes no RNG."""
    s = _np64(target_scores)
    if s.ndim != 2 or s.shape[0] < 1:
        raise ValueError(f"target scores must be [w >= 1, vocab], got shape {s.shape}")
    return greedy_accept_argmax(np.argmax(s, axis=-1), draft_tokens, s.shape[1], window=window)


def greedy_accept_argmax(
    pred: np.ndarray, draft_tokens: ArrayLike, vocab: int, *, window: int | None = None
) -> AcceptResult:
    """:func:`greedy_accept` from the target's argmax per verified row (``pred`` [w], first
    maximum): what a device-side argmax hands over instead of ``w * vocab`` scores."""
    pred = np.asarray(pred, dtype=np.int64).reshape(-1)
    rows = pred.shape[0]
    if rows < 1:
        raise ValueError("greedy acceptance needs at least one verified row")
    d = _tokens(draft_tokens, rows - 1, vocab)
    win = _window(window, rows)
    correct_full = _leading_true(d == pred[: rows - 1])
    c = min(correct_full, win - 1)
    return _result(d, correct_full, c, int(pred[c]), win)


def greedy_accept_batch(
    pred: np.ndarray,
    drafts: np.ndarray,
    rows: np.ndarray,
    vocab: int,
    *,
    windows: np.ndarray | None = None,
) -> BatchAccept:
    """:func:`greedy_accept_argmax` for a whole batch at once: request i verified ``rows[i]``
    rows (``pred[i, :rows[i]]``, of ``pred`` [B, gamma + 1]) against ``drafts[i]`` [B, gamma],
    capped to ``windows[i]`` (cap-accept) when given. Array operations over the batch, no
    per-request call or object (a step at batch 256 would otherwise spend milliseconds)."""
    pred = np.asarray(pred, dtype=np.int64)
    d = np.asarray(drafts, dtype=np.int64)
    n = np.asarray(rows, dtype=np.int64)
    bs, gamma = d.shape
    if pred.shape != (bs, gamma + 1) or n.shape != (bs,):
        raise ValueError(
            f"pred {pred.shape}, drafts {d.shape} and rows {n.shape} do not describe one batch"
        )
    if bs and (n.min() < 1 or n.max() > gamma + 1):
        raise ValueError(f"verified rows must be in 1..{gamma + 1}")
    if d.size and (d.min() < 0 or d.max() >= vocab):
        raise ValueError(f"draft token id out of range [0, {vocab})")
    win = n if windows is None else np.asarray(windows, dtype=np.int64)
    if bs and ((win < 1).any() or (win > n).any()):
        raise ValueError("window must be in 1..verified rows")
    verified = np.arange(gamma)[None, :] < (n - 1)[:, None]
    match = (d == pred[:, :gamma]) & verified
    correct_full = np.cumprod(match, axis=1).sum(axis=1)
    correct = np.minimum(correct_full, win - 1)
    return BatchAccept.of_drafts(d, correct, correct_full, pred[np.arange(bs), correct], win)


def draw_uniforms(generator: torch.Generator | None, block_size: int) -> np.ndarray:
    """The ``block_size + 1`` uniforms in [0, 1) one sampling verify consumes (coins, then v)."""
    if block_size < 0:
        raise ValueError(f"block_size must be >= 0, got {block_size}")
    return torch.rand(block_size + 1, generator=generator, dtype=torch.float64).numpy()


def _inverse_cdf(weights: np.ndarray, v: float) -> int:
    """First index whose cumulative weight exceeds ``v * total`` (never a zero-weight index)."""
    cs = np.cumsum(weights)
    idx = int(np.searchsorted(cs, v * cs[-1], side="right"))
    if idx >= weights.size:  # v * total rounded up to total
        idx = int(np.flatnonzero(weights > 0)[-1])
    return idx


def sample_accept(
    target_probs: ArrayLike,
    draft_tokens: ArrayLike,
    draft_probs: ArrayLike,
    *,
    generator: torch.Generator | None = None,
    uniforms: ArrayLike | None = None,
    window: int | None = None,
    block_size: int | None = None,
) -> AcceptResult:
    """Speculative-sampling acceptance; lossless w.r.t. ``target_probs``.

    ``target_probs`` [w, vocab] and ``draft_probs`` [>= w-1, vocab] are the already-processed
    (temperature / top-k / top-p) distributions, see :func:`process_logits`. Randomness comes
    from ``uniforms`` if given (length >= w; coins first, final coin last) or else
    ``draw_uniforms(generator, block_size)`` with ``block_size`` defaulting to ``w - 1``.
    ``window`` (<= w) caps the commit as cap-accept does (see the module docstring).
    """
    p = _np64(target_probs)
    if p.ndim != 2 or p.shape[0] < 1:
        raise ValueError(f"target probs must be [w >= 1, vocab], got shape {p.shape}")
    rows, vocab = p.shape
    n = rows - 1
    q = _draft_rows(draft_probs, n, vocab)
    d = _tokens(draft_tokens, n, vocab)
    win = _window(window, rows)
    if uniforms is None:
        bsz = n if block_size is None else int(block_size)
        if bsz < n:
            raise ValueError(f"block_size {bsz} is smaller than the {n} verified drafts")
        u = draw_uniforms(generator, bsz)
    else:
        u = _np64(uniforms).reshape(-1)
        if u.size < n + 1:
            raise ValueError(f"need at least {n + 1} uniforms, got {u.size}")
    if n:
        ar = np.arange(n)
        p_sel, q_sel = p[ar, d], q[ar, d]
        ok = (q_sel > 0) & (q_sel <= 1) & (u[:n] * q_sel < p_sel)
        correct_full = _leading_true(ok)
    else:
        correct_full = 0
    c = min(correct_full, win - 1)
    if c == win - 1:
        weights = p[c]
    else:
        qc = q[c]
        qc = np.where((qc >= 0) & (qc <= 1), qc, 0.0)  # a non-probability q counts as 0
        weights = np.maximum(p[c] - qc, 0.0)
        if not weights.sum() > 0:
            weights = p[c]
    return _result(d, correct_full, c, _inverse_cdf(weights, float(u[-1])), win)


def accept(
    target_probs: ArrayLike,
    draft_tokens: ArrayLike,
    draft_probs: ArrayLike | None = None,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    *,
    window: int | None = None,
    block_size: int | None = None,
    uniforms: ArrayLike | None = None,
) -> AcceptResult:
    """Verify ``w`` rows and commit within ``window`` (default ``w``); greedy or sampling.

    Static mode: full block, no window. Compact: only the window's rows, no window argument.
    Cap-accept: full block with ``window=verify_len``; ``correct_full`` / ``cap_trim`` then
    give the ceiling. Pass ``block_size=gamma`` for sampling so every mode consumes the same
    ``gamma + 1`` uniforms per request per step.
    """
    if greedy:
        return greedy_accept(target_probs, draft_tokens, window=window)
    if draft_probs is None:
        raise ValueError("sampling acceptance needs draft_probs")
    return sample_accept(
        target_probs,
        draft_tokens,
        draft_probs,
        generator=generator,
        uniforms=uniforms,
        window=window,
        block_size=block_size,
    )


@overload
def process_logits(
    logits: np.ndarray, temperature: float, top_p: float = ..., top_k: int = ...
) -> np.ndarray: ...
@overload
def process_logits(
    logits: torch.Tensor, temperature: float, top_p: float = ..., top_k: int = ...
) -> torch.Tensor: ...
def process_logits(
    logits: np.ndarray | torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1
) -> np.ndarray | torch.Tensor:
    """Sampling distribution(s) over the last axis, as SGLang's sampler builds them.

    Order: temperature, then top-k on the scaled logits (ties kept by lower token id), softmax,
    then top-p (a token is dropped when the mass of the tokens ranked before it exceeds
    ``top_p``), renormalized. ``temperature < 1e-6`` means greedy: one-hot at the first argmax.
    ``top_k = -1`` and ``top_p = 1`` disable those filters. Returns the input's array type.
    """
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k != -1 and top_k < 1:
        raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {top_k}")
    if isinstance(logits, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(logits))
        return _process(x, temperature, top_p, top_k).numpy()
    return _process(logits, temperature, top_p, top_k)


def is_truncated(top_p: float, top_k: int) -> bool:
    """Whether top-k / top-p cut the sampling distribution (SGLang's truncated-sampling mask)."""
    return top_k != -1 or top_p != 1.0


def process_logprobs(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1
) -> torch.Tensor:
    """Log of :func:`process_logits`'s distribution (``-inf`` where a filter removed a token).

    Why: the block-accept estimator needs ``log p`` of the distribution acceptance really
    used. Untruncated rows get ``log_softmax(logits / T)`` exactly (what SGLang's recorder
    gathers); truncated rows keep exactly the tokens :func:`process_logits` keeps and
    renormalize over them in log space. Greedy callers floor ``T`` first.
    """
    if not (math.isfinite(temperature) and temperature >= SAMPLING_EPS):
        raise ValueError(f"temperature must be finite and >= {SAMPLING_EPS}, got {temperature}")
    x = logits.to(torch.float64) / temperature
    if not is_truncated(top_p, top_k):
        return torch.log_softmax(x, dim=-1)
    kept = process_logits(logits.to(torch.float64), temperature, top_p, top_k) > 0
    x = x.masked_fill(~kept, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def _process(x: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    x = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    vocab = x.shape[-1]
    if temperature < SAMPLING_EPS:
        top = torch.argmax(x, dim=-1, keepdim=True)
        probs = torch.zeros_like(x).scatter_(-1, top, 1.0)
    else:
        x = x / temperature
        if 1 <= top_k < vocab:
            order = torch.argsort(x, dim=-1, descending=True, stable=True)
            keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, order[..., :top_k], True)
            x = x.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if top_p < 1.0:
            sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
            before = torch.cumsum(sorted_p, dim=-1) - sorted_p
            sorted_p = sorted_p.masked_fill(before > top_p, 0.0)
            sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs
