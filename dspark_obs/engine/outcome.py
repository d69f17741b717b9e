"""What one decode step decided for its rows, column-wise: the acceptance, the stop / length
cut, the tokens committed and who finished (:class:`StepOutcome`).

Apart from the step because the step's commit, its statistics and its records all read it:
columns of the whole batch, so that only rows that finished, hit a stop id or carry censored
blocks are visited one by one (the rest of a batch-256 step is a few array operations).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dspark_obs.engine.acceptance import BatchAccept
from dspark_obs.engine.live import Live

__all__ = ["StepOutcome", "cut_at_stops"]


@dataclass(eq=False)
class StepOutcome:
    """Row i: request i. ``accepted.tokens[i, :accepted.correct[i] + 1]`` are the tokens uncut
    by stops / length (what the estimator resolves against), of which the first
    ``committed[i]`` were committed; ``reasons[i]``: the finish reason (None: still running)."""

    accepted: BatchAccept
    committed: np.ndarray  # [bs] int64
    reasons: list[str | None]

    def full(self, i: int) -> list[int]:
        """Row i's tokens uncut by stops / length."""
        return self.accepted.tokens[i, : int(self.accepted.correct[i]) + 1].tolist()

    @property
    def finished(self) -> np.ndarray:
        """[bs] bool: the rows whose request finished this step."""
        return np.fromiter((r is not None for r in self.reasons), bool, len(self.reasons))


def cut_at_stops(accepted: BatchAccept, lives: Sequence[Live]) -> StepOutcome:
    """Each row's committed tokens: up to and including the first stop id (``"stop"``), and
    no more than the request has left (``"length"``: reaching the limit exactly finishes it
    too). One ``isin`` over the batch finds the rows that may hold a stop id; only those are
    checked against their own request's ids."""
    bs = len(lives)
    n = accepted.correct + 1
    cut = n.copy()
    reasons: list[str | None] = [None] * bs
    ids = {t for stops in {live.stops for live in lives if not live.req.ignore_eos} for t in stops}
    if ids:
        inside = np.arange(accepted.tokens.shape[1])[None, :] < n[:, None]
        hit = np.isin(accepted.tokens, np.fromiter(ids, np.int64, len(ids))) & inside
        for i in np.flatnonzero(hit.any(axis=1)).tolist():
            live = lives[i]
            for j in np.flatnonzero(hit[i]).tolist():
                if live.stops_at(int(accepted.tokens[i, j])):
                    cut[i], reasons[i] = j + 1, "stop"
                    break
    remaining = np.fromiter(
        (live.req.max_new_tokens - len(live.output) for live in lives), np.int64, bs
    )
    stopped = np.fromiter((r is not None for r in reasons), bool, bs)
    length = (cut > remaining) | (~stopped & (cut == remaining))
    for i in np.flatnonzero(length).tolist():
        cut[i], reasons[i] = remaining[i], "length"
    return StepOutcome(accepted, cut, reasons)
