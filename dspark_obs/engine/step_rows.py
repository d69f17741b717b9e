"""What a decode step measured (:class:`StepStats`, :class:`StepResult`) as the arrays its
records are built from (:class:`~dspark_obs.engine.step_records.StepArrays`: the ``steps`` row
and one ``req_steps`` row per request with the block-accept estimator's fields, column-wise),
and the ``requests`` row of a finished request.

Apart from the loop because records are their own concern: the loop hands over the step's
numbers once (:class:`StepResult`); with ``overlap`` its arrays are taken (and its censored
blocks resolved) while the device drafts the next step, and the Arrow tables are built on the
run's record worker (:class:`~dspark_obs.engine.step_records.RecordWorker`), off the decode
thread: no per-request row objects.

Estimator fields: a compact step whose window was fully accepted while drafts were trimmed
(``correct_drafts == verify_len - 1 < gamma``) records ``trimmed_tokens`` and their draft
log-probs ``q_lp``; later target rows that cover those positions resolve them into ``pg``
entries ``(src_fct, k, target_logprob, draft_token, realized_token)`` until the first offset
whose realized token differs from the draft (SGLang 0.5.23's JSONL semantics).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import torch

from dspark_obs.engine.block_verify import LogitRows
from dspark_obs.engine.censored import Censored, LogpAt, greedy_logprobs_at, resolve, resolve_block
from dspark_obs.engine.host_copy import read_after, upload
from dspark_obs.engine.live import Live
from dspark_obs.engine.outcome import StepOutcome
from dspark_obs.engine.step_records import PgEntries, StepArrays
from dspark_obs.engine.types import EngineConfig, GenRequest

__all__ = ["Censors", "Logprobs", "StepResult", "StepStats", "request_row", "waiting_row"]

Censors = Callable[[Live, int, int, bool], bool]
"""``(live, correct drafts, verify_len, batch adjusted)`` -> whether this step's trimmed drafts
await resolution (``step.opens_censored``)."""

Logprobs = Callable[[torch.Tensor, Live], torch.Tensor]
"""``(logits rows, live)`` -> log p of the distribution acceptance used (``StepPipeline.
_estimator_logprobs``)."""


@dataclass
class StepStats:
    """One decode step's statistics: the ``steps`` row's numbers, nothing about rows."""

    forward_ct: int
    bs: int
    budget: int
    num_verify_tokens: int
    predicted_step_ms: float | None
    predicted_theta: float | None
    step_cpu_ms: float
    ts: datetime
    draft_gpu_ms: float | None = None
    target_verify_gpu_ms: float | None = None


@dataclass
class StepResult:
    """What one step produced for its rows: row i is ``running[i]`` (slot i)."""

    stats: StepStats
    running: list[Live]
    outcome: StepOutcome
    verify_lens: np.ndarray
    lengths_before: list[int]  # committed positions before the step (anchor included)
    drafts: np.ndarray  # [bs, gamma]
    confidence: np.ndarray  # [bs, gamma]
    survival: np.ndarray  # [bs, gamma]
    draft_logprobs: torch.Tensor  # [bs, gamma], host
    logits: Sequence[torch.Tensor]  # per request: the (penalized, masked) rows acceptance used
    adjusted: bool  # SGLang would call the batch's logits adjusted (see live.sglang_adjusts_logits)
    rows_ready: torch.cuda.Event | None = None  # CUDA: where ``logits`` are final (read_after)

    def arrays(self, cfg: EngineConfig, censors: Censors, logprobs: Logprobs) -> StepArrays:
        """The step as :class:`StepArrays` (the ``steps`` row and one ``req_steps`` row per
        request, column-wise), resolving each request's censored blocks against this step's
        target rows (that updates ``live.censored``). The arrays are the step's own copies:
        the worker that builds the tables may read them after later steps ran.

        Only the requests with censored blocks (open, or opened now) are visited one by one,
        for their estimator entries; every other field is an array of the whole batch."""
        running, outcome, bs = self.running, self.outcome, len(self.running)
        accepted = outcome.accepted
        verify_len = np.array(self.verify_lens, dtype=np.int64)  # a copy
        opens = [censors(live, c, w, self.adjusted)
                 for live, c, w in zip(running, accepted.correct.tolist(), verify_len.tolist(),
                                       strict=True)]  # fmt: skip
        lookups = self._gather_logprobs(opens, logprobs)
        fct, prefix = self.stats.forward_ct, self.lengths_before
        pg_rows: list[int] = []
        pg: list[dict[str, Any]] = []
        for i, live in enumerate(running):
            if not (live.censored or opens[i]):
                continue
            full = outcome.full(i)
            entries, live.censored = resolve(live.censored, lookups[i], full, prefix[i])
            if opens[i]:
                w = int(verify_len[i])
                blk = Censored(fct, prefix[i] + w, w, self.drafts[i, w - 1 :].tolist())
                # The first trimmed draft sits where this step's bonus landed: resolve it now.
                entries.extend(resolve_block(blk, lookups[i], full, prefix[i]))
                if blk.next_k < len(blk.tokens):
                    live.censored.append(blk)
            pg_rows.extend([i] * len(entries))
            pg.extend(entries)
        censored = np.array(opens, dtype=bool)
        s = self.stats
        return StepArrays(
            forward_ct=fct, budget=s.budget, num_verify_tokens=s.num_verify_tokens, ts=s.ts,
            req=np.fromiter((live.rec for live in running), np.int64, bs),
            req_pool_index=np.fromiter((live.slot for live in running), np.int64, bs),
            prefix_len=np.asarray(prefix, dtype=np.int64) + 1,  # tokens known, anchor included
            verify_len=verify_len,
            acc_len=outcome.committed.copy(),
            correct_drafts=accepted.correct.copy(),
            cap_trim=accepted.cap_trim if cfg.mode == "cap-accept" else np.zeros(bs, np.int64),
            bonus_token=accepted.bonus,
            is_last=outcome.finished,
            draft_tokens=np.array(self.drafts, copy=True),
            confidence=np.array(self.confidence, dtype=np.float32, copy=True),
            survival=np.array(self.survival, dtype=np.float32, copy=True),
            censored=censored,
            draft_logprobs=self.draft_logprobs.numpy().astype(np.float32, copy=True)
            if censored.any() else None,
            greedy=np.fromiter((live.greedy for live in running), bool, bs),
            pg=PgEntries.from_entries(pg_rows, pg) if pg else None,
            predicted_step_ms=s.predicted_step_ms, predicted_theta=s.predicted_theta,
            step_cpu_ms=s.step_cpu_ms, draft_gpu_ms=s.draft_gpu_ms,
            target_verify_gpu_ms=s.target_verify_gpu_ms,
        )  # fmt: skip

    def _gather_logprobs(self, opens: list[bool], logprobs: Logprobs) -> list[Any]:
        """Per request, log p of the target rows at the columns of the drafts still awaiting
        resolution (None where none await), gathered on the device for every request and
        moved to the host in one transfer, after the step's own ``rows_ready`` only (on a
        side stream: the steps launched since keep the device busy meanwhile).
        ``opens[i]``: request i's step opened a censored block."""
        out: list[Any] = [None] * len(self.running)
        wanted: list[tuple[int, list[int]]] = []
        for i, live in enumerate(self.running):
            if not (live.censored or opens[i]):
                continue
            cols = {int(t) for blk in live.censored for t in blk.tokens[blk.next_k :]}
            if opens[i]:
                w = int(self.verify_lens[i])
                cols.update(int(t) for t in self.drafts[i, w - 1 :])
            wanted.append((i, sorted(cols)))
        if not wanted:
            return out
        logits = self.logits
        greedy = [(i, cols) for i, cols in wanted if self.running[i].greedy]
        sampled = [(i, cols) for i, cols in wanted if not self.running[i].greedy]
        if isinstance(logits, LogitRows):  # a block verify's rows: counted without slicing
            counts = {i: logits.count(i) for i, _ in wanted}
        else:
            counts = {i: logits[i].shape[0] for i, _ in wanted}

        def gather() -> torch.Tensor:  # device work only: read_after may run it on a side stream
            parts = []
            if greedy:
                items, cols = [i for i, _ in greedy], [c for _, c in greedy]
                if isinstance(logits, LogitRows):  # one gather from the pack
                    stacked = logits.stacked(items)
                    parts.append(greedy_logprobs_at(stacked, cols, [counts[i] for i in items]))
                else:
                    parts.append(greedy_logprobs_at([logits[i] for i in items], cols))
            for i, cols in sampled:
                idx = upload(np.asarray(cols, dtype=np.int64), logits[i].device)
                parts.append(logprobs(logits[i], self.running[i])[:, idx].reshape(-1))
            return torch.cat(parts)

        flat = read_after(self.rows_ready, gather)
        at = 0
        for i, cols in greedy + sampled:
            n = counts[i] * len(cols)
            out[i] = LogpAt(flat[at : at + n].reshape(-1, len(cols)), cols)
            at += n
        return out


def _request_fields(req: GenRequest, cfg: EngineConfig, run_id: str) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "rid": req.rid,
        "dp_rank": cfg.dp_rank,
        "workload": req.workload,
        "prompt": req.prompt,
        "prompt_tokens": len(req.prompt_ids),
        "max_new_tokens": req.max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "seed": req.seed,
    }


def request_row(live: Live, cfg: EngineConfig, run_id: str, reason: str) -> dict[str, Any]:
    """The ``requests`` row of a request that finished with ``reason``."""
    return {
        **_request_fields(live.req, cfg, run_id),
        "output_tokens": live.output,
        "completion_tokens": len(live.output),
        "finish_reason": reason,
        "arrival_time": live.arrival_time,
        "first_token_time": live.first_token_time,
        "finish_time": time.time(),
    }


def waiting_row(req: GenRequest, cfg: EngineConfig, run_id: str) -> dict[str, Any]:
    """The ``requests`` row of a request aborted before it was admitted (no tokens)."""
    now = time.time()
    return {
        **_request_fields(req, cfg, run_id),
        "output_tokens": [],
        "completion_tokens": 0,
        "finish_reason": "abort",
        "arrival_time": now,
        "first_token_time": None,
        "finish_time": now,
    }
