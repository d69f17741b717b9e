"""A whole-block verify: every running request's anchor and all ``gamma`` drafts, launched
without reading the drafts on the host.

Why it exists: a step that verifies every block (``static``, and ``compact`` / ``cap-accept``
whenever the budget, which reads lagged survival only, covers every draft) needs no host value
between drafting and verifying. The pack's layout follows from the committed lengths alone and
its tokens are gathered on the device from the draft outputs, so the device runs draft and
verify back to back and accepts greedily (:func:`accept_on_device`), and the step's single
device-to-host copy (:meth:`BlockVerified.fetch`) carries what the host needs afterwards:
drafts, confidences, draft log q, survival, the target's argmax and the device's acceptance.
The host plans the per-request windows from that copy and checks the acceptance against its
own rule; the extra rows of a window cut by the survival floor were computed like tier
padding and are never committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "BlockHost",
    "BlockVerified",
    "LogitRows",
    "accept_on_device",
    "block_summary",
    "survival_of",
]


@dataclass
class BlockHost:
    """The host copy of a whole-block verify (row i = slot i)."""

    drafts: np.ndarray  # [B, gamma] int64
    confidence: np.ndarray  # [B, gamma] float32
    logprobs: np.ndarray  # [B, gamma] float32: log q of each draft
    survival: np.ndarray  # [B, gamma] float32: cumulative product of the confidences
    argmax: np.ndarray  # [B, gamma + 1] int64: the target's argmax per verified row
    keep: np.ndarray  # [B] int64: drafts the device accepted (see accept_on_device)

    def rows(self, index: np.ndarray) -> BlockHost:
        """These rows only (requests still running when the step is read)."""
        return BlockHost(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


def survival_of(confidence: Tensor) -> Tensor:
    """Cumulative products of the confidences along the block, multiplied one position at a
    time in float32: the host's ``np.cumprod`` to the bit (``torch.cumprod`` accumulates in
    double on the CPU), so the host plans its windows from the very values the device's
    acceptance cut at."""
    conf = confidence.float()
    cols = [conf[:, 0]]
    for j in range(1, conf.shape[1]):
        cols.append(cols[-1] * conf[:, j])
    return torch.stack(cols, dim=1)


def accept_on_device(
    drafts: Tensor, argmax: Tensor, survival: Tensor, floor: float | Tensor | None
) -> tuple[Tensor, Tensor]:
    """Greedy acceptance of a whole-block verify on the device: ``(keep, bonus)`` per row,
    the leading drafts equal to the target's argmax, capped to the window a full budget gives
    (``1 +`` the drafts whose survival reaches ``floor``, a number or a one-element tensor;
    every draft when ``floor`` is None), and the target's token after them. The same rule
    as :func:`~dspark_obs.engine.acceptance.greedy_accept_batch` on the host, which checks it
    (the host reads ``keep`` back)."""
    gamma = drafts.shape[1]
    keep = (drafts == argmax[:, :gamma]).long().cumprod(dim=1).sum(dim=1)
    if floor is not None:
        keep = torch.minimum(keep, (survival >= floor).sum(dim=1))
    return keep, argmax.gather(1, keep[:, None])[:, 0]


def block_summary(
    tokens: Tensor,
    confidence: Tensor,
    logprobs: Tensor,
    survival: Tensor,
    argmax: Tensor,
    keep: Tensor,
) -> Tensor:
    """One float32 tensor [B, 5 * gamma + 2] holding what :class:`BlockHost` reads (token ids
    below 2 ** 24 are exact in float32: SmolLM2's vocabulary is 49,152)."""
    bs = tokens.shape[0]
    parts = (tokens, confidence, logprobs, survival, argmax.reshape(bs, -1), keep[:, None])
    return torch.cat([p.float() for p in parts], dim=1)


@dataclass
class BlockVerified:
    """One whole-block verify, launched (nothing read back yet).

    ``logits``: per request its ``gamma + 1`` rows (a ``[B, gamma + 1, V]`` device tensor in
    the model's dtype, valid until the runtime's next verify unless :meth:`keep_logits` copied
    it, or a list); :meth:`rows` reads them in float32. ``summary``: see
    :func:`block_summary`; ``copy``: its host copy, when the runtime started it
    asynchronously (``ready`` is then the event it is complete at)."""

    logits: Tensor | Sequence[Tensor]
    summary: Tensor
    gamma: int
    copy: Tensor | None = None
    ready: torch.cuda.Event | None = None

    def keep_logits(self) -> None:
        """Copy the logits out of the runtime's buffer (the next verify may reuse it), for a
        step read after the next one was launched."""
        if isinstance(self.logits, Tensor):
            self.logits = self.logits.clone()

    def fetch(self) -> BlockHost:
        """The step's one device-to-host copy (waits for this step's work only)."""
        if self.copy is not None and self.ready is not None:
            self.ready.synchronize()
            host = self.copy.numpy()
        else:
            host = self.summary.cpu().numpy()
        g = self.gamma
        return BlockHost(
            drafts=host[:, :g].astype(np.int64),
            confidence=np.ascontiguousarray(host[:, g : 2 * g]),
            logprobs=np.ascontiguousarray(host[:, 2 * g : 3 * g]),
            survival=np.ascontiguousarray(host[:, 3 * g : 4 * g]),
            argmax=host[:, 4 * g : 5 * g + 1].astype(np.int64),
            keep=host[:, 5 * g + 1].astype(np.int64),
        )

    def rows(self, send: np.ndarray, index: np.ndarray | None = None) -> LogitRows:
        """Per request the logits rows its window verified (the first ``send[i]``) of rows
        ``index`` (default: every row)."""
        return LogitRows(self.logits, send, index)


class LogitRows(Sequence[Tensor]):
    """``logits[index[i]][: send[i]]`` for each request in float32, sliced (and upcast) only
    when a row is read (most steps read none: only requests with censored blocks, or
    penalties, need their rows)."""

    def __init__(
        self, logits: Tensor | Sequence[Tensor], send: np.ndarray, index: np.ndarray | None
    ) -> None:
        self._logits = logits
        self._send = send
        self._index = np.arange(len(send)) if index is None else index

    def __len__(self) -> int:
        return len(self._send)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._logits[int(self._index[i])][: int(self._send[i])].float()
