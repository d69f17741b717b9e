"""Batched, graph-safe device twins of :mod:`dspark_obs.engine.acceptance`'s sampling rules.

The host path decides one request at a time in numpy / Python (``process_logits``,
``sample_accept``, ``_inverse_cdf``). The functions here make the same decisions for a
whole batch as a fixed sequence of torch ops, so they can run inside a captured CUDA graph:
no ``.item()`` / ``.cpu()`` / ``.tolist()``, no Python branching on tensor values and no
data-dependent shapes (per-row choices are ``torch.where`` selections, never boolean-mask
indexing). Python flags may still pick a code path, since they are fixed at capture time.

On the CPU in float64 the results are bit-for-bit those of the host rules, row by row:
``process_rows`` equals ``process_logits`` and ``sample_rows`` equals ``sample_accept`` with
explicit ``uniforms`` (same coins ``u_1..u_G`` then final coin ``v``, same window cap), so a
device step and a host step commit identical tokens under a shared uniform stream. On CUDA
the same ops give the same decisions up to floating-point reduction order (softmax, cumsum
and sum are parallel there), i.e. equal in distribution rather than bit-identical.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dspark_obs.engine.acceptance import SAMPLING_EPS

__all__ = [
    "accept_sampled_pack",
    "coin_flags",
    "final_draw",
    "keep_greedy_rows",
    "leading_true",
    "process_rows",
    "sample_rows",
]


def _one_hot_argmax(x: Tensor) -> Tensor:
    """Greedy distribution: one-hot at the first maximum (``torch.argmax``'s tie rule)."""
    top = torch.argmax(x, dim=-1, keepdim=True)
    return torch.zeros_like(x).scatter_(-1, top, 1.0)


def process_rows(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    *,
    use_top_k: bool = True,
    use_top_p: bool = True,
    greedy_rows: bool = True,
) -> Tensor:
    """Per-row :func:`~dspark_obs.engine.acceptance.process_logits` for ``logits`` [N, V].

    Why batched with per-row parameters: one graph serves a batch whose requests use
    different samplers (greedy, plain, top-k, top-p). Every row runs every filter and
    ``torch.where`` keeps the result only where the row asked for it, so a row with
    ``top_p == 1`` is the plain softmax (never renormalized) and a row with ``top_k`` of -1
    or ``>= V`` is untouched by top-k, exactly as the host skips those steps.

    ``temperature`` [N] and ``top_p`` [N] are compared and divided in float64 (a float32
    value widened to float64 is what ``float(t)`` hands the host). ``top_k`` [N] int64, -1
    disables. ``use_top_k=False`` / ``use_top_p=False``: the caller guarantees no row uses
    that filter, so its sort is skipped; ``greedy_rows=False``: no row has a temperature
    below ``SAMPLING_EPS`` (the one-hot rows are not built). Returns [N, V] float64.
    """
    x = logits.to(torch.float64)
    vocab = x.shape[-1]
    t = temperature.to(device=x.device, dtype=torch.float64)
    greedy = (t < SAMPLING_EPS)[:, None]
    # A safe divisor for greedy rows (their sampled row is discarded below): no 0 / inf.
    scaled = x / torch.where(greedy, torch.ones_like(t)[:, None], t[:, None])

    if use_top_k:
        k = top_k.to(device=x.device, dtype=torch.int64)[:, None]
        use_k = (k >= 1) & (k < vocab)
        order = torch.argsort(scaled, dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab, device=x.device).expand_as(order)
        rank_of = torch.empty_like(order).scatter_(-1, order, ranks)
        dropped = use_k & (rank_of >= k)
        scaled = scaled.masked_fill(dropped, float("-inf"))

    probs = torch.softmax(scaled, dim=-1)

    if use_top_p:
        tp = top_p.to(device=x.device, dtype=torch.float64)[:, None]
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        # The top token has before == 0 <= top_p, so every sum is > 0: no NaN on any row.
        sorted_p = sorted_p.masked_fill(before > tp, 0.0)
        sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
        nucleus = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = torch.where(tp < 1.0, nucleus, probs)

    if not greedy_rows:
        return probs
    # Greedy rows: one-hot at the first argmax of the logits, as the host (never scaled).
    return torch.where(greedy, _one_hot_argmax(x), probs)


def coin_flags(p_next: Tensor, q_next: Tensor, coins: Tensor) -> Tensor:
    """``sample_accept``'s per-draft test, [B, G] bool: accept iff ``0 < q <= 1`` and
    ``u * q < p`` (probability ``min(1, p / q)``; a non-probability ``q`` rejects)."""
    return (q_next > 0) & (q_next <= 1) & (coins * q_next < p_next)


def leading_true(ok: Tensor) -> Tensor:
    """Leading ``True`` count per row of ``ok`` [B, G] -> [B] int64 (accepted prefix length):
    the cumulative product is 1 up to the first ``False`` and 0 after it."""
    return torch.cumprod(ok.to(torch.int64), dim=-1).sum(dim=-1)


def _inverse_cdf_rows(weights: Tensor, v: Tensor) -> Tensor:
    """Row-wise ``acceptance._inverse_cdf``: first index with cumsum > ``v * total``; when
    ``v * total`` rounds up to the total, the last index of positive weight instead."""
    cs = torch.cumsum(weights, dim=-1)  # sequential on the CPU, as np.cumsum
    target = (v * cs[:, -1])[:, None]
    idx = torch.searchsorted(cs, target, right=True).squeeze(-1)
    vocab = weights.shape[-1]
    ids = torch.arange(vocab, device=weights.device)
    last_positive = torch.argmax((weights > 0).to(torch.int64) * ids, dim=-1)
    return torch.where(idx >= vocab, last_positive, idx)


def final_draw(p_row: Tensor, q_row: Tensor, residual: Tensor, v: Tensor) -> Tensor:
    """The one token a verify step draws per request, [B] int64.

    ``residual`` rows draw from ``norm(max(0, p - q))`` (``q`` outside [0, 1], NaN included,
    counts as 0) and fall back to ``p`` when that residual has no mass (p == q up to
    rounding); other rows draw from ``p``. ``q_row`` of non-residual rows is never read
    into the result, so garbage there is harmless.
    """
    p = p_row.to(torch.float64)
    q = q_row.to(device=p.device, dtype=torch.float64)
    q = torch.where((q >= 0) & (q <= 1), q, torch.zeros_like(q))
    res = torch.clamp_min(p - q, 0.0)
    # Non-negative terms: sum > 0 iff the host's (pairwise) numpy sum is > 0, whatever order.
    use_res = residual & (res.sum(dim=-1) > 0)
    weights = torch.where(use_res[:, None], res, p)
    return _inverse_cdf_rows(weights, v.to(device=p.device, dtype=torch.float64))


def sample_rows(
    probs: Tensor,
    next_tokens: Tensor,
    draft_probs: Tensor,
    coins: Tensor,
    verified: Tensor,
    window: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """A whole block's speculative-sampling acceptance for every request at once.

    Row ``r`` decides as ``sample_accept(probs[r, :verified[r]], next_tokens[r],
    draft_probs[r], uniforms=coins[r], window=window[r])``: ``probs`` [B, G + 1, V] float64
    target rows (rows at and past ``verified`` are ignored), ``next_tokens`` [B, G] drafts
    (ids of unverified slots may be padding),
    ``draft_probs`` [B, G, V], ``coins`` [B, G + 1] (``u_1..u_G`` then ``v``), ``verified``
    [B] in 1..G + 1 and ``window`` [B] in 1..verified (cap-accept; compact passes
    ``window == verified``).

    Returns ``(ok, correct_full, token)``: ``ok`` [B, G] the coin test per draft (False for
    unverified drafts), ``correct_full`` [B] its leading-True count, and ``token`` [B] the
    final token at ``c = min(correct_full, window - 1)``: from ``p`` at row ``c`` when the
    window was fully accepted, else from the residual there. Row ``r`` commits
    ``next_tokens[r, :c] + [token]``.
    """
    bsz, rows, vocab = probs.shape
    gamma = rows - 1
    dev = probs.device
    tokens = next_tokens.to(device=dev, dtype=torch.int64)
    verified = verified.to(device=dev, dtype=torch.int64)
    window = window.to(device=dev, dtype=torch.int64)
    coins = coins.to(device=dev, dtype=torch.float64)

    # Ids of unverified slots may be padding: clamp so the gather is in bounds (masked anyway).
    idx = tokens.clamp(0, vocab - 1)[:, :, None]
    p_next = probs[:, :gamma].gather(-1, idx).squeeze(-1).to(torch.float64)
    q_next = draft_probs.to(dev).gather(-1, idx).squeeze(-1).to(torch.float64)
    judged = torch.arange(gamma, device=dev)[None, :] < (verified - 1)[:, None]
    ok = coin_flags(p_next, q_next, coins[:, :gamma]) & judged
    correct_full = leading_true(ok)

    c = torch.minimum(correct_full, window - 1)
    residual = c < window - 1  # a rejection inside the window (then c < gamma)
    p_row = probs.gather(1, c[:, None, None].expand(bsz, 1, vocab)).squeeze(1)
    if gamma > 0:
        # c == gamma only when residual is False; clamp so the gather stays in bounds.
        qc = torch.clamp_max(c, gamma - 1)[:, None, None].expand(bsz, 1, vocab)
        q_row = draft_probs.to(dev).gather(1, qc).squeeze(1)
    else:
        q_row = torch.zeros_like(p_row)
    token = final_draw(p_row, q_row, residual, coins[:, -1])
    return ok, correct_full, token


def accept_sampled_pack(
    logits: Tensor,
    cell: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    drafts: Tensor,
    draft_probs: Tensor,
    coins: Tensor,
    verified: Tensor,
    window: Tensor,
    *,
    use_top_k: bool = True,
    use_top_p: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """A whole-block verify's sampled acceptance from its pack of target logits rows:
    ``logits`` [N, V], row ``n`` at grid cell ``cell[n]`` (``r * (G + 1) + j``: request
    ``r``, after the anchor and drafts ``1..j``; padding rows at ``B * (G + 1)``). Each row
    gets its request's sampler (:func:`process_rows`; only the pack's rows, not the whole
    grid), the rows are laid out on the ``[B, G + 1]`` grid, then :func:`sample_rows`.
    Returns ``(keep, correct_full, token)``: drafts committed (``min(correct_full, window -
    1)``), drafts the coins accepted over every verified one, and the final token. Rows with
    ``verified`` or ``window`` 0 (padding) decide as if 1; their results are the caller's
    to discard, as are those of greedy rows (temperature < ``SAMPLING_EPS``: the caller
    accepts them by the greedy rule; they are processed at temperature 1)."""
    bsz, rows = drafts.shape[0], drafts.shape[1] + 1
    owner = torch.div(cell, rows, rounding_mode="floor").clamp(max=bsz - 1)
    temps = temperature.to(torch.float64)
    temps = torch.where(temps < SAMPLING_EPS, torch.ones_like(temps), temps)
    probs = process_rows(logits, temps[owner], top_p[owner], top_k[owner], use_top_k=use_top_k,
                         use_top_p=use_top_p, greedy_rows=False)  # fmt: skip
    grid = probs.new_zeros(bsz * rows + 1, probs.shape[-1]).index_copy_(0, cell, probs)
    verified, window = verified.clamp(min=1), window.clamp(min=1)
    _, full, token = sample_rows(
        grid[: bsz * rows].view(bsz, rows, -1), drafts, draft_probs, coins, verified, window
    )
    return torch.minimum(full, window - 1), full, token


def keep_greedy_rows(
    temperature: Tensor, greedy: tuple[Tensor, ...], sampled: tuple[Tensor, ...]
) -> tuple[Tensor, ...]:
    """Per row, the greedy rule's results where ``temperature`` is 0 (what the host sets for
    a greedy row), else the rejection sampling's: one acceptance for a mixed batch."""
    is_greedy = temperature <= 0
    return tuple(torch.where(is_greedy, g, s) for g, s in zip(greedy, sampled, strict=True))
