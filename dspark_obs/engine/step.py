"""One decode step of the running batch: draft, plan, verify, accept, commit, hand over.

The step pipeline, apart from the request lifecycle (:mod:`dspark_obs.engine.loop`: admission,
cancels, slots, flushing): the loop calls :meth:`StepPipeline.step` once per step with the
running batch (ordered by slot), and gets back the requests that finished.

1. draft a block of ``gamma`` tokens per request (the drafter's context cache receives the
   target features of what the previous step committed);
2. plan windows: ``static`` verifies everything; ``compact`` and ``cap-accept`` ask the
   scheduler (SPS-argmax budget on lagged survival, top-b allocation on current survival);
3. verify with ONE packed target forward: ``compact`` sends ``verify_len`` tokens per request
   (so the forward processes ``sum(verify_len)`` tokens), the other modes send ``gamma + 1``;
4. accept (greedy or lossless rejection sampling), roll back the KV caches, commit;
5. queue the step's record work: its arrays (:meth:`StepResult.arrays`, which resolves the
   censored blocks) go to the run's record builder, which builds Arrow tables on its worker.
   Its reads of the step's target rows wait for that step's own event, not for the steps
   launched since (:mod:`dspark_obs.engine.host_copy`).

The record work of step k runs while the device drafts step k + 1 (``overlap``), or right away.

A whole-block step (:meth:`StepPipeline._whole_block`: no row penalized or masked) runs 1-4
on the device without a host value in between (:meth:`Runtime.verify_block`: the windows,
allocated there from the live survival under the budget the host took from the lagged one,
and the acceptance included: greedy, or rejection sampling with coins the host drew from each
request's generator at launch), and on a runtime that can launch ahead it is read one
call later, after the next such step launched from the device's own lengths and anchors
(``EngineConfig.launch_ahead``): the host's per-request work of step k then overlaps the
device's step k + 1. A trimmed ``cap-accept`` step runs compact's windows, then the drafts
past them in a second forward on top (their argmax counts ``cap_trim``), both launched
without a host value (greedy rows only). Any other step (the split step: rows are
penalized or masked, ``device_windows`` is off and the budget trims, or a trimmed
``cap-accept`` batch has a sampled row) reads the drafts back before it verifies, after the
step in flight was read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch

from dspark_obs.analytics.estimator_recorder import sglang_skips_estimator
from dspark_obs.engine.acceptance import (
    AcceptResult,
    BatchAccept,
    accept,
    draw_uniforms,
    greedy_accept_argmax,
    greedy_accept_batch,
    process_logits,
    process_logprobs,
)
from dspark_obs.engine.block_verify import BlockHost, BlockVerified, RowSampling
from dspark_obs.engine.censored import ESTIMATOR_MIN_TEMPERATURE
from dspark_obs.engine.drafter import DraftBlock
from dspark_obs.engine.host_copy import rows_event
from dspark_obs.engine.live import Live, mask_stops, sglang_adjusts_logits
from dspark_obs.engine.model import Target
from dspark_obs.engine.outcome import StepOutcome, cut_at_stops
from dspark_obs.engine.runtime import Runtime
from dspark_obs.engine.scheduler import BudgetDecision, Scheduler
from dspark_obs.engine.step_records import StepArrays
from dspark_obs.engine.step_rows import Censors, StepResult, StepStats
from dspark_obs.engine.types import EngineConfig, OnTokens, RunResult

__all__ = ["StepIO", "StepPipeline", "land_first_tokens", "opens_censored", "run_pending"]

Finish = Callable[[Live, str], None]
AddStep = Callable[[StepArrays], None]
Retire = Callable[[list[Live]], None]


@dataclass
class StepIO:
    """Where a run's steps hand their results (made once per run by the loop): the run's
    totals, the queued record work, the request-finished and step-arrays callbacks, and
    ``retire``, which takes finished requests out of the running batch and frees their slots."""

    result: RunResult
    pending: list[Callable[[], None]]
    finish: Finish
    add: AddStep
    retire: Retire


def opens_censored(
    cfg: EngineConfig, live: Live, correct_drafts: int, w: int, adjusted: bool
) -> bool:
    """Whether this step's trimmed drafts await resolution: a compact window fully
    accepted with drafts cut off. SGLang's recorder skips greedy / truncated rows, and
    whole steps whose batch ``adjusted`` its logits (penalties, min_new_tokens): their
    pending blocks are dropped too."""
    req = live.req
    censors = cfg.mode == "compact" and correct_drafts == w - 1 and w - 1 < cfg.gamma
    if cfg.estimator_rows == "sglang" and (
        adjusted or sglang_skips_estimator(req.temperature, req.top_k, req.top_p)
    ):
        censors, live.censored = False, []
    return censors


def land_first_tokens(lives: Sequence[Live], on_tokens: OnTokens | None) -> list[Live]:
    """Book the first token of each request in ``lives`` that the device kept
    (``Live.first``): its output, its anchor, its first-token time, its stream's first
    token. Returns those it finishes (the token is a stop id); a step that ran them is
    wasted for them, as for any request that finished while a step was in flight."""
    stopped = []
    for live in lives:
        if live.first is None:
            continue
        tokens, i = live.first
        live.first, live.anchor = None, tokens[i]
        live.output.append(live.anchor)
        live.first_token_time = time.time()
        if on_tokens is not None:
            on_tokens(live.req.rid, [live.anchor])
        if live.stops_at(live.anchor):
            stopped.append(live)
    return stopped


def run_pending(pending: list[Callable[[], None]]) -> None:
    """Run queued record work in order (a step's records, then the next step's)."""
    while pending:
        pending.pop(0)()


@dataclass
class _Launched:
    """A whole-block step launched and not read yet (row i = ``running[i]`` at launch)."""

    running: list[Live]
    block: DraftBlock
    verified: BlockVerified
    fct: int
    decision: BudgetDecision | None
    lengths_before: list[int] | None  # None: launched ahead, read when the step is read
    events: list[Any]
    host_ms: float  # host time the launch took
    draft_s: float
    verify_s: float


class StepPipeline:
    """The decode step of one run on one runtime (made by the engine at each run's start)."""

    def __init__(
        self,
        target: Target,
        cfg: EngineConfig,
        scheduler: Scheduler,
        runtime: Runtime,
        on_tokens: OnTokens | None,
        censors: Censors,
    ) -> None:
        """``censors``: the censored-block rule (:func:`opens_censored`, or the engine's)."""
        self.target = target
        self.censors = censors
        self.cfg = cfg
        self.scheduler = scheduler
        self.rt = runtime
        self.on_tokens = on_tokens
        self._records_read_logits = False  # the last step's records read its target rows
        self._inflight: _Launched | None = None  # launched ahead, read at the next step

    def step(self, running: list[Live], fct: int, io: StepIO) -> None:
        """One decode step: draft, plan, verify, accept, commit. Requests that finish go to
        ``io.retire``; their records (and the step's arrays, handed to ``io.add``) are queued
        on ``io.pending``, which the next step runs while the device works (``overlap``) or
        the caller runs now.

        A whole-block step on a runtime that can launch ahead is read one call later: the
        call launches step ``fct`` from the device's lengths and anchors first, then reads
        the step launched before (its requests that finished meanwhile are skipped, their
        rows wasted), so the host's per-request work overlaps the device's next step."""
        cfg = self.cfg
        inflight, self._inflight = self._inflight, None
        wanted = self.rt.asynchronous if cfg.launch_ahead is None else cfg.launch_ahead
        ahead = wanted and self.rt.can_launch_ahead(len(running))
        if inflight is not None:
            whole, decision = self._whole_block(running, pending=1) if ahead else (False, None)
            if whole:
                if self._records_read_logits:
                    run_pending(io.pending)  # they read the buffer this launch overwrites
                if self._records_may_read(running):
                    inflight.verified.keep_logits()  # this launch overwrites the graph's buffer
                self._inflight = self._launch(running, fct, decision, io.pending, ahead=True)
                if cfg.overlap:
                    run_pending(io.pending)
                io.retire(self._read(inflight, running, io))
                self._records_read_logits = False  # its rows were copied, or are not read
                return
            io.retire(self._read(inflight, running, io))
        self._land(list(running), io)  # the pipeline is drained: every kept first token
        if not running:
            return
        whole, decision = self._whole_block(running, pending=0)
        if not whole:
            io.retire(self._split_step(running, fct, io))
            return
        launched = self._launch(running, fct, decision, io.pending, ahead=False)
        if cfg.overlap:
            run_pending(io.pending)  # while the device drafts and verifies
        if ahead:
            self._inflight = launched  # read at the next step, after it launched its own
            return
        io.retire(self._read(launched, running, io))

    def _land(self, lives: Sequence[Live], io: StepIO) -> None:
        """Book the first tokens the device kept for ``lives`` (running requests: the
        pipeline is drained, or they rode in the step being read); those that stop at it
        finish now and leave the running batch."""
        stopped = land_first_tokens(lives, self.on_tokens)
        for live in stopped:
            io.finish(live, "stop")
        if stopped:
            io.retire(stopped)

    def _launch(
        self,
        running: list[Live],
        fct: int,
        decision: BudgetDecision | None,
        pending: list[Callable[[], None]],
        *,
        ahead: bool,
    ) -> _Launched:
        """Draft and verify every block back to back (nothing on the host waits between
        them); ``ahead``: an earlier step is still unread, so the lengths are read later."""
        t0 = time.perf_counter()
        events = self._events()
        if events:
            events[0].record()
        lengths_before = None if ahead else [self.rt.length(r.slot) for r in running]
        block = self._draft(running)
        if events:
            events[1].record()
        if self.cfg.overlap and self._records_read_logits:
            run_pending(pending)  # the previous step's records, while the device drafts
        t_draft = time.perf_counter()
        if events:
            events[2].record()
        mode = self.cfg.mode
        floor = None if mode == "static" else self.scheduler.survival_floor
        budget = None if decision is None else decision.budget
        # compact sends verify_len tokens per request; a cap-accept step whose budget trims
        # sends compact's windows, then the drafts past them (the ceiling) on top
        rest = mode == "cap-accept" and budget is not None and budget < len(running) * (
            self.cfg.gamma
        )
        verified = self.rt.verify_block(
            block, floor, budget, windows_only=mode == "compact" or rest, rest=rest,
            sampling=self._sampling(running),
        )  # fmt: skip
        if events:
            events[3].record()
        t_end = time.perf_counter()
        return _Launched(
            running=list(running), block=block, verified=verified, fct=fct, decision=decision,
            lengths_before=lengths_before, events=events, host_ms=(t_end - t0) * 1000.0,
            draft_s=t_draft - t0, verify_s=t_end - t_draft,
        )  # fmt: skip

    def _read(self, launched: _Launched, running: list[Live], io: StepIO) -> list[Live]:
        """Read a whole-block step back (its one device-to-host copy), plan its windows, check
        the device's acceptance, commit; returns the requests that finished."""
        cfg, gamma = self.cfg, self.cfg.gamma
        t0 = time.perf_counter()
        host = launched.verified.fetch()
        self._land(launched.running, io)  # arrivals that rode in it (nothing waits)
        still = {id(live) for live in running}
        index = np.array(
            [i for i, live in enumerate(launched.running) if id(live) in still], dtype=np.int64
        )
        if not len(index):
            return []  # everyone finished while it ran
        lives = [launched.running[i] for i in index]
        launched_host = host
        if len(index) < len(launched.running):
            host = host.rows(index)
        bs = len(lives)
        if cfg.mode == "static":
            budget, verify_lens = bs * gamma, np.full(bs, gamma + 1, dtype=np.int64)
            decision = None
        elif launched.decision is not None and launched.decision.budget < (
            len(launched.running) * gamma
        ):  # the budget trims: the device shared it over every row it launched
            rids = [r.req.rid for r in launched.running]
            budget, lens = self.scheduler.plan(rids, launched_host.survival, launched.decision)
            decision, verify_lens = self.scheduler.last_decision, lens[index]
        else:
            rids = [r.req.rid for r in lives]
            budget, verify_lens = self.scheduler.plan(rids, host.survival, launched.decision)
            decision = self.scheduler.last_decision
            if budget < bs * gamma:
                raise RuntimeError(f"budget {budget} is less than the full one planned ahead")
        if not np.array_equal(verify_lens, host.window):
            raise RuntimeError(
                f"the device's windows {host.window.tolist()} differ from the scheduler's "
                f"{verify_lens.tolist()}"
            )
        send = verify_lens if cfg.mode == "compact" else np.full(bs, gamma + 1, dtype=np.int64)
        accepted = self._accepted(lives, host, send, verify_lens)
        if launched.lengths_before is None:
            lengths_before = [self.rt.length(live.slot) for live in lives]
        else:
            lengths_before = [launched.lengths_before[i] for i in index]
        # a cap-accept step's rows past its windows were verified for their argmax only
        logits = launched.verified.rows(verify_lens if launched.verified.rest else send, index)
        done, outcome = self._commit(lives, accepted, lengths_before, io.result, on_device=True)
        step_ms = launched.host_ms + (time.perf_counter() - t0) * 1000.0
        self._hand_over(
            lives, launched.fct, budget, decision, verify_lens, send, lengths_before,
            host.drafts, host.confidence, host.survival, torch.from_numpy(host.logprobs),
            logits, outcome, step_ms, launched.events, launched.draft_s, launched.verify_s, io,
            launched.verified.logits_ready,
        )  # fmt: skip
        return done

    def _sampling(self, running: list[Live]) -> RowSampling | None:
        """The samplers of a whole-block step's rows and the uniforms their acceptance
        consumes, drawn now (after the draft drew its own, as the split step draws them);
        None when every row is greedy."""
        if all(live.greedy for live in running):
            return None
        gamma, bs = self.cfg.gamma, len(running)
        coins = np.zeros((bs, gamma + 1), dtype=np.float64)
        for i, live in enumerate(running):
            if not live.greedy:
                coins[i] = draw_uniforms(live.gen, gamma)
        reqs = [live.req for live in running]
        temps = [0.0 if live.greedy else live.req.temperature for live in running]
        return RowSampling(
            temperature=np.array(temps, dtype=np.float64),  # the values the host divides by
            top_p=np.array([r.top_p for r in reqs], dtype=np.float64),
            top_k=np.array([r.top_k for r in reqs], dtype=np.int64),
            coins=coins,
        )

    def _accepted(
        self, lives: list[Live], host: BlockHost, send: np.ndarray, verify_lens: np.ndarray
    ) -> BatchAccept:
        """The batch's acceptance from a whole-block step's read-back: greedy rows by the
        host's own rule from the target's argmax, checked against the device's; sampled rows
        as the device's rejection sampling decided them (its coins were the request's)."""
        greedy = np.fromiter((live.greedy for live in lives), bool, len(lives))
        correct = host.keep.astype(np.int64)
        correct_full, bonus = host.full.astype(np.int64), host.token.astype(np.int64)
        rows = np.flatnonzero(greedy)
        if len(rows):
            window = verify_lens[rows] if self.cfg.mode == "cap-accept" else None
            decided = greedy_accept_batch(
                host.argmax[rows], host.drafts[rows], send[rows], self.target.cfg.vocab_size,
                windows=window,
            )  # fmt: skip
            if not np.array_equal(decided.correct, correct[rows]):
                raise RuntimeError("the device's acceptance differs from the host's greedy rule")
            correct_full[rows], bonus[rows] = decided.correct_full, decided.bonus
        return BatchAccept.of_drafts(host.drafts, correct, correct_full, bonus, verify_lens)

    def _split_step(self, running: list[Live], fct: int, io: StepIO) -> list[Live]:
        """A step that reads the drafts before it verifies: rows are penalized or masked,
        sampled where ``device_sampling`` is off, or the plan needs the current survival
        (``device_windows`` off, or a trimmed cap-accept batch with a sampled row). Returns
        the finished requests."""
        cfg, gamma = self.cfg, self.cfg.gamma
        t0 = time.perf_counter()
        events = self._events()
        if events:
            events[0].record()
        bs = len(running)
        lengths_before = [self.rt.length(r.slot) for r in running]
        block = self._draft(running)
        if events:
            events[1].record()
        if cfg.overlap:
            run_pending(io.pending)  # the previous step's records, while the device drafts
        conf = block.confidence.float().cpu().numpy()
        draft_tokens = block.tokens.cpu()
        dt_np = draft_tokens.numpy()
        draft_lp = block.logprobs.float().cpu()
        survival = np.cumprod(conf, axis=1)
        t_draft = time.perf_counter()
        if cfg.mode == "static":
            budget, verify_lens = bs * gamma, np.full(bs, gamma + 1, dtype=np.int64)
            decision = None
        else:
            budget, verify_lens = self.scheduler.plan([r.req.rid for r in running], survival)
            decision = self.scheduler.last_decision
        send = verify_lens if cfg.mode == "compact" else np.full(bs, gamma + 1, dtype=np.int64)
        if events:
            events[2].record()
        all_logits, preds = self._verify(running, draft_tokens, verify_lens, send)
        if events:
            events[3].record()
        t_verify = time.perf_counter()
        for i, live in enumerate(running):
            # penalties, then min_new_tokens' stop mask
            k = live.masked_rows(int(send[i]))
            if live.counts is not None:
                all_logits[i] = live.req.penalties.apply(all_logits[i], live.counts, dt_np[i])
            if k:
                all_logits[i] = mask_stops(all_logits[i], k, live.stops)
            if k or live.counts is not None:
                preds[i] = all_logits[i].argmax(-1).cpu().numpy()
        rows_ready = rows_event(self.target.device)  # every row rewritten: the records read them
        accepted = self._accept_rows(running, block, dt_np, verify_lens, send, all_logits, preds)
        done, outcome = self._commit(running, accepted, lengths_before, io.result)
        step_ms = (time.perf_counter() - t0) * 1000.0
        self._hand_over(
            running, fct, budget, decision, verify_lens, send, lengths_before, dt_np, conf,
            survival, draft_lp, all_logits, outcome, step_ms, events, t_draft - t0,
            t_verify - t_draft, io, rows_ready,
        )  # fmt: skip
        return done

    def _hand_over(
        self,
        running: list[Live],
        fct: int,
        budget: int,
        decision: BudgetDecision | None,
        verify_lens: np.ndarray,
        send: np.ndarray,
        lengths_before: list[int],
        drafts: np.ndarray,
        conf: np.ndarray,
        survival: np.ndarray,
        draft_lp: torch.Tensor,
        logits: Sequence[torch.Tensor],
        outcome: StepOutcome,
        step_ms: float,
        events: list[Any],
        draft_s: float,
        verify_s: float,
        io: StepIO,
        rows_ready: torch.cuda.Event | None,
    ) -> None:
        """The step's statistics and its record work (queued on ``io.pending``); ``rows_ready``:
        the event ``logits`` are final at on the device (None off CUDA), which the record's
        reads of them wait for instead of every step launched since."""
        cfg, gamma, bs = self.cfg, self.cfg.gamma, len(running)
        self._records_read_logits = bool((verify_lens <= gamma).any()) or any(
            live.censored for live in running
        )
        pred_ms = theta = None
        if decision is not None:
            if decision.predicted_step_seconds is not None:
                pred_ms = decision.predicted_step_seconds * 1000.0
            theta = decision.predicted_theta
        elif cfg.cost_table is not None and not cfg.cost_table.uninitialized:
            pred_ms = cfg.cost_table.step_seconds(bs, int(budget)) * 1000.0
        stats = StepStats(
            forward_ct=fct, bs=bs, budget=int(budget), num_verify_tokens=int(send.sum()),
            predicted_step_ms=pred_ms, predicted_theta=theta, step_cpu_ms=step_ms,
            ts=datetime.now(UTC),
        )  # fmt: skip
        if not events and self._timed_device:  # a synchronous runtime on a GPU
            stats.draft_gpu_ms = draft_s * 1000.0
            stats.target_verify_gpu_ms = verify_s * 1000.0
        done_step = StepResult(  # a copy of running: the caller removes finished requests
            stats=stats, running=list(running), outcome=outcome, verify_lens=verify_lens,
            lengths_before=lengths_before, drafts=drafts, confidence=conf, survival=survival,
            draft_logprobs=draft_lp, logits=logits, adjusted=sglang_adjusts_logits(running),
            rows_ready=rows_ready,
        )  # fmt: skip

        def records() -> None:
            if events:  # device time of this step's draft and verify passes
                stats.draft_gpu_ms = events[0].elapsed_time(events[1])
                stats.target_verify_gpu_ms = events[2].elapsed_time(events[3])
            io.add(done_step.arrays(cfg, self.censors, self._estimator_logprobs))
            for live, reason in zip(done_step.running, outcome.reasons, strict=True):
                if reason is not None:
                    io.finish(live, reason)

        io.pending.append(records)

    def _accept_rows(
        self,
        running: list[Live],
        block: DraftBlock,
        dt_np: np.ndarray,
        verify_lens: np.ndarray,
        send: np.ndarray,
        all_logits: Sequence[torch.Tensor],
        preds: list[np.ndarray],
    ) -> BatchAccept:
        """A split step's acceptance, request by request (greedy from the rows' argmax,
        sampled by rejection sampling with the request's generator)."""
        cfg, gamma = self.cfg, self.cfg.gamma
        vocab = self.target.cfg.vocab_size
        results: list[AcceptResult] = []
        for i, live in enumerate(running):
            req = live.req
            w, n = int(verify_lens[i]), int(send[i])
            drafts = dt_np[i, : n - 1]
            window = w if cfg.mode == "cap-accept" else None
            if live.greedy:
                results.append(greedy_accept_argmax(preds[i], drafts, vocab, window=window))
                continue
            probs = process_logits(all_logits[i].double(), req.temperature, req.top_p, req.top_k)
            results.append(
                accept(probs, drafts, block.probs[i, : n - 1].double(), live.gen,
                       window=window, block_size=gamma)  # fmt: skip
            )
        return BatchAccept.stack(results, gamma)

    def _commit(
        self,
        running: list[Live],
        accepted: BatchAccept,
        lengths_before: list[int],
        result: RunResult,
        *,
        on_device: bool = False,
    ) -> tuple[list[Live], StepOutcome]:
        """The stop / length cut, the outputs, and the commit into the caches (``on_device``:
        the device committed already, the host books it); returns the finished requests and
        the step's outcome."""
        outcome = cut_at_stops(accepted, running)
        tokens, cut = accepted.tokens.tolist(), outcome.committed.tolist()
        keep = (accepted.correct + 1 + np.asarray(lengths_before, dtype=np.int64)).tolist()
        done: list[Live] = []
        for i, live in enumerate(running):
            committed = tokens[i][: cut[i]]
            live.output.extend(committed)
            if live.counts is not None:
                live.counts.add(committed)
            if self.on_tokens is not None:
                self.on_tokens(live.req.rid, committed)
            if outcome.reasons[i] is not None:
                done.append(live)
                continue
            # Keep anchor + accepted drafts in the caches; the bonus becomes the next anchor.
            live.anchor = committed[-1]
            self.rt.commit(live.slot, keep[i], live.anchor, on_device=on_device)
        result.committed_tokens += int(outcome.committed.sum())
        return done, outcome

    def _records_may_read(self, running: list[Live]) -> bool:
        """Whether the records of the launched step not read yet may read its target rows: a
        request still has censored blocks, or the step may open one (a window fully accepted
        short of its block; only its read-back tells, and that comes after the next launch).
        Windows fall short of the block only under a survival floor (a table or a forced
        budget, which is what trims too); SGLang's rule (``estimator_rows="sglang"``) opens
        no block on greedy or truncated rows."""
        if any(live.censored for live in running):
            return True
        if self.cfg.mode == "static":
            return False
        if self.cfg.estimator_rows == "sglang" and all(
            sglang_skips_estimator(r.req.temperature, r.req.top_k, r.req.top_p) for r in running
        ):
            return False
        return self.scheduler.survival_floor is not None

    def _whole_block(self, running: list[Live], pending: int) -> tuple[bool, BudgetDecision | None]:
        """Whether this step runs draft and verify back to back (:meth:`Runtime.
        verify_block`), decided before it drafts (``pending``: earlier steps not read yet),
        and the budget decision it launches with: no row with a penalty or a
        ``min_new_tokens`` mask (those rewrite the target rows on the host), sampled rows only
        where they are accepted on the device (``EngineConfig.device_sampling``), and a
        budget (from lagged survival) that covers every draft, or trims (``EngineConfig.
        device_windows``: the windows are then allocated and packed on the device; a trimmed
        ``cap-accept`` step of greedy rows verifies compact's windows first, then the drafts
        past them, so that it commits bitwise what its compact run commits)."""
        cfg, q = self.cfg, self.cfg.gamma + 1
        if not cfg.whole_block_verify:
            return False, None
        sampled = not all(live.greedy for live in running)
        if sampled and not (
            self.rt.asynchronous if cfg.device_sampling is None else cfg.device_sampling
        ):
            return False, None
        for live in running:  # a row's output only grows: a stale mask count is an upper bound
            if live.counts is not None or live.masked_rows(q):
                return False, None
        if cfg.mode == "static":
            return True, None
        decision = self.scheduler.decide_ahead([r.req.rid for r in running], pending)
        if decision is None:
            return False, None
        if decision.budget < len(running) * cfg.gamma and not (
            cfg.device_windows and (cfg.mode == "compact" or not sampled)
        ):  # a trimmed cap-accept step counts its drafts past the windows greedily only
            return False, None
        return True, decision

    def _draft(self, running: list[Live]) -> DraftBlock:
        """One block per running request (batched: launched on the device, not waited for)."""
        return self.rt.draft([r.req.temperature for r in running], [r.gen for r in running])

    def _events(self) -> list[Any]:
        """CUDA events around the draft and verify launches (an asynchronous runtime)."""
        if not self.rt.asynchronous:
            return []
        return [torch.cuda.Event(enable_timing=True) for _ in range(4)]

    def _verify(
        self, running: list[Live], drafts: torch.Tensor, verify_lens: np.ndarray, send: np.ndarray
    ) -> tuple[list[torch.Tensor], list[np.ndarray]]:
        """One packed target forward over each request's ``send`` tokens: logits and argmax
        per request.

        cap-accept runs it as two forwards: first exactly the windows compact would send
        (so everything committed, and the drafter features, are bitwise those of the compact
        run, whatever the floating-point effects of a wider batch), then the trimmed drafts
        on top of the same caches, which only serve to count ``cap_trim``.
        """
        head = verify_lens if self.cfg.mode == "cap-accept" else send
        rest = [i for i in range(len(running)) if head[i] < send[i]]
        rt = self.rt
        rows = [[r.anchor, *drafts[i, : head[i] - 1].tolist()] for i, r in enumerate(running)]
        logits, preds = rt.forward([r.slot for r in running], rows).split()
        if rest:
            for i in rest:
                logits[i] = logits[i].clone()  # the tail forward may reuse the buffers
            tails = [drafts[i, head[i] - 1 : send[i] - 1].tolist() for i in rest]
            tail_logits, tail_preds = rt.forward([running[i].slot for i in rest], tails).split()
            for j, i in enumerate(rest):
                logits[i] = torch.cat([logits[i], tail_logits[j]])
                preds[i] = np.concatenate([preds[i], tail_preds[j]])
        return logits, preds

    @staticmethod
    def _estimator_logprobs(logits: torch.Tensor, live: Live) -> torch.Tensor:
        """log p of the distribution acceptance used (processed: temperature, top-k, top-p)."""
        req = live.req
        if live.greedy:  # one-hot whatever the filters; SGLang's temperature floor
            return torch.log_softmax(logits.double() / ESTIMATOR_MIN_TEMPERATURE, dim=-1)
        return process_logprobs(logits, req.temperature, req.top_p, req.top_k)

    @property
    def _timed_device(self) -> bool:
        return self.target.device.type == "cuda"
