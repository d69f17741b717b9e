"""A whole-block verify: every running request's anchor and all ``gamma`` drafts, launched
without reading the drafts on the host.

Why it exists: a step that verifies every block (``static``, and ``compact`` / ``cap-accept``
whenever the budget, which reads lagged survival only, covers every draft) needs no host value
between drafting and verifying. The pack's layout follows from the committed lengths alone and
its tokens are gathered on the device from the draft outputs, so the device runs draft and
verify back to back and accepts greedily (:func:`accept_on_device`), and the step's single
device-to-host copy (:meth:`BlockVerified.fetch`) carries what the host needs afterwards:
drafts, confidences, draft log q, survival, the target's argmax and the device's acceptance.
The per-request windows are allocated on the device too (:func:`windows_on_device`: the
scheduler's top-``b`` rule on the live survival, with the batch budget ``b`` the host decided
from lagged survival before the step), so a ``compact`` step whose budget trims packs only its
windows (:func:`window_pack`) and still needs no host value before its verify. The host plans
the windows again from the copy and checks both the windows and the acceptance against its own
rules; rows verified past a window (``static`` and ``cap-accept`` send whole blocks) were
computed like tier padding and are never committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dspark_obs.engine.host_copy import rows_event, upload

__all__ = [
    "BlockHost",
    "BlockVerified",
    "LogitRows",
    "RowSampling",
    "accept_on_device",
    "block_plan",
    "block_summary",
    "grid_argmax",
    "summary_columns",
    "summary_width",
    "plan_windows",
    "survival_of",
    "window_pack",
    "windows_on_device",
]


@dataclass
class BlockHost:
    """The host copy of a whole-block verify (row i = slot i)."""

    drafts: np.ndarray  # [B, gamma] int64
    confidence: np.ndarray  # [B, gamma] float32
    logprobs: np.ndarray  # [B, gamma] float32: log q of each draft
    survival: np.ndarray  # [B, gamma] float32: cumulative product of the confidences
    argmax: np.ndarray  # [B, gamma + 1] int64: the target's argmax per row (-1: not verified)
    keep: np.ndarray  # [B] int64: drafts the device accepted (see accept_on_device)
    window: np.ndarray  # [B] int64: the device's verify_len per row (see windows_on_device)
    full: np.ndarray  # [B] int64: drafts accepted over every verified one, before the window
    token: np.ndarray  # [B] int64: the token committed after the kept drafts

    def rows(self, index: np.ndarray) -> BlockHost:
        """These rows only (requests still running when the step is read)."""
        return BlockHost(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


@dataclass
class RowSampling:
    """The sampled rows of a whole-block verify (row i = slot i; greedy rows have
    temperature 0 and are accepted by the greedy rule): each row's sampler and the
    ``gamma + 1`` uniforms its acceptance consumes (:func:`~dspark_obs.engine.acceptance.
    draw_uniforms`, drawn on the host from the request's generator when the step launches:
    the same stream, in the same order, as the split step draws them)."""

    temperature: np.ndarray  # [B] float64 (the request's own values: the host's arithmetic)
    top_p: np.ndarray  # [B] float64
    top_k: np.ndarray  # [B] int64 (-1: off)
    coins: np.ndarray  # [B, gamma + 1] float64 (greedy rows: unused)

    @property
    def uses_top_k(self) -> bool:
        """Whether a row keeps its top k only (that sort runs only then)."""
        return bool((self.top_k != -1).any())

    @property
    def uses_top_p(self) -> bool:
        """Whether a row keeps a nucleus only (that sort runs only then)."""
        return bool((self.top_p != 1.0).any())

    @property
    def filters(self) -> int:
        """The filters some row uses, as one number (top-k 2, top-p 1): a graph key part."""
        return 2 * self.uses_top_k + self.uses_top_p


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


def block_plan(
    batch: int, gamma: int, floor: float | None, budget: int | None, windows_only: bool
) -> np.ndarray:
    """A whole-block step's plan as the float32 vector the device reads (:func:`plan_windows`):
    live rows, budget (drafts verified in all, clamped to ``0..batch * gamma``; None: every
    one), survival floor (-1: none, every survival clears it), windows only (1) or whole
    blocks (0). Values below 2 ** 24 are exact in float32."""
    full = batch * gamma
    budget = full if budget is None else max(0, min(int(budget), full))
    return np.array(
        [batch, budget, -1.0 if floor is None else float(floor), float(windows_only)],
        dtype=np.float32,
    )


def plan_windows(survival: Tensor, plan: Tensor) -> Tensor:
    """:func:`windows_on_device` under a :func:`block_plan` (on the plan's device)."""
    return windows_on_device(survival, plan[1:2].long(), plan[2:3], plan[0:1].long())


def windows_on_device(survival: Tensor, budget: Tensor, floor: Tensor, live: Tensor) -> Tensor:
    """``verify_len`` per row (anchor included) on the device, graph-safe:
    :func:`~dspark_obs.engine.scheduler.allocate` for rows ``< live``, whose drafts are
    candidates where their survival reaches ``floor``, ``budget`` of them taken by (higher
    survival, lower position, lower row); rows from ``live`` on (tier padding, or requests
    not running) get 0. ``budget``, ``floor`` and ``live`` are one-element tensors.

    The ranking is a stable descending sort of the survivals laid out position-major (index
    ``j * B + r``), so equal values keep (lower position, lower row) order, as the host's
    lexsort ranks them."""
    rows, gamma = survival.shape
    alive = torch.arange(rows, device=survival.device) < live
    cand = (alive[:, None] & (survival >= floor)).t().reshape(-1)
    vals = torch.where(cand, survival.t().reshape(-1), float("-inf"))
    order = torch.sort(vals, descending=True, stable=True).indices
    places = torch.arange(order.numel(), device=order.device)
    rank = torch.empty_like(order).scatter_(0, order, places)
    counts = ((rank < budget) & cand).view(gamma, rows).sum(dim=0)
    return torch.where(alive, counts + 1, 0)


def window_pack(
    send: Tensor,
    start: Tensor,
    anchors: Tensor,
    drafts: Tensor,
    rows: int,
    trash: int,
    first: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(tokens, slot, pos, qidx)`` of a pack of ``rows`` rows holding, for each grid row
    ``r``, ``send[r]`` tokens of its block (the anchor, then its drafts) from column
    ``first[r]`` on (default 0) into slot ``r`` at positions ``start[r] + j`` (grid cell
    ``r * q + j`` for column ``j``); rows past ``sum(send)`` are padding into the scratch slot
    ``trash`` (:meth:`Pack.layout`'s arrays, built on the device from lengths the host does
    not know). ``first``: cap-accept's drafts past the windows, verified over the windows'
    K/V (:meth:`~dspark_obs.engine.batched.BatchedRuntime.verify_block`'s ``rest``)."""
    batch, q = drafts.shape[0], drafts.shape[1] + 1
    ends = send.cumsum(0)
    i = torch.arange(rows, device=send.device)
    owner = torch.searchsorted(ends, i, right=True).clamp(max=batch - 1)
    j = i - (ends - send)[owner]
    if first is not None:
        j = j + first[owner]
    j = j.clamp(0, q - 1)
    real = i < ends[-1]
    grid = torch.cat([anchors[:, None], drafts], dim=1)
    tokens = torch.where(real, grid[owner, j], 0)
    slot = torch.where(real, owner, trash)
    pos = torch.where(real, start[owner] + j, 0)
    qidx = torch.where(real, owner * q + j, batch * q)
    return tokens, slot, pos, qidx


def grid_argmax(logits: Tensor, qidx: Tensor, rows: int, q: int) -> Tensor:
    """The target's argmax of a pack's rows laid out on its ``[rows, q]`` grid (pack row
    ``n`` at cell ``qidx[n]``; padding rows at ``rows * q`` fall off), -1 where no row was
    verified."""
    grid = torch.full((rows * q + 1,), -1, dtype=torch.long, device=logits.device)
    return grid.scatter_(0, qidx, logits.argmax(-1))[: rows * q].view(rows, q)


def accept_on_device(
    drafts: Tensor, argmax: Tensor, window: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy acceptance of a whole-block verify on the device: ``(keep, bonus, full)`` per
    row, the leading drafts equal to the target's argmax (``full``; unverified cells hold
    -1, which no draft equals), capped to ``window - 1`` (the row's ``verify_len``; a row
    with window 0 keeps 0), and the target's token after them. The same rule as
    :func:`~dspark_obs.engine.acceptance.greedy_accept_batch` on the host, which checks it
    (the host reads ``keep`` back)."""
    gamma = drafts.shape[1]
    full = (drafts == argmax[:, :gamma]).long().cumprod(dim=1).sum(dim=1)
    keep = torch.minimum(full, (window - 1).clamp(min=0))
    return keep, argmax.gather(1, keep[:, None])[:, 0], full


def summary_columns(gamma: int) -> dict[str, slice]:
    """Where each of :class:`BlockHost`'s fields sits in a :func:`block_summary` (one layout
    for the device code that writes or rewrites it and the host code that reads it)."""
    widths = {
        "drafts": gamma, "confidence": gamma, "logprobs": gamma, "survival": gamma,
        "argmax": gamma + 1, "keep": 1, "window": 1, "full": 1, "token": 1,
    }  # fmt: skip
    out, at = {}, 0
    for name, width in widths.items():
        out[name], at = slice(at, at + width), at + width
    return out


def summary_width(gamma: int) -> int:
    """Columns of a :func:`block_summary`."""
    return summary_columns(gamma)["token"].stop


def block_summary(
    tokens: Tensor,
    confidence: Tensor,
    logprobs: Tensor,
    survival: Tensor,
    argmax: Tensor,
    keep: Tensor,
    window: Tensor,
    full: Tensor,
    token: Tensor,
) -> Tensor:
    """One float32 tensor [B, :func:`summary_width`] holding what :class:`BlockHost` reads
    (token ids below 2 ** 24 are exact in float32: SmolLM2's vocabulary is 49,152)."""
    bs = tokens.shape[0]
    parts = (
        tokens, confidence, logprobs, survival, argmax.reshape(bs, -1), keep[:, None],
        window[:, None], full[:, None], token[:, None],
    )  # fmt: skip
    return torch.cat([p.float() for p in parts], dim=1)


@dataclass
class BlockVerified:
    """One whole-block verify, launched (nothing read back yet).

    ``logits``: the verified rows, a list per request, or the pack's rows (a ``[N, V]``
    device tensor in the model's dtype, valid until the runtime's next verify unless
    :meth:`keep_logits` copied it), row ``r``'s at ``offsets[r]`` on, ``sent[r]`` of them
    (``sent``: the device windows when ``windows_only``, else ``gamma + 1`` each, known after
    :meth:`fetch`); :meth:`rows` reads them in float32. ``summary``: see
    :func:`block_summary`; ``copy``: its host copy, when the runtime started it
    asynchronously (``ready`` is then the event it is complete at)."""

    logits: Tensor | Sequence[Tensor]
    summary: Tensor
    gamma: int
    copy: Tensor | None = None
    ready: torch.cuda.Event | None = None
    windows_only: bool = False
    offsets: np.ndarray | None = None
    counts_into: Any = None
    """A windows-only pack's target (its ``tokens_processed`` gains the windows' tokens at
    :meth:`fetch`: the runtime does not know them when it launches)."""
    kept: torch.cuda.Event | None = None
    """Where :meth:`keep_logits`' copy is complete (CUDA)."""
    rest: bool = False
    """The drafts past the windows were verified too, in a second forward (cap-accept):
    their argmax is in the summary, their logits are not kept (``logits`` holds the windows'
    rows only)."""

    @property
    def logits_ready(self) -> torch.cuda.Event | None:
        """The event the logits rows are final at on the device (None off CUDA): what a
        record's read of them waits for (:func:`~dspark_obs.engine.host_copy.read_after`),
        rather than every step launched after this one."""
        return self.kept if self.kept is not None else self.ready

    def keep_logits(self) -> None:
        """Copy the logits out of the runtime's buffer (the next verify may reuse it), for a
        step read after the next one was launched."""
        if isinstance(self.logits, Tensor):
            self.logits = self.logits.clone()
            self.kept = rows_event(self.logits.device) if self.ready is not None else None

    def fetch(self) -> BlockHost:
        """The step's one device-to-host copy (waits for this step's work only)."""
        if self.copy is not None and self.ready is not None:
            self.ready.synchronize()
            host = self.copy.numpy()
        else:
            host = self.summary.cpu().numpy()
        g = self.gamma
        cols = summary_columns(g)

        def ints(name: str) -> np.ndarray:
            return host[:, cols[name]].astype(np.int64)

        def floats(name: str) -> np.ndarray:
            return np.ascontiguousarray(host[:, cols[name]])

        out = BlockHost(
            drafts=ints("drafts"), confidence=floats("confidence"), logprobs=floats("logprobs"),
            survival=floats("survival"), argmax=ints("argmax"), keep=ints("keep")[:, 0],
            window=ints("window")[:, 0], full=ints("full")[:, 0], token=ints("token")[:, 0],
        )  # fmt: skip
        if isinstance(self.logits, Tensor):
            sent = out.window if self.windows_only else np.full(len(out.window), g + 1)
            self.offsets = np.cumsum(sent) - sent
        if self.counts_into is not None:
            sent = len(out.window) * (g + 1) if self.rest else int(out.window.sum())
            self.counts_into.tokens_processed += sent
            self.counts_into = None
        return out

    def rows(self, send: np.ndarray, index: np.ndarray | None = None) -> LogitRows:
        """Per request the logits rows its window verified (the first ``send[i]``) of rows
        ``index`` (default: every row); after :meth:`fetch`."""
        return LogitRows(self.logits, send, index, self.offsets)


class LogitRows(Sequence[Tensor]):
    """``logits[index[i]][: send[i]]`` for each request in float32, sliced (and upcast) only
    when a row is read (most steps read none: only requests with censored blocks, or
    penalties, need their rows)."""

    def __init__(
        self,
        logits: Tensor | Sequence[Tensor],
        send: np.ndarray,
        index: np.ndarray | None,
        offsets: np.ndarray | None = None,
    ) -> None:
        """``offsets``: where each row's rows start in ``logits`` (a pack's rows [N, V]); None:
        ``logits[row]`` holds the row's rows."""
        self._logits = logits
        self._send = send
        self._index = np.arange(len(send)) if index is None else index
        self._offsets = offsets

    def __len__(self) -> int:
        return len(self._send)

    def count(self, i: int) -> int:
        """How many rows item ``i`` has (without slicing them)."""
        return int(self._send[i])

    def stacked(self, items: Sequence[int]) -> Tensor:
        """The rows of ``items``, one item after another, in float32: one gather where they
        sit in a pack (``offsets``), else one slice per item."""
        if self._offsets is None or not isinstance(self._logits, Tensor):
            return torch.cat([self[i] for i in items])
        at = np.asarray(items, dtype=np.int64)
        starts, n = self._offsets[self._index[at]], self._send[at].astype(np.int64)
        idx = np.repeat(starts - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
        return self._logits[upload(idx, self._logits.device)].float()

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row, n = int(self._index[i]), int(self._send[i])
        if self._offsets is None:
            return self._logits[row][:n].float()
        at = int(self._offsets[row])
        return self._logits[at : at + n].float()
