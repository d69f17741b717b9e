"""A running request's state in the decode loop, and the per-request rules every step applies
to it (stop ids, the min-new-tokens mask, SGLang's "logits adjusted" test)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dspark_obs.engine.acceptance import SAMPLING_EPS
from dspark_obs.engine.censored import Censored
from dspark_obs.engine.penalties import OutputCounts
from dspark_obs.engine.types import MASKED_LOGIT, GenRequest

__all__ = ["FirstTokens", "Live", "mask_stops", "sglang_adjusts_logits"]


class FirstTokens:
    """The first tokens of one admission's greedy arrivals, argmax'd on the device and copied
    to the host without waiting. They are read when the first step that ran those requests
    is read; that step's read-back came after this copy on the device's stream, so nothing
    waits there."""

    def __init__(self, tokens: torch.Tensor) -> None:
        """``tokens``: int64 [k] on the device (the admission's argmax)."""
        self._values: list[int] | None = None
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=torch.long, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready: torch.cuda.Event | None = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = tokens.detach().clone(), None

    def __getitem__(self, i: int) -> int:
        if self._values is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._values = self._host.tolist()
        return self._values[i]


@dataclass(eq=False)  # a running request is an identity: removing one compares no fields
class Live:
    """Per running request state."""

    req: GenRequest
    gen: torch.Generator
    anchor: int
    output: list[int]
    arrival_time: float
    first_token_time: float
    slot: int  # the runtime's slot (== index in the running batch)
    censored: list[Censored] = field(default_factory=list)
    stops: frozenset[int] = frozenset()  # the engine's EOS ids + the request's stop ids
    counts: OutputCounts | None = None  # output token counts (penalized requests only)
    rec: int = -1  # the request's index in the run's StepRecordBuilder (register)
    # the first token while it is still on its way from the device (``output`` is empty and
    # ``anchor`` unset until :func:`~dspark_obs.engine.step.land_first_tokens` books it)
    first: tuple[FirstTokens, int] | None = None

    def masked_rows(self, rows: int) -> int:
        """How many of the next ``rows`` output positions still fall under
        ``min_new_tokens`` (row j produces output token ``len(output) + j``)."""
        return max(0, min(rows, self.req.min_new_tokens - len(self.output)))

    def stops_at(self, token: int) -> bool:
        """Whether committing ``token`` finishes the request (SGLang: ``ignore_eos`` turns
        every stop id off, the request's own included)."""
        return token in self.stops and not self.req.ignore_eos

    @property
    def greedy(self) -> bool:
        return self.req.temperature < SAMPLING_EPS


def mask_stops(logits: torch.Tensor, rows: int, stops: frozenset[int]) -> torch.Tensor:
    """``logits`` with the stop ids of its first ``rows`` rows set to ``MASKED_LOGIT`` (a copy:
    batched step outputs are static buffers). Applied to the target rows before acceptance,
    so greedy verification and rejection sampling both stay exact for the masked target."""
    if rows <= 0 or not stops:
        return logits
    out = logits.clone()
    ids = torch.tensor(sorted(stops), device=logits.device)
    out[:rows, ids] = MASKED_LOGIT
    return out


def sglang_adjusts_logits(running: Sequence[Live]) -> bool:
    """Whether SGLang 0.5.23 would call this batch's verify logits adjusted (its
    ``verify_logits_adjustments_are_noop`` is False): some request has a penalty or
    ``min_new_tokens`` (a penalizer is required); its estimator recorder then skips the step."""
    return any(r.counts is not None or r.req.min_new_tokens > 0 for r in running)
