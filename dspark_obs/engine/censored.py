"""The engine's side of censored compact blocks: the target log-probs their walk reads.

A compact step whose window was fully accepted while drafts were trimmed records
``trimmed_tokens`` and their draft log-probs; later target rows that cover those positions
resolve them into ``pg`` entries (SGLang 0.5.23's JSONL semantics). The block and its walk
are :class:`dspark_obs.analytics.estimator_recorder.Censored` (one implementation, shared
with :class:`~dspark_obs.analytics.estimator_recorder.BlockAcceptRecorder`; the decode loop
imports them from here with the lookups). This module adds what only the engine has: log p
lookups (a full processed row on the reference path, or a few columns gathered on the device).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dspark_obs.analytics.estimator_recorder import (
    TARGET_LOGPROB_FLOOR,
    Censored,
    resolve,
    resolve_block,
)
from dspark_obs.engine.host_copy import upload

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


class LogpAt:
    """log p of a step's target rows at a few token columns (a host copy): ``t[r, token]``."""

    def __init__(self, values: np.ndarray, tokens: Sequence[int]) -> None:
        self.values = values
        self.col = {int(t): j for j, t in enumerate(tokens)}

    def __getitem__(self, key: tuple[int, int]) -> float:
        r, token = key
        return float(self.values[r, self.col[int(token)]])


def greedy_logprobs_at(
    rows: Sequence[torch.Tensor] | torch.Tensor,
    cols: Sequence[Sequence[int]],
    counts: Sequence[int] | None = None,
) -> torch.Tensor:
    """For greedy requests: ``log_softmax(logits / 1e-5)`` of request i's rows at columns
    ``cols[i]``, flattened row-major per request, in float64 (float32 cannot hold the
    normalizer of logits divided by 1e-5 to the precision ``exp`` needs). ``rows``: each
    request's rows, or all of them one request after another with ``counts`` rows each (one
    gather from a pack instead of a slice per request). A few kernels for all requests
    together, no ``[rows, vocab]`` output."""
    if counts is None:
        rows = list(rows)
        counts = [r.shape[0] for r in rows]
        rows = torch.cat(rows)
    assert isinstance(rows, torch.Tensor)
    x = rows.double() / ESTIMATOR_MIN_TEMPERATURE
    lse = torch.logsumexp(x, dim=-1)
    n = np.asarray(counts, dtype=np.int64)
    width = np.fromiter((len(c) for c in cols), dtype=np.int64, count=len(cols))
    r_idx = np.repeat(np.arange(int(n.sum())), np.repeat(width, n))  # each row, its widths
    # request k's columns once per row of it (np.tile per request, in one pass)
    flat = np.fromiter((t for c in cols for t in c), dtype=np.int64, count=int(width.sum()))
    size = n * width
    k = np.repeat(np.arange(len(cols)), size)
    within = np.arange(int(size.sum())) - np.repeat(np.cumsum(size) - size, size)
    c_idx = flat[(np.cumsum(width) - width)[k] + within % width[k]]
    r_t = upload(r_idx, x.device)
    return x[r_t, upload(c_idx, x.device)] - lse[r_t]
