"""Frequency, presence and repetition penalties, as SGLang 0.5.23 applies them, made exact
for speculative verification.

SGLang's penalizers (``sglang/srt/sampling/penaltylib``) count a request's OUTPUT tokens only
(the prompt never counts) and change the raw target logits before temperature, top-k and
top-p. Its overlap scheduler (the default) first adds the additive terms of every penalizer
(``- frequency * count``, ``- presence * [count > 0]``, the min-new-tokens stop mask), then
applies the multiplicative one: a token that occurred has its logit multiplied by
``repetition`` where negative, divided by it otherwise. Ranges are SGLang's
(``SamplingParams.verify``): frequency and presence in [-2, 2], repetition in (0, 2].

In a verify block row ``j`` predicts output token ``len(output) + j``: it sees the counts of
the output so far plus drafts ``1..j`` (all accepted if row ``j`` is ever used), which is
what a one-token-per-step decode would have counted, so acceptance stays lossless against
the penalized target. (SGLang's own DSpark verify gives every row of a block the counts of
the output so far; the engine does not copy that shortcut.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["FREQUENCY_RANGE", "PRESENCE_RANGE", "OutputCounts", "Penalties", "penalty_error"]

FREQUENCY_RANGE = (-2.0, 2.0)
PRESENCE_RANGE = (-2.0, 2.0)
REPETITION_MAX = 2.0


def penalty_error(frequency: float, presence: float, repetition: float) -> str | None:
    """What is wrong with these penalty settings (SGLang's ranges), or None when they are
    valid; the message names the parameter."""
    for name, value, (lo, hi) in (
        ("frequency_penalty", frequency, FREQUENCY_RANGE),
        ("presence_penalty", presence, PRESENCE_RANGE),
    ):
        if not (math.isfinite(value) and lo <= value <= hi):  # also NaN
            return f"{name} must be in [{lo:g}, {hi:g}], got {value}"
    if not (math.isfinite(repetition) and 0.0 < repetition <= REPETITION_MAX):
        return f"repetition_penalty must be in (0, {REPETITION_MAX:g}], got {repetition}"
    return None


@dataclass(frozen=True)
class Penalties:
    """One request's penalty settings (SGLang's defaults: no penalty)."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0

    @property
    def active(self) -> bool:
        return self.frequency != 0.0 or self.presence != 0.0 or self.repetition != 1.0

    def apply(
        self, logits: torch.Tensor, counts: OutputCounts, drafts: Sequence[int]
    ) -> torch.Tensor:
        """``logits`` [R, V] penalized (a new tensor): row ``j`` with the output's token
        ``counts`` plus one for each of ``drafts[:j]``."""
        rows = logits.shape[0]
        seen = counts.per_id.to(logits.dtype).expand(rows, -1).clone()
        if rows > 1:
            ids = torch.as_tensor(list(drafts[: rows - 1]), dtype=torch.long, device=logits.device)
            step = torch.zeros_like(seen)
            step[torch.arange(1, rows, device=logits.device), ids] = 1.0
            seen += step.cumsum(0)
        occurred = seen > 0
        additive = torch.zeros_like(seen)
        if self.frequency != 0.0:
            additive -= self.frequency * seen
        if self.presence != 0.0:
            additive -= self.presence * occurred.to(seen.dtype)
        out = logits + additive
        if self.repetition != 1.0:
            scale = torch.where(occurred, self.repetition, 1.0).to(out.dtype)
            out = torch.where(out < 0, out * scale, out / scale)
        return out


class OutputCounts:
    """How often each vocabulary id occurs in one request's output, kept on the logits'
    device and updated as tokens commit (never rebuilt from the whole output)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.per_id = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    def add(self, tokens: Sequence[int]) -> None:
        if tokens:
            idx = torch.as_tensor(list(tokens), dtype=torch.long, device=self.per_id.device)
            self.per_id.index_add_(0, idx, torch.ones(len(idx), device=self.per_id.device))
