"""The batched runtime's whole-block verify: a decode step's verify, acceptance and summary
launched without a host value between drafting and verifying.

Apart from :mod:`dspark_obs.engine.batched` (slots, packed forwards, prefill, drafting)
because it is the device step, not the runtime's bookkeeping: :class:`BlockSteps` builds
the windows, the pack, the acceptance (greedy, or rejection sampling of sampled rows) and the
one summary the host reads back, as graph-safe functions the runtime replays under CUDA
graphs (:mod:`~dspark_obs.engine.block_verify` holds the rules they are made of). It is a
mixin of :class:`~dspark_obs.engine.batched.BatchedRuntime` and uses its pool, its device
lengths and anchors (``_dlen``, ``_danchor``, ``_ahead_by``), its graph banks and its packed
forward (``_states``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dspark_obs.engine.block_verify import (
    BlockVerified,
    RowSampling,
    accept_on_device,
    block_plan,
    block_summary,
    grid_argmax,
    plan_windows,
    summary_columns,
    survival_of,
    window_pack,
)
from dspark_obs.engine.device_sampling import accept_sampled_pack, keep_greedy_rows
from dspark_obs.engine.drafter import DraftBlock
from dspark_obs.engine.host_copy import upload

__all__ = ["BlockSteps"]


class BlockSteps:
    """Whole-block verifies of :class:`~dspark_obs.engine.batched.BatchedRuntime` (a mixin:
    every attribute it reads is the runtime's)."""

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
        """Verify the anchor and the drafts of slots ``0..B-1`` (B = the block's rows) and
        accept greedily, all on the device and under graphs in one replay (:meth:`_block_fn`):
        the windows are allocated from the live survival (``budget`` drafts in all, the
        top-``b`` rule, candidates from ``floor`` up; None: every candidate), the pack's
        positions come from the device lengths, its tokens from the device anchors and the
        drafts (see :mod:`~dspark_obs.engine.block_verify`); ``windows_only`` sends only the windows
        (``B + budget`` tokens at most), else every block. The acceptance (within the windows)
        advances the device lengths and anchors, so the next draft can launch before the host
        reads this one. The host commits each row with ``commit(..., on_device=True)``. The
        target runs the forward :meth:`forward` runs, so the numbers are the same too; its
        logits stay in the model's dtype (the argmax of the same values;
        :meth:`BlockVerified.rows` reads them in float32).

        ``rest`` (with ``windows_only``; cap-accept): a second replay (:meth:`_rest_fn`)
        verifies each row's drafts past its window over the windows' K/V, for the argmax
        only. The first replay is the one a compact step runs, so what is committed is
        bitwise compact's. Its pack holds ``B * gamma - budget`` rows when every draft is a
        candidate, else ``B * gamma`` (the host does not know how many the floor cut).

        ``sampling``: its sampled rows are accepted by lossless rejection sampling in the same
        replay (:meth:`_sampled_block_fn`; graphs keyed by the filters the rows use,
        :attr:`RowSampling.filters`, captured when first used), greedy rows by the greedy
        rule."""
        batch, gamma = block.tokens.shape
        q = gamma + 1
        if rest and not windows_only:
            raise ValueError("rest verifies the drafts past the windows: it needs windows_only")
        if rest and sampling is not None:
            raise ValueError("rest counts greedy drafts only: sampled rows take the split step")
        plan = block_plan(batch, gamma, floor, budget, windows_only)
        n = batch + int(plan[1]) if windows_only else batch * q
        self._flush()
        end = self._longest(batch) + q
        if end > self.pool.max_len:
            raise RuntimeError(f"slot pool holds {self.pool.max_len} positions, step needs {end}")
        bt, nt, graphed = self._tiers(batch, n)
        span = self._span(end)
        inputs = {
            "drafts": block.tokens,
            "conf": block.confidence,
            "logprobs": block.logprobs,
            "start": self._dlen[:bt],
            "anchors": self._danchor[:bt],
            "plan": self._plan(plan),
            "rows": torch.empty(nt, device=self.device),  # shape carriers (graph key parts)
            "q": torch.empty(q, device=self.device),
            "span": torch.empty(span, device=self.device),
        }
        key: tuple = (q, bt, nt, span)
        bank, fn = "block", self._block_fn
        if sampling is not None:
            inputs.update(self._sampling_inputs(sampling, block, bt))
            key, bank, fn = (*key, sampling.filters), "sampled", self._sampled_block_fn
        bank = bank if graphed else "eager"
        if graphed and key not in self._banks[bank]:  # captured at bt rows
            for name in ("drafts", "conf", "logprobs", "dprobs"):
                if name in inputs:
                    pad = (0, 0) * (inputs[name].dim() - 1) + (0, bt - batch)
                    inputs[name] = F.pad(inputs[name], pad)
        logits, summary, new_len, bonus = self._run(bank, key, fn, inputs)
        rest_n = batch * gamma - (int(plan[1]) if floor is None else 0)
        if rest and rest_n > 0:
            summary = self._verify_rest(inputs, summary, bt, batch, rest_n)
        self._dlen[:batch].copy_(new_len[:batch])
        self._danchor[:batch].copy_(bonus[:batch])
        self._ahead_by[:batch] += 1
        if not windows_only:  # a windows-only pack's tokens are counted when read
            self.target.tokens_processed += n
        summary = summary[:batch]
        copy = ready = None
        if self.asynchronous:  # started now; fetch() waits for this step only
            copy = torch.empty(summary.shape, dtype=summary.dtype, pin_memory=True)
            copy.copy_(summary, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return BlockVerified(
            logits[:n], summary, gamma, copy, ready, windows_only=windows_only,
            counts_into=self.target if windows_only else None, rest=rest,
        )  # fmt: skip

    def _sampling_inputs(self, sampling: RowSampling, block: DraftBlock, bt: int) -> dict:
        """:meth:`_sampled_block_fn`'s extra inputs, padded to ``bt`` greedy rows."""
        batch = len(sampling.temperature)
        temps = np.zeros(bt, dtype=np.float64)
        top_p = np.ones(bt, dtype=np.float64)
        top_k = np.full(bt, -1, dtype=np.int64)
        coins = np.zeros((bt, self.gamma + 1), dtype=np.float64)
        temps[:batch], top_p[:batch], top_k[:batch] = (
            sampling.temperature, sampling.top_p, sampling.top_k
        )  # fmt: skip
        coins[:batch] = sampling.coins
        return {
            "temps": upload(temps, self.device),
            "top_p": upload(top_p, self.device),
            "top_k": upload(top_k, self.device),
            "coins": upload(coins, self.device),
            "dprobs": block.probs,
            "filters": torch.empty(sampling.filters, device=self.device),  # a key part
        }

    def _verify_rest(
        self, block_inputs: dict[str, Tensor], summary: Tensor, bt: int, batch: int, n: int
    ) -> Tensor:
        """:meth:`_rest_fn` over a whole-block verify's inputs (before its lengths advance):
        the summary with the argmax of the drafts past the windows filled in."""
        _, nt, graphed = self._tiers(batch, n)
        q, span = block_inputs["q"], block_inputs["span"]
        key = (q.shape[0], bt, nt, span.shape[0])
        drafts = block_inputs["drafts"]
        if graphed and key not in self._banks["rest"]:  # captured at bt rows
            drafts = F.pad(drafts, (0, 0, 0, bt - drafts.shape[0]))
        inputs = {
            "drafts": drafts,
            "start": block_inputs["start"],
            "anchors": block_inputs["anchors"],
            "summary": summary,  # the block function's, bt rows
            "rows": torch.empty(nt, device=self.device),
            "q": q,
            "span": span,
        }
        bank = "rest" if graphed else "eager"
        return self._run(bank, key, self._rest_fn, inputs)[0]

    def _block_fn(
        self,
        drafts: Tensor,
        conf: Tensor,
        logprobs: Tensor,
        start: Tensor,
        anchors: Tensor,
        plan: Tensor,
        rows: Tensor,
        q: Tensor,
        span: Tensor,
    ) -> tuple[Tensor, ...]:
        """:meth:`_block` with every row greedy."""
        return self._block(drafts, conf, logprobs, start, anchors, plan, rows, q, span)

    def _sampled_block_fn(
        self,
        drafts: Tensor,
        conf: Tensor,
        logprobs: Tensor,
        start: Tensor,
        anchors: Tensor,
        plan: Tensor,
        rows: Tensor,
        q: Tensor,
        span: Tensor,
        temps: Tensor,
        top_p: Tensor,
        top_k: Tensor,
        coins: Tensor,
        dprobs: Tensor,
        filters: Tensor,
    ) -> tuple[Tensor, ...]:
        """:meth:`_block` with rows of temperature > 0 accepted by rejection sampling
        (``filters``: a shape carrier, :attr:`RowSampling.filters` long)."""
        sampling = (temps, top_p, top_k, coins, dprobs, filters.shape[0])
        return self._block(drafts, conf, logprobs, start, anchors, plan, rows, q, span, sampling)

    def _block(
        self,
        drafts: Tensor,
        conf: Tensor,
        logprobs: Tensor,
        start: Tensor,
        anchors: Tensor,
        plan: Tensor,
        rows: Tensor,
        q: Tensor,
        span: Tensor,
        sampling: tuple | None = None,
    ) -> tuple[Tensor, ...]:
        """A whole-block verify of the ``bt`` grid rows (graph-safe): the windows
        (:func:`windows_on_device`; ``plan`` = live rows, budget, floor, windows only), the pack of
        ``rows`` rows (:func:`window_pack`: each live row's window, or its whole block; grid
        row r is slot r; rows past the real ones are padding into the scratch slot), the
        target forward, the acceptance (greedy; ``sampling``: rejection sampling of the rows
        of temperature > 0 from their logits laid out on the grid) and the host summary.
        Returns logits, summary, the new lengths and anchors."""
        bt, nq = start.shape[0], q.shape[0]
        survival = survival_of(conf)
        window = plan_windows(survival, plan)
        whole = torch.where(torch.arange(bt, device=start.device) < plan[0:1], nq, 0)
        send = torch.where(plan[3:4] > 0, window, whole)
        tokens, slot, pos, qidx = window_pack(
            send, start, anchors, drafts, rows.shape[0], self.pool.trash
        )
        states = self._states(
            tokens=tokens, slot=slot, pos=pos, qidx=qidx, past=start, q=q, span=span
        )
        logits = self.target.lm_head(states)  # the model's dtype: rows are upcast where read
        pred = grid_argmax(logits, qidx, bt, nq)
        keep, token, full = accept_on_device(drafts, pred, window)
        if sampling is not None:
            temps, top_p, top_k, coins, dprobs, filters = sampling
            sampled = accept_sampled_pack(
                logits, qidx, temps, top_p, top_k, drafts, dprobs, coins, send, window,
                use_top_k=bool(filters & 2), use_top_p=bool(filters & 1),
            )  # fmt: skip
            keep, full, token = keep_greedy_rows(temps, (keep, full, token), sampled)
        summary = block_summary(drafts, conf, logprobs, survival, pred, keep, window, full, token)
        return logits, summary, start + keep + 1, token

    def _rest_fn(
        self,
        drafts: Tensor,
        start: Tensor,
        anchors: Tensor,
        summary: Tensor,
        rows: Tensor,
        q: Tensor,
        span: Tensor,
    ) -> tuple[Tensor]:
        """Cap-accept's second forward (graph-safe): each live row's drafts from its window
        on (:func:`window_pack` from column ``window``), at their own positions over the
        K/V the windows' forward wrote; returns the summary with their argmax filled in
        (the acceptance, the windows and the new lengths are the first forward's)."""
        bt, nq = start.shape[0], q.shape[0]
        cols = summary_columns(nq - 1)
        window = summary[:, cols["window"]][:, 0].long()
        send = torch.where(window > 0, nq - window, 0)
        tokens, slot, pos, qidx = window_pack(
            send, start, anchors, drafts, rows.shape[0], self.pool.trash, first=window
        )
        states = self._states(
            tokens=tokens, slot=slot, pos=pos, qidx=qidx, past=start, q=q, span=span
        )
        pred = grid_argmax(self.target.lm_head(states), qidx, bt, nq)
        at = cols["argmax"]
        merged = torch.where(pred >= 0, pred.float(), summary[:, at])
        return (torch.cat([summary[:, : at.start], merged, summary[:, at.stop :]], dim=1),)

    def _plan(self, plan: np.ndarray) -> Tensor:
        """A :func:`block_plan` on the device, kept per value: a steady batch uploads
        nothing."""
        key = plan.tobytes()
        cached = self._plans.get(key)
        if cached is None:
            if len(self._plans) > 256:
                self._plans.clear()
            cached = self._plans[key] = self._device(plan)
        return cached
