"""A whole-block verify: every running request's anchor and all ``gamma`` drafts, launched
without reading the drafts on the host.

Why it exists: a step that verifies every block (``static``, and ``compact`` / ``cap-accept``
whenever the budget, which reads lagged survival only, covers every draft) needs no host value
between drafting and verifying. The pack's layout follows from the committed lengths alone and
its tokens are gathered on the device from the draft outputs, so the device runs draft and
verify back to back, and the step's single device-to-host copy (:meth:`BlockVerified.fetch`)
carries what the host needs afterwards: drafts, confidences, draft log q and the target's
argmax. The per-request windows are still planned on the host, from that copy; the extra rows
of a window cut by the survival floor were computed like tier padding and are never committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["BlockHost", "BlockVerified", "LogitRows", "block_summary"]


@dataclass
class BlockHost:
    """The host copy of a whole-block verify (row i = slot i)."""

    drafts: np.ndarray  # [B, gamma] int64
    confidence: np.ndarray  # [B, gamma] float32
    logprobs: np.ndarray  # [B, gamma] float32: log q of each draft
    argmax: np.ndarray  # [B, gamma + 1] int64: the target's argmax per verified row


def block_summary(tokens: Tensor, confidence: Tensor, logprobs: Tensor, argmax: Tensor) -> Tensor:
    """One float32 tensor [B, 4 * gamma + 1] holding what :class:`BlockHost` reads (token ids
    below 2 ** 24 are exact in float32: SmolLM2's vocabulary is 49,152)."""
    bs = tokens.shape[0]
    parts = (tokens, confidence, logprobs, argmax.reshape(bs, -1))
    return torch.cat([p.float() for p in parts], dim=1)


@dataclass
class BlockVerified:
    """One whole-block verify, launched (nothing read back yet).

    ``logits``: per request its ``gamma + 1`` float rows (a ``[B, gamma + 1, V]`` device
    tensor, valid until the runtime's next verify, or a list). ``summary``: see
    :func:`block_summary`."""

    logits: Tensor | Sequence[Tensor]
    summary: Tensor
    gamma: int

    def fetch(self) -> BlockHost:
        """The step's one device-to-host copy (waits for the device)."""
        host = self.summary.cpu().numpy()
        g = self.gamma
        return BlockHost(
            drafts=host[:, :g].astype(np.int64),
            confidence=np.ascontiguousarray(host[:, g : 2 * g]),
            logprobs=np.ascontiguousarray(host[:, 2 * g : 3 * g]),
            argmax=host[:, 3 * g :].astype(np.int64),
        )

    def rows(self, send: np.ndarray) -> LogitRows:
        """Per request the logits rows its window verified (the first ``send[i]``)."""
        return LogitRows(self.logits, send)


class LogitRows(Sequence[Tensor]):
    """``logits[i][: send[i]]`` for each request, sliced only when a row is read (most steps
    read none: only requests with censored blocks, or penalties, need their rows)."""

    def __init__(self, logits: Tensor | Sequence[Tensor], send: np.ndarray) -> None:
        self._logits = logits
        self._send = send

    def __len__(self) -> int:
        return len(self._send)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._logits[i][: int(self._send[i])]
