"""The reference runtime: one KV cache and one drafter context per request, attention run per
request in every layer. The readable model of the algorithm (and the faster one on a CPU at
small batches); :class:`~dspark_obs.engine.batched.BatchedRuntime` must agree with it.

It implements :class:`~dspark_obs.engine.runtime.Runtime`. The drafter's context of a request
is fed the target features of committed positions only: a forward keeps the features of the
positions it ran until :meth:`ReferenceRuntime.commit` says how many of them were kept, and
the next :meth:`ReferenceRuntime.draft` appends exactly those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from dspark_obs.engine.block_verify import (
    BlockVerified,
    RowSampling,
    accept_on_device,
    block_plan,
    block_summary,
    plan_windows,
    survival_of,
)
from dspark_obs.engine.device_sampling import accept_sampled_pack, keep_greedy_rows
from dspark_obs.engine.drafter import DraftBlock, Drafter
from dspark_obs.engine.drafter_cache import DrafterCache
from dspark_obs.engine.model import KVCache, Target

__all__ = ["ReferenceRuntime", "ReferenceVerified"]


@dataclass
class ReferenceVerified:
    """One forward's per-request logits rows and their argmax."""

    logits: list[Tensor]
    argmax: list[np.ndarray]

    def split(self) -> tuple[list[Tensor], list[np.ndarray]]:
        return list(self.logits), list(self.argmax)


@dataclass
class _Slot:
    cache: KVCache
    context: DrafterCache | None
    anchor: int = 0
    committed: int = 0  # positions kept at the last commit (or the prefill)
    fresh: list[Tensor] = field(default_factory=list)  # committed features not yet drafted on
    pending: list[Tensor] = field(default_factory=list)  # features of uncommitted positions


