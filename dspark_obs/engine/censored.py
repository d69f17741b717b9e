"""Censored compact blocks: the trimmed drafts the block-accept estimator needs resolved.

A compact step whose window was fully accepted while drafts were trimmed records
``trimmed_tokens`` and their draft log-probs; later target rows that cover those positions
resolve them into ``pg`` entries ``(src_fct, k, target_logprob, draft_token,
realized_token)`` until the first offset whose realized token differs from the draft
(SGLang 0.5.23's JSONL semantics). This module holds that bookkeeping, apart from the loop:
the open blocks of a request, their resolution against a step's rows, and the log p lookups
(a full processed row on the reference path, or a few columns gathered on the device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "ESTIMATOR_MIN_TEMPERATURE",
    "TARGET_LOGPROB_FLOOR",
    "Censored",
    "LogpAt",
    "greedy_logprobs_at",
    "resolve",
    "resolve_block",
]

ESTIMATOR_MIN_TEMPERATURE = 1e-5
"""Log-probs for the estimator use ``max(T, 1e-5)`` (SGLang's floor), so greedy rows give
~0 for the argmax and a huge negative value for anything else."""

TARGET_LOGPROB_FLOOR = -1e4
"""Stored in ``pg`` for a trimmed draft that top-k / top-p removed from the target's
distribution (log p = -inf): finite for the store, and ``exp(floor - q_lp) == 0`` exactly."""


@dataclass
class Censored:
    """A compact block whose trimmed drafts await resolution by later target rows."""

    src_fct: int
    start_pos: int  # absolute position of the first trimmed draft
    first_k: int  # its 1-based draft position in the block (SGLang's k): verify_len
    tokens: list[int]
    next_k: int = 0  # offset of the next unresolved trimmed draft


class LogpAt:
    """log p of a step's target rows at a few token columns (a host copy): ``t[r, token]``."""

    def __init__(self, values: np.ndarray, tokens: Sequence[int]) -> None:
        self.values = values
        self.col = {int(t): j for j, t in enumerate(tokens)}

    def __getitem__(self, key: tuple[int, int]) -> float:
        r, token = key
        return float(self.values[r, self.col[int(token)]])


def greedy_logprobs_at(rows: Sequence[torch.Tensor], cols: Sequence[Sequence[int]]) -> torch.Tensor:
    """For greedy requests: ``log_softmax(logits / 1e-5)`` of request i's rows at columns
    ``cols[i]``, flattened row-major per request, in float64 (float32 cannot hold the
    normalizer of logits divided by 1e-5 to the precision ``exp`` needs). A few kernels for
    all requests together, no ``[rows, vocab]`` output."""
    x = torch.cat(list(rows)).double() / ESTIMATOR_MIN_TEMPERATURE
    lse = torch.logsumexp(x, dim=-1)
    counts = [r.shape[0] for r in rows]
    starts = np.cumsum([0, *counts[:-1]])
    r_idx = np.concatenate(
        [
            np.repeat(np.arange(a, a + n), len(c))
            for a, n, c in zip(starts, counts, cols, strict=True)
        ]
    )
    c_idx = np.concatenate([np.tile(np.asarray(c), n) for n, c in zip(counts, cols, strict=True)])
    r_t = torch.from_numpy(r_idx).to(x.device)
    return x[r_t, torch.from_numpy(c_idx).to(x.device)] - lse[r_t]


def resolve(
    blocks: list[Censored], logp: Any, tokens: list[int], prefix_len: int
) -> tuple[list[dict[str, Any]], list[Censored]]:
    """Resolve a request's open blocks (oldest first) against this step's target rows:
    the ``pg`` entries, and the blocks still open."""
    entries: list[dict[str, Any]] = []
    still: list[Censored] = []
    for blk in blocks:
        entries.extend(resolve_block(blk, logp, tokens, prefix_len))
        if blk.next_k < len(blk.tokens):
            still.append(blk)
    return entries, still


def resolve_block(
    blk: Censored, logp: Any, tokens: list[int], prefix_len: int
) -> list[dict[str, Any]]:
    """Walk the block's trimmed drafts over this step's rows; stop after the first miss.

    Row ``r`` of this step's target output predicts absolute position ``prefix_len+1+r``
    (``prefix_len`` is the anchor's position), whose realized token is ``tokens[r]``
    (accepted drafts then the bonus, before any EOS / length cut). ``logp[r, token]`` is a
    full log-prob tensor or a :class:`LogpAt`; None resolves nothing.
    """
    entries = []
    while blk.next_k < len(blk.tokens) and logp is not None:
        r = blk.start_pos + blk.next_k - (prefix_len + 1)
        if r < 0 or r >= len(tokens):
            break
        draft = blk.tokens[blk.next_k]
        realized = tokens[r]
        entries.append(
            {
                "src_fct": blk.src_fct,
                "k": blk.first_k + blk.next_k,
                "target_logprob": max(float(logp[r, draft]), TARGET_LOGPROB_FLOOR),
                "draft_token": draft,
                "realized_token": realized,
            }
        )
        blk.next_k += 1
        if realized != draft:
            blk.next_k = len(blk.tokens)  # diverged: the rest can never be resolved
            break
    return entries
