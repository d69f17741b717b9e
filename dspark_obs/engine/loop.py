"""The embedded DSpark decode loop: continuous batching, drafting, scheduling, verification.

One step for the running batch:

1. admit arrivals (prefill: the first token comes from the prompt's last logits);
2. draft a block of ``gamma`` tokens per request (the drafter's context cache receives the
   target features of what the previous step committed);
3. plan windows: ``static`` verifies everything; ``compact`` and ``cap-accept`` ask the
   scheduler (SPS-argmax budget on lagged survival, top-b allocation on current survival);
4. verify with ONE packed target forward: ``compact`` sends ``verify_len`` tokens per request
   (so the forward processes ``sum(verify_len)`` tokens), the other modes send ``gamma + 1``;
5. accept (greedy or lossless rejection sampling), roll back the KV caches, commit;
6. emit a step record with one req-step row per request through the producer interface.

Each request owns a ``torch.Generator`` seeded by its own seed, and every mode consumes the
same draws per step, so a ``cap-accept`` companion of a ``compact`` run commits the same
tokens (token-identical under greedy; identical streams under sampling).

For the block-accept estimator, a compact step whose window was fully accepted while drafts
were trimmed (``correct_drafts == verify_len - 1 < gamma``) records ``trimmed_tokens`` and
their draft log-probs ``q_lp``; later target rows that cover those positions resolve them into
``pg`` entries ``(src_fct, k, target_logprob, draft_token, realized_token)`` until the first
offset whose realized token differs from the draft (SGLang 0.5.23's JSONL semantics).
``target_logprob`` is log p of the distribution acceptance really used (temperature, then
top-k / top-p, after penalties), so the estimator is exact for every sampling setting; SGLang
skips greedy and truncated rows, and whole steps whose batch has a penalty or
``min_new_tokens``, instead (``EngineConfig(estimator_rows="sglang")`` does the same).

The loop drives one :class:`~dspark_obs.engine.runtime.Runtime` (the reference per-request
runtime or the batched slot pool, chosen once per run by ``engine_runtime``) and never asks
which; a step's numbers become records in :mod:`dspark_obs.engine.step_rows`.

Records reach ``emit`` every ``flush_every`` steps or ``flush_seconds`` (default 1 s) after
the previous hand-over, whichever comes first, so live readers see progress and a kill loses
at most about a second of steps that were not yet handed over.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch

from dspark_obs.analytics.estimator_recorder import sglang_skips_estimator
from dspark_obs.engine.acceptance import (
    SAMPLING_EPS,
    AcceptResult,
    accept,
    greedy_accept_argmax,
    process_logits,
    process_logprobs,
)
from dspark_obs.engine.censored import (
    ESTIMATOR_MIN_TEMPERATURE,
)
from dspark_obs.engine.drafter import DraftBlock, Drafter
from dspark_obs.engine.live import Live, mask_stops, sglang_adjusts_logits
from dspark_obs.engine.model import Target
from dspark_obs.engine.penalties import OutputCounts, penalty_error
from dspark_obs.engine.runtime import Runtime, engine_runtime, uses_batched
from dspark_obs.engine.scheduler import Scheduler
from dspark_obs.engine.step_rows import StepResult, StepStats, request_row, waiting_row
from dspark_obs.engine.types import (  # re-exported: callers import them from here
    BACKENDS,
    ESTIMATOR_ROWS,
    MASKED_LOGIT,
    Emit,
    EngineConfig,
    EngineError,
    GenRequest,
    OnTokens,
    RequestSource,
    RunResult,
)

__all__ = [
    "BACKENDS",
    "ESTIMATOR_ROWS",
    "MASKED_LOGIT",
    "Emit",
    "Engine",
    "EngineConfig",
    "EngineError",
    "GenRequest",
    "OnTokens",
    "RequestSource",
    "RunResult",
]


def _run_pending(pending: list[Callable[[], None]]) -> None:
    """Run queued record work in order (a step's records, then the next step's)."""
    while pending:
        pending.pop(0)()


class Engine:
    """Runs requests through target + drafter in one verify mode and emits records."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter,
        config: EngineConfig,
        stop_ids: Sequence[int] = (),
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``clock`` times the record hand-overs (``flush_seconds``); tests inject one."""
        if config.gamma > drafter.cfg.gamma_max:
            limit = drafter.cfg.gamma_max
            raise EngineError(f"gamma={config.gamma} exceeds the drafter's trained maximum {limit}")
        self.target = target
        self.drafter = drafter
        self.cfg = config
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.clock = clock
        self.scheduler = Scheduler(config.cost_table, config.gamma, config.lag_steps)
        self._on_tokens: OnTokens | None = None
        self._runtime: Runtime | None = None  # made at the start of each run
        self._cancel_lock = threading.Lock()
        self._cancels: set[str] = set()

    def cancel(self, rid: str) -> None:
        """Abort request ``rid`` (thread-safe; any thread, e.g. a server's on a disconnect).

        The running loop applies it at its next step boundary: a waiting request, or a
        running one (its slot is freed), finishes with reason ``"abort"`` (SGLang's
        ``FINISH_ABORT``) and keeps the tokens it committed. A request handed to the loop's
        ``source`` before this call is found even if the loop has not polled it yet; an id the
        loop does not know then (finished, never submitted) is forgotten."""
        with self._cancel_lock:
            self._cancels.add(str(rid))

    def _take_cancels(self) -> set[str]:
        with self._cancel_lock:
            taken, self._cancels = self._cancels, set()
        return taken

    # ------------------------------------------------------------------ public

    @property
    def batched(self) -> bool:
        """Whether this engine runs on the batched runtime (see ``BACKENDS``)."""
        return uses_batched(self.cfg, self.target)

    def check(self, requests: Sequence[GenRequest]) -> None:
        """Reject bad requests before a run starts, so nothing is half-written."""
        limit = self.target.cfg.max_position
        seen: set[str] = set()
        for r in requests:
            if r.rid in seen:
                raise EngineError(f"request id {r.rid!r} appears twice")
            seen.add(r.rid)
            if not r.prompt_ids:
                raise EngineError(f"request {r.rid!r}: empty prompt")
            if r.max_new_tokens < 1:
                raise EngineError(f"request {r.rid!r}: max_new_tokens must be >= 1")
            need = len(r.prompt_ids) + r.max_new_tokens + self.cfg.gamma + 1
            if need > limit:
                raise EngineError(
                    f"request {r.rid!r}: prompt of {len(r.prompt_ids)} tokens + "
                    f"{r.max_new_tokens} new tokens exceeds the context of {limit}"
                )
            if not (math.isfinite(r.temperature) and r.temperature >= 0):
                raise EngineError(f"request {r.rid!r}: temperature must be finite and >= 0")
            if not 0.0 < r.top_p <= 1.0:  # also NaN
                raise EngineError(f"request {r.rid!r}: top_p must be in (0, 1], got {r.top_p}")
            if r.top_k != -1 and r.top_k < 1:
                raise EngineError(f"request {r.rid!r}: top_k must be -1 (off) or >= 1")
            if not 0 <= r.seed < 2**63:
                raise EngineError(f"request {r.rid!r}: seed must be in 0..2**63-1")
            if r.arrival_step < 0:
                raise EngineError(f"request {r.rid!r}: arrival_step must be >= 0")
            vocab = self.target.cfg.vocab_size
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= vocab:
                raise EngineError(f"request {r.rid!r}: prompt token id outside 0..{vocab - 1}")
            if any(not 0 <= int(t) < vocab for t in r.stop_token_ids):
                raise EngineError(f"request {r.rid!r}: stop token id outside 0..{vocab - 1}")
            if not 0 <= r.min_new_tokens <= r.max_new_tokens:
                raise EngineError(
                    f"request {r.rid!r}: min_new_tokens must be in [0, max_new_tokens"
                    f"({r.max_new_tokens})], got {r.min_new_tokens}"
                )
            bad = penalty_error(r.frequency_penalty, r.presence_penalty, r.repetition_penalty)
            if bad:
                raise EngineError(f"request {r.rid!r}: {bad}")

    def run(
        self,
        requests: Sequence[GenRequest],
        emit: Emit,
        run_id: str,
        progress: Callable[[int], None] | None = None,
        source: RequestSource | None = None,
        on_tokens: OnTokens | None = None,
    ) -> RunResult:
        """Decode every request to completion; ``emit(table, rows)`` receives the records.

        ``progress(n)`` is called with the number of requests finished in a step. ``source``
        (optional) feeds requests that arrive while the run goes on; ``on_tokens`` streams.
        """
        self.check(requests)
        self._take_cancels()  # cancels left from an earlier run must not hit this one's ids
        self._on_tokens = on_tokens
        self.scheduler.relay.reset()
        waiting = sorted(requests, key=lambda r: (r.arrival_step, r.rid))
        buf: dict[str, list[dict[str, Any]]] = {"steps": [], "req_steps": [], "requests": []}
        self._prepare(requests, start=True)
        try:
            return self._loop(waiting, emit, run_id, progress, source, buf)
        finally:
            if self._runtime is not None:
                self._runtime.busy = False

    def _loop(
        self,
        waiting: list[GenRequest],
        emit: Emit,
        run_id: str,
        progress: Callable[[int], None] | None,
        source: RequestSource | None,
        buf: dict[str, list[dict[str, Any]]],
    ) -> RunResult:
        cfg = self.cfg
        running: list[Live] = []
        result = RunResult(run_id)
        tokens_before = self.target.tokens_processed
        t_start = time.perf_counter()
        last_flush = self.clock()
        fct = 0
        pending: list[Callable[[], None]] = []  # record work of the last step (overlapped)

        def finish(live: Live, reason: str) -> None:
            buf["requests"].append(request_row(live, self.cfg, run_id, reason))
            result.outputs[live.req.rid] = live.output
            result.requests += 1
            if progress:
                progress(1)

        def settle() -> None:
            _run_pending(pending)

        def drop(req: GenRequest) -> None:  # a waiting request aborted before admission
            buf["requests"].append(waiting_row(req, self.cfg, run_id))
            result.outputs[req.rid] = []
            result.requests += 1
            if progress:
                progress(1)

        with torch.inference_mode():
            while waiting or running or source is not None:
                cancels = self._take_cancels()  # before the poll: see cancel()
                if source is not None:
                    idle = not waiting and not running
                    if idle:
                        settle()
                        self._flush(emit, buf)  # a blocking poll must not hold records back
                    new = source(idle)
                    if new is None:
                        source = None
                    elif new:
                        self.check(new)
                        self._prepare(new)
                        for r in new:
                            r.arrival_step = fct
                        waiting = sorted([*waiting, *new], key=lambda r: (r.arrival_step, r.rid))
                if cancels:
                    waiting = self._abort(cancels, waiting, running, settle, finish, drop)
                if not waiting and not running:
                    continue
                arrived = []
                while (
                    waiting
                    and waiting[0].arrival_step <= fct
                    and len(running) + len(arrived) < cfg.max_batch
                ):
                    arrived.append(waiting.pop(0))
                kept: list[Live] = []
                for live in sorted(self._admit(arrived), key=lambda x: -x.slot):
                    result.committed_tokens += 1  # the first token comes from the prefill
                    if self._on_tokens is not None:
                        self._on_tokens(live.req.rid, [live.anchor])
                    if live.stops_at(live.anchor):
                        self._release(live, [*running, *kept])  # highest slot first: safe
                        finish(live, "stop")
                    elif live.req.max_new_tokens == 1:
                        self._release(live, [*running, *kept])
                        finish(live, "length")
                    else:
                        kept.append(live)
                if kept:
                    running.extend(kept)
                    running.sort(key=lambda r: r.slot)
                if not running:  # idle until the next arrival
                    fct = max(fct + 1, waiting[0].arrival_step) if waiting else fct + 1
                    continue
                done = self._step(running, fct, run_id, buf, result, pending, finish)
                for live in sorted(done, key=lambda d: -d.slot):  # highest slot first
                    running.remove(live)
                    self._release(live, running)
                if not cfg.overlap:
                    settle()
                result.steps += 1
                fct += 1
                now = self.clock()
                if result.steps % cfg.flush_every == 0 or now - last_flush >= cfg.flush_seconds:
                    settle()
                    self._flush(emit, buf)
                    last_flush = now
        settle()
        self._flush(emit, buf)
        result.seconds = time.perf_counter() - t_start
        result.target_tokens = self.target.tokens_processed - tokens_before
        return result

    def run_row(
        self,
        run_id: str,
        *,
        model: str,
        drafter: str,
        workload: str | None,
        temperature: float,
        seed: int,
        companion_of: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The ``runs`` row describing this engine's settings."""
        return {
            "run_id": run_id,
            "source": "engine",
            "mode": self.cfg.mode,
            "gamma": self.cfg.gamma,
            "model": model,
            "drafter": drafter,
            "workload": workload,
            "temperature": temperature,
            "seed": seed,
            "companion_of": companion_of,
            "lag_steps": self.cfg.lag_steps,
            "dp_size": 1,
            "started_at": datetime.now(UTC),
            "config": json.dumps(config or {}, sort_keys=True),
        }

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _flush(emit: Emit, buf: dict[str, list[dict[str, Any]]]) -> None:
        for table in ("steps", "req_steps", "requests"):
            if buf[table]:
                emit(table, buf[table])
                buf[table] = []

    def _prepare(self, requests: Sequence[GenRequest], *, start: bool = False) -> None:
        """Room for these requests in the runtime (``start``: the run's runtime, see
        :func:`~dspark_obs.engine.runtime.engine_runtime`); it grows when a request arriving
        mid-run needs more."""
        need = max((len(r.prompt_ids) + r.max_new_tokens for r in requests), default=0)
        need = max(need + self.drafter.cfg.gamma_max + self.cfg.gamma + 2, 256)
        if start:
            self._runtime = engine_runtime(
                self.target, self.drafter, self.cfg, need, prefer=self._runtime
            )
        self._rt.reserve(self.cfg.max_batch, need)

    @property
    def _rt(self) -> Runtime:
        if self._runtime is None:
            raise RuntimeError("no runtime: the engine is not running")
        return self._runtime

    def _admit(self, reqs: Sequence[GenRequest]) -> list[Live]:
        """Prefill arrivals (one packed forward for all of them on the batched backend) and
        sample each one's first token."""
        if not reqs:
            return []
        rt = self._rt
        arrival = time.time()
        slots = [rt.acquire() for _ in reqs]
        logits = rt.prefill(slots, [r.prompt_ids for r in reqs])
        argmax = logits.argmax(-1).tolist()
        lives = []
        for req, logits_row, slot, top in zip(reqs, logits, slots, argmax, strict=True):
            gen = torch.Generator(device="cpu").manual_seed(int(req.seed))
            stops = self.stop_ids | frozenset(int(t) for t in req.stop_token_ids)
            if req.min_new_tokens > 0:  # the first token is output token 0: masked
                logits_row = mask_stops(logits_row[None], 1, stops)[0]
                top = int(torch.argmax(logits_row))
            first = self._sample(logits_row, req, gen, top)
            rt.set_anchor(slot, first)
            counts = None
            if req.penalties.active:  # the prefill row saw no output yet: nothing to penalize
                counts = OutputCounts(self.target.cfg.vocab_size, logits_row.device)
                counts.add([first])
            lives.append(
                Live(
                    req=req,
                    gen=gen,
                    anchor=first,
                    output=[first],
                    arrival_time=arrival,
                    first_token_time=time.time(),
                    slot=slot,
                    stops=stops,
                    counts=counts,
                )
            )
        return lives

    def _abort(
        self,
        rids: set[str],
        waiting: list[GenRequest],
        running: list[Live],
        settle: Callable[[], None],
        finish: Callable[[Live, str], None],
        drop: Callable[[GenRequest], None],
    ) -> list[GenRequest]:
        """Finish the cancelled requests with reason ``"abort"``: running ones free their
        slot (after the records still pending for them); returns the waiting list left."""
        for req in waiting:
            if req.rid in rids:
                drop(req)
        hit = [live for live in running if live.req.rid in rids]
        if hit:
            settle()
            for live in sorted(hit, key=lambda d: -d.slot):  # highest slot first
                running.remove(live)
                self._release(live, running)
                finish(live, "abort")
        return [r for r in waiting if r.rid not in rids]

    def _release(self, live: Live, running: list[Live]) -> None:
        """Give a finished request's slot back; the request moved into it takes its number
        (``running`` stays ordered by slot: row i of a step is slot i)."""
        moved = self._rt.release(live.slot)
        if moved is not None:
            for other in running:
                if other.slot == moved:
                    other.slot = live.slot
            running.sort(key=lambda r: r.slot)

    @staticmethod
    def _sample(logits: torch.Tensor, req: GenRequest, gen: torch.Generator, top: int) -> int:
        """First token from the prompt's last logits (``top``: their argmax); draws one
        uniform either way, so every mode's generator streams stay aligned."""
        u = float(torch.rand(1, generator=gen, dtype=torch.float64))
        if req.temperature < SAMPLING_EPS:
            return top
        p = process_logits(logits.double(), req.temperature, req.top_p, req.top_k)
        cdf = torch.cumsum(p, 0)
        return int(min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), p.numel() - 1))

    def _draft(self, running: list[Live]) -> DraftBlock:
        """One block per running request (batched: launched on the device, not waited for)."""
        return self._rt.draft([r.req.temperature for r in running], [r.gen for r in running])

    def _step(
        self,
        running: list[Live],
        fct: int,
        run_id: str,
        buf: dict[str, list[dict[str, Any]]],
        result: RunResult,
        pending: list[Callable[[], None]],
        finish: Callable[[Live, str], None],
    ) -> list[Live]:
        """One decode step: draft, plan, verify, accept, commit. Returns the requests that
        finished; their records (and every request's row) are queued on ``pending``, which
        the next step runs while the device drafts (``overlap``) or the caller runs now."""
        cfg, gamma = self.cfg, self.cfg.gamma
        t0 = time.perf_counter()
        events = self._events()
        if events:
            events[0].record()
        bs = len(running)
        block = self._draft(running)
        if events:
            events[1].record()
        if cfg.overlap:
            _run_pending(pending)  # the previous step's records, while the device drafts
        conf = block.confidence.float().cpu().numpy()
        survival = np.cumprod(conf, axis=1)
        draft_tokens = block.tokens.cpu()
        dt_np = draft_tokens.numpy()
        draft_lp = block.logprobs.float().cpu()
        t_draft = time.perf_counter()

        if cfg.mode == "static":
            budget, verify_lens = bs * gamma, np.full(bs, gamma + 1, dtype=np.int64)
            decision = None
        else:
            budget, verify_lens = self.scheduler.plan([r.req.rid for r in running], survival)
            decision = self.scheduler.last_decision
        send = verify_lens if cfg.mode == "compact" else np.full(bs, gamma + 1, dtype=np.int64)
        lengths_before = [self._rt.length(r.slot) for r in running]
        if events:
            events[2].record()
        all_logits, preds = self._verify(running, draft_tokens, verify_lens, send)
        if events:
            events[3].record()
        t_verify = time.perf_counter()
        for i, live in enumerate(running):  # penalties, then min_new_tokens' stop mask
            k = live.masked_rows(int(send[i]))
            if live.counts is not None:
                all_logits[i] = live.req.penalties.apply(all_logits[i], live.counts, dt_np[i])
            if k:
                all_logits[i] = mask_stops(all_logits[i], k, live.stops)
            if k or live.counts is not None:
                preds[i] = all_logits[i].argmax(-1).cpu().numpy()

        done: list[Live] = []
        outcomes: list[tuple[AcceptResult, list[int], list[int], str | None]] = []
        vocab = self.target.cfg.vocab_size
        for i, live in enumerate(running):
            req = live.req
            w, n = int(verify_lens[i]), int(send[i])
            drafts = dt_np[i, : n - 1]
            window = w if cfg.mode == "cap-accept" else None
            if live.greedy:
                res = greedy_accept_argmax(preds[i], drafts, vocab, window=window)
            else:
                probs = process_logits(
                    all_logits[i].double(), req.temperature, req.top_p, req.top_k
                )
                res = accept(
                    probs,
                    drafts,
                    block.probs[i, : n - 1].double(),
                    live.gen,
                    window=window,
                    block_size=gamma,
                )
            full = list(res.tokens)  # uncut by EOS / length: what the estimator resolves against
            remaining = req.max_new_tokens - len(live.output)
            cut, reason = len(full), None
            for j, tok in enumerate(full):
                if live.stops_at(tok):
                    cut, reason = j + 1, "stop"
                    break
            if cut > remaining or (reason is None and cut == remaining):
                cut, reason = remaining, "length"
            committed = full[:cut]
            live.output.extend(committed)
            if live.counts is not None:
                live.counts.add(committed)
            result.committed_tokens += len(committed)
            if self._on_tokens is not None:
                self._on_tokens(req.rid, committed)
            outcomes.append((res, full, committed, reason))
            if reason is not None:
                done.append(live)
                continue
            # Keep anchor + accepted drafts in the caches; the bonus becomes the next anchor.
            keep = res.correct_drafts + 1
            live.anchor = committed[-1]
            self._rt.commit(live.slot, lengths_before[i] + keep, live.anchor)
        t_end = time.perf_counter()

        pred_ms = theta = None
        if decision is not None:
            if decision.predicted_step_seconds is not None:
                pred_ms = decision.predicted_step_seconds * 1000.0
            theta = decision.predicted_theta
        elif cfg.cost_table is not None and not cfg.cost_table.uninitialized:
            pred_ms = cfg.cost_table.step_seconds(bs, int(budget)) * 1000.0
        stats = StepStats(
            forward_ct=fct, bs=bs, budget=int(budget), num_verify_tokens=int(send.sum()),
            predicted_step_ms=pred_ms, predicted_theta=theta,
            step_cpu_ms=(t_end - t0) * 1000.0, ts=datetime.now(UTC),
        )  # fmt: skip
        if not events and self._timed_device:  # a synchronous runtime on a GPU
            stats.draft_gpu_ms = (t_draft - t0) * 1000.0
            stats.target_verify_gpu_ms = (t_verify - t_draft) * 1000.0
        done_step = StepResult(  # a copy of running: the caller removes finished requests
            stats=stats, running=list(running), outcomes=outcomes, verify_lens=verify_lens,
            lengths_before=lengths_before, drafts=dt_np, confidence=conf, survival=survival,
            draft_logprobs=draft_lp, logits=all_logits, adjusted=sglang_adjusts_logits(running),
        )  # fmt: skip

        def records() -> None:
            if events:  # device time of this step's draft and verify passes
                stats.draft_gpu_ms = events[0].elapsed_time(events[1])
                stats.target_verify_gpu_ms = events[2].elapsed_time(events[3])
            buf["steps"].append(stats.row(cfg, run_id))
            buf["req_steps"].extend(
                done_step.req_step_rows(cfg, run_id, self._censors, self._estimator_logprobs)
            )
            for live, (_, _, _, reason) in zip(done_step.running, outcomes, strict=True):
                if reason is not None:
                    finish(live, reason)

        pending.append(records)
        return done

    def _censors(self, live: Live, res: AcceptResult, w: int, adjusted: bool) -> bool:
        """Whether this step's trimmed drafts await resolution: a compact window fully
        accepted with drafts cut off. SGLang's recorder skips greedy / truncated rows, and
        whole steps whose batch ``adjusted`` its logits (penalties, min_new_tokens): their
        pending blocks are dropped too."""
        cfg, req = self.cfg, live.req
        censors = cfg.mode == "compact" and res.correct_drafts == w - 1 and w - 1 < cfg.gamma
        if cfg.estimator_rows == "sglang" and (
            adjusted or sglang_skips_estimator(req.temperature, req.top_k, req.top_p)
        ):
            censors, live.censored = False, []
        return censors

    def _events(self) -> list[Any]:
        """CUDA events around the draft and verify launches (an asynchronous runtime)."""
        if not self._rt.asynchronous:
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
        rt = self._rt
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