class ReferenceRuntime:
    """Per-request caches behind the :class:`~dspark_obs.engine.runtime.Runtime` interface.
    ``drafter=None`` serves plain decoding (no features are kept)."""

    def __init__(self, target: Target, drafter: Drafter | None, *, gamma: int) -> None:
        self.target = target
        self.drafter = drafter
        self.gamma = gamma
        self.busy = False
        self.max_len = 1
        self.hidden_layers = tuple(drafter.hidden_layers) if drafter is not None else ()
        self._slots: list[_Slot | None] = []
        self.used = 0

    def can_launch_ahead(self, batch: int) -> bool:
        """Never: each step's caches are the host's (see BatchedRuntime.can_launch_ahead)."""
        return False

    @property
    def asynchronous(self) -> bool:
        return False

    def reserve(self, max_batch: int, max_len: int) -> None:
        """Caches made from now on hold ``max_len`` positions (clamped to the context)."""
        self.max_len = max(self.max_len, min(max_len, self.target.cfg.max_position))

    def reset(self) -> None:
        self._slots = []
        self.used = 0

    def acquire(self) -> int:
        self.used += 1
        if len(self._slots) < self.used:
            self._slots.append(None)
        return self.used - 1

    def release(self, slot: int) -> int | None:
        last = self.used - 1
        self.used -= 1
        if slot == last:
            self._slots[slot] = None
            return None
        self._slots[slot], self._slots[last] = self._slots[last], None
        return last

    def _slot(self, slot: int) -> _Slot:
        state = self._slots[slot] if 0 <= slot < self.used else None
        if state is None:
            raise RuntimeError(f"slot {slot} holds no request")
        return state

    def length(self, slot: int) -> int:
        return self._slot(slot).cache.length

    def set_anchor(self, slot: int, token: int) -> None:
        self._slot(slot).anchor = int(token)

    def set_first_anchors(self, slots: Sequence[int], tokens: Tensor) -> None:
        for slot, token in zip(slots, tokens.tolist(), strict=True):  # synchronous: no gain
            self.set_anchor(slot, token)

    def commit(self, slot: int, length: int, anchor: int, *, on_device: bool = False) -> None:
        s = self._slot(slot)
        if s.pending:
            s.fresh.append(torch.cat(s.pending)[: length - s.committed])
            s.pending = []
        s.cache.truncate(length)
        s.committed = length
        s.anchor = int(anchor)

    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> Tensor:
        rows = []
        for slot, prompt in zip(slots, prompts, strict=True):
            if self._slots[slot] is not None:
                raise ValueError(f"prefill into a slot that is not empty: {slot}")
            cache = self.target.new_cache(self.max_len)
            out = self.target.prefill(prompt, cache, self.hidden_layers)
            context = self.drafter.new_cache() if self.drafter is not None else None
            state = _Slot(cache, context, committed=len(prompt))
            if self.hidden_layers:
                state.fresh.append(out.hidden[0])
            self._slots[slot] = state
            rows.append(out.logits[0][-1])
        return torch.stack(rows)

    def draft(
        self, temps: Sequence[float], generators: Sequence[torch.Generator | None] | None = None
    ) -> DraftBlock:
        assert self.drafter is not None
        states = [self._slot(i) for i in range(len(temps))]
        fresh = [torch.cat(s.fresh) if s.fresh else None for s in states]
        for s in states:
            s.fresh = []
        contexts = [s.context for s in states]
        return self.drafter.draft_batch(
            contexts,  # type: ignore[arg-type]
            [s.anchor for s in states],
            self.gamma,
            list(temps),
            list(generators) if generators is not None else None,
            fresh,
        )

    def forward(
        self, slots: Sequence[int], tokens: Sequence[Sequence[int]], *, q: int | None = None
    ) -> ReferenceVerified:
        states = [self._slot(s) for s in slots]
        out = self.target.forward(
            [torch.as_tensor(list(t), dtype=torch.long) for t in tokens],
            [s.cache for s in states],
            self.hidden_layers,
        )
        if self.hidden_layers:
            for s, h in zip(states, out.hidden, strict=True):
                s.pending.append(h)
        argmax = [row.argmax(-1).cpu().numpy() for row in out.logits]
        return ReferenceVerified(list(out.logits), argmax)

    def verify_block(
        self,
        block: DraftBlock,
        floor: float | None = None,
        budget: int | None = None,
        *,
        windows_only: bool = False,
        rest: bool = False,
        sampling: RowSampling | None = None,
    ) -> BlockVerified:
        """Verify the anchor and the drafts of slots ``0..B-1`` (one :meth:`forward`; ``rest``:
        a second one for the drafts past the windows, cap-accept's): the windows, the pack
        (``windows_only``: the windows only) and the acceptance it reports are the batched
        runtime's rules, but the caches move only when the host commits (this runtime never
        launches a step ahead); ``sampling``'s rows of temperature > 0 are accepted by the
        batched runtime's rejection sampling too."""
        if rest and not windows_only:
            raise ValueError("rest verifies the drafts past the windows: it needs windows_only")
        if rest and sampling is not None:
            raise ValueError("rest counts greedy drafts only: sampled rows take the split step")
        batch, gamma = block.tokens.shape
        tokens, conf = block.tokens.cpu(), block.confidence.cpu()
        survival = survival_of(conf)
        plan = torch.from_numpy(block_plan(batch, gamma, floor, budget, windows_only))
        window = plan_windows(survival, plan)
        drafts = tokens.tolist()
        sent = window.tolist() if windows_only else [gamma + 1] * batch
        rows = [[self._slot(i).anchor, *drafts[i][: sent[i] - 1]] for i in range(batch)]
        out = self.forward(range(batch), rows)
        argmax = torch.full((batch, gamma + 1), -1, dtype=torch.long)
        for i, pred in enumerate(out.argmax):
            argmax[i, : len(pred)] = torch.from_numpy(pred)
        short = [i for i in range(batch) if sent[i] <= gamma] if rest else []
        if short:
            tails = [drafts[i][sent[i] - 1 :] for i in short]
            for i, pred in zip(short, self.forward(short, tails).argmax, strict=True):
                argmax[i, sent[i] :] = torch.from_numpy(pred)
        keep, token, full = accept_on_device(tokens, argmax, window)
        if sampling is not None:
            keep, full, token = _sampled(sampling, block, out.logits, argmax, window, keep, full,
                                         token)  # fmt: skip
        summary = block_summary(
            tokens, conf, block.logprobs.cpu(), survival, argmax, keep, window, full, token
        )
        return BlockVerified(out.logits, summary, gamma, windows_only=windows_only, rest=rest)


def _sampled(
    sampling: RowSampling,
    block: DraftBlock,
    logits: Sequence[Tensor],
    argmax: Tensor,
    window: Tensor,
    keep: Tensor,
    full: Tensor,
    token: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(keep, full, token)`` with the rows of temperature > 0 accepted by rejection sampling
    (:func:`~dspark_obs.engine.device_sampling.accept_sampled_pack` over the rows' logits,
    request after request); greedy rows keep the greedy rule's."""
    q = argmax.shape[1]
    sent = torch.tensor([rows.shape[0] for rows in logits])
    cell = torch.cat([r * q + torch.arange(int(n)) for r, n in enumerate(sent.tolist())])
    temps = torch.from_numpy(sampling.temperature)
    sampled = accept_sampled_pack(
        torch.cat([rows.detach().cpu() for rows in logits]), cell, temps,
        torch.from_numpy(sampling.top_p), torch.from_numpy(sampling.top_k), block.tokens.cpu(),
        block.probs.cpu(), torch.from_numpy(sampling.coins), sent, window,
        use_top_k=sampling.uses_top_k, use_top_p=sampling.uses_top_p,
    )  # fmt: skip
    keep, full, token = keep_greedy_rows(temps, (keep, full, token), sampled)
    return keep, full, token
