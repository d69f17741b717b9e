"""The block-accept estimator's tail model for a live consumer (the Prometheus / OTel series).

A live sink estimates requests as they finish, in passes whose timing it does not control; if
it refit the tail model at every pass, its counters would depend on when the passes ran (and a
restarted ``serve`` re-reading the store would resume them elsewhere). So a run's model is
refit only at fixed points of its finished-request count, with the same selection the store
views and the report use (``tail="auto"``), on the run's own observations so far.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pandas as pd

from dspark_obs.analytics.estimator_tail import OBS_COLUMNS, TailModel, fit_tail

TAIL_WINDOW = 20_000
"""Tail-model observations kept per run (its most recent finished requests'): what the tail
model is selected and fit on, in bounded memory."""
REFIT_EVERY = 512
"""After this many finished requests a run's tail model is refit every this many."""


def refits_at(n: int) -> bool:
    """Whether a run's tail model is refit before its ``n``-th finished request (0-based):
    at 0, 1, 2, 4, ..., REFIT_EVERY, then every REFIT_EVERY. Fixed points of the request
    count, not of the clock, so the sums are the same whenever the passes ran (a restarted
    ``serve`` re-reading the store resumes every counter at the same value)."""
    return n == 0 or (n <= REFIT_EVERY and n & (n - 1) == 0) or n % REFIT_EVERY == 0


@dataclass
class RunTail:
    """A compact run's tail model for the live estimator: fit with ``tail="auto"`` (as the
    store views and the report do) on the observations of the run's finished requests so
    far (the last ``TAIL_WINDOW``), refit at :func:`refits_at` points of the request count."""

    finished: int = 0
    observations: pd.DataFrame | None = None
    _model: TailModel | None = None
    _fit_at: int = -1

    def segments(self, rids: Sequence[str]) -> Iterable[list[str]]:
        """Split requests (in finishing order) where a refit falls; ``finished`` advances as
        each segment is :meth:`add`-ed."""
        seg: list[str] = []
        n = self.finished
        for r in rids:
            if seg and refits_at(n):
                yield seg
                seg = []
            seg.append(r)
            n += 1
        if seg:
            yield seg

    def model(self, gamma: int) -> TailModel:
        """The model for the next request: refit first when a refit point is due."""
        if self._model is None or (self._fit_at != self.finished and refits_at(self.finished)):
            obs = self.observations
            obs = pd.DataFrame(columns=list(OBS_COLUMNS)) if obs is None else obs
            self._model, self._fit_at = fit_tail("auto", obs, gamma), self.finished
        return self._model

    def add(self, obs: pd.DataFrame | None, requests: int) -> None:
        self.finished += requests
        if obs is None or len(obs) == 0:
            return
        both = obs if self.observations is None else pd.concat([self.observations, obs])
        self.observations = both.iloc[-TAIL_WINDOW:].reset_index(drop=True)
