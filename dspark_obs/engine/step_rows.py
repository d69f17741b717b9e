"""What a decode step measured (:class:`StepStats`) and the records built from it: the
``steps`` row, one ``req_steps`` row per request with the block-accept estimator's fields,
and the ``requests`` row of a finished request.

Apart from the loop because building rows is its own concern: the loop hands over the step's
numbers once (:class:`StepResult`) and, with ``overlap``, the rows are built while the
device drafts the next step.

Estimator fields: a compact step whose window was fully accepted while drafts were trimmed
(``correct_drafts == verify_len - 1 < gamma``) records ``trimmed_tokens`` and their draft
log-probs ``q_lp``; later target rows that cover those positions resolve them into ``pg``
entries ``(src_fct, k, target_logprob, draft_token, realized_token)`` until the first offset
whose realized token differs from the draft (SGLang 0.5.23's JSONL semantics).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import torch

from dspark_obs.engine.acceptance import AcceptResult
from dspark_obs.engine.censored import Censored, LogpAt, greedy_logprobs_at, resolve, resolve_block
from dspark_obs.engine.live import Live, Outcome
from dspark_obs.engine.types import EngineConfig, GenRequest

__all__ = ["Censors", "Logprobs", "StepResult", "StepStats", "request_row", "waiting_row"]

Censors = Callable[[Live, AcceptResult, int, bool], bool]
"""``(live, accept result, verify_len, batch adjusted)`` -> whether this step's trimmed drafts
await resolution (``Engine._censors``)."""

Logprobs = Callable[[torch.Tensor, Live], torch.Tensor]
"""``(logits rows, live)`` -> log p of the distribution acceptance used (``Engine.
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

    def row(self, cfg: EngineConfig, run_id: str) -> dict[str, Any]:
        """The ``steps`` row (one DP rank: ``verify_tokens_local`` = the step's tokens)."""
        return {
            "run_id": run_id,
            "dp_rank": cfg.dp_rank,
            "forward_ct": self.forward_ct,
            "source": "engine",
            "mode": cfg.mode,
            "bs": self.bs,
            "budget": self.budget,
            "lag_steps": cfg.lag_steps,
            "num_running_reqs": self.bs,
            "num_verify_tokens": self.num_verify_tokens,
            "verify_tokens_local": self.num_verify_tokens,
            "predicted_step_ms": self.predicted_step_ms,
            "predicted_theta": self.predicted_theta,
            "step_cpu_ms": self.step_cpu_ms,
            "draft_gpu_ms": self.draft_gpu_ms,
            "target_verify_gpu_ms": self.target_verify_gpu_ms,
            "ts": self.ts,
        }


@dataclass
class StepResult:
    """What one step produced for its rows: row i is ``running[i]`` (slot i)."""

    stats: StepStats
    running: list[Live]
    outcomes: list[Outcome]
    verify_lens: np.ndarray
    lengths_before: list[int]  # committed positions before the step (anchor included)
    drafts: np.ndarray  # [bs, gamma]
    confidence: np.ndarray  # [bs, gamma]
    survival: np.ndarray  # [bs, gamma]
    draft_logprobs: torch.Tensor  # [bs, gamma], host
    logits: list[torch.Tensor]  # per request: the (penalized, masked) target rows acceptance used
    adjusted: bool  # SGLang would call the batch's logits adjusted (see live.sglang_adjusts_logits)

    def req_step_rows(
        self, cfg: EngineConfig, run_id: str, censors: Censors, logprobs: Logprobs
    ) -> list[dict[str, Any]]:
        """One ``req_steps`` row per request, resolving each request's censored blocks
        against this step's target rows (the rows update ``live.censored``)."""
        lookups = self._gather_logprobs(censors, logprobs)
        return [self._row(cfg, run_id, i, lookups[i], censors) for i in range(len(self.running))]

    def _row(
        self, cfg: EngineConfig, run_id: str, i: int, logp: Any, censors: Censors
    ) -> dict[str, Any]:
        live, req = self.running[i], self.running[i].req
        res, full, committed, reason = self.outcomes[i]
        w, prefix, drafts = int(self.verify_lens[i]), self.lengths_before[i], self.drafts[i]
        fct = self.stats.forward_ct
        censored = censors(live, res, w, self.adjusted)
        pg, live.censored = resolve(live.censored, logp, full, prefix)
        row = {
            "run_id": run_id,
            "dp_rank": cfg.dp_rank,
            "forward_ct": fct,
            "rid": req.rid,
            "gamma": cfg.gamma,
            "req_pool_index": live.slot,
            "prefix_len": prefix + 1,  # tokens known, anchor included
            "verify_len": w,
            "acc_len": len(committed),
            "correct_drafts": res.correct_drafts,
            "cap_trim": res.cap_trim if cfg.mode == "cap-accept" else 0,
            "bonus_token": res.bonus_token,
            "draft_tokens": drafts.tolist(),
            "confidence": self.confidence[i].tolist(),
            "survival": self.survival[i].tolist(),
            "workload": req.workload,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "is_last": reason is not None,
            "ts": self.stats.ts,
            "pg": pg or None,
            "trimmed_tokens": None,
            "q_lp": None,
        }
        if censored:
            trimmed = drafts[w - 1 :].tolist()
            row["trimmed_tokens"] = trimmed
            # Greedy drafts are the drafter's argmax: log q at T -> 0 is 0.
            q_lp = self.draft_logprobs[i, w - 1 :].tolist()
            row["q_lp"] = [0.0] * len(trimmed) if live.greedy else q_lp
            blk = Censored(fct, prefix + w, w, trimmed)
            # The first trimmed draft sits where this step's bonus landed: resolve it now.
            extra = resolve_block(blk, logp, full, prefix)
            if extra:
                row["pg"] = (row["pg"] or []) + extra
            if blk.next_k < len(blk.tokens):
                live.censored.append(blk)
        return row

    def _gather_logprobs(self, censors: Censors, logprobs: Logprobs) -> list[Any]:
        """Per request, log p of the target rows at the columns of the drafts still awaiting
        resolution (None where none await), gathered on the device for every request and
        moved to the host in one transfer (no sync per entry)."""
        out: list[Any] = [None] * len(self.running)
        wanted: list[tuple[int, list[int]]] = []
        for i, live in enumerate(self.running):
            w = int(self.verify_lens[i])
            opens = censors(live, self.outcomes[i][0], w, self.adjusted)
            if not (live.censored or opens):
                continue
            cols = {int(t) for blk in live.censored for t in blk.tokens[blk.next_k :]}
            if opens:
                cols.update(int(t) for t in self.drafts[i, w - 1 :])
            wanted.append((i, sorted(cols)))
        if not wanted:
            return out
        logits = self.logits
        greedy = [(i, cols) for i, cols in wanted if self.running[i].greedy]
        sampled = [(i, cols) for i, cols in wanted if not self.running[i].greedy]
        parts = []
        if greedy:
            parts.append(greedy_logprobs_at([logits[i] for i, _ in greedy], [c for _, c in greedy]))
        for i, cols in sampled:
            idx = torch.tensor(cols, device=logits[i].device)
            parts.append(logprobs(logits[i], self.running[i])[:, idx].reshape(-1))
        flat = torch.cat(parts).cpu().numpy()
        at = 0
        for i, cols in greedy + sampled:
            n = logits[i].shape[0] * len(cols)
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
