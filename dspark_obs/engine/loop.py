"""The embedded DSpark decode loop: continuous batching and the request lifecycle.

Each loop iteration:

1. applies cancels and polls the request ``source`` (a server's queue);
2. admits arrivals (prefill: the first token comes from the prompt's last logits);
3. runs one decode step for the running batch (:class:`~dspark_obs.engine.step.StepPipeline`:
   draft, plan windows, verify with one packed target forward, accept, commit);
4. frees the slots of finished requests and hands records over when due.

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
which.

Records are column-wise and leave the decode thread: each step hands its arrays to the run's
:class:`~dspark_obs.engine.step_records.StepRecordBuilder`; every ``flush_every`` steps or
``flush_seconds`` (default 1 s) after the previous hand-over, whichever comes first, the
steps taken so far go to a :class:`~dspark_obs.engine.step_records.RecordWorker`, whose
thread builds the ``steps`` / ``req_steps`` Arrow tables and calls ``emit`` with them (then
with the ``requests`` rows of the requests that finished in those steps). Its queue is
bounded: a full one makes the decode loop wait, counted in ``RunResult.records`` (measured
backpressure, never a drop). ``run`` returns once everything was emitted; a kill loses at
most about a second of steps that were not yet handed over.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import torch

from dspark_obs.engine.acceptance import SAMPLING_EPS, process_logits
from dspark_obs.engine.drafter import Drafter
from dspark_obs.engine.live import FirstTokens, Live, mask_stops
from dspark_obs.engine.model import Target
from dspark_obs.engine.penalties import OutputCounts, penalty_error
from dspark_obs.engine.runtime import Runtime, engine_runtime, uses_batched
from dspark_obs.engine.scheduler import Scheduler
from dspark_obs.engine.step import (
    StepIO,
    StepPipeline,
    land_first_tokens,
    opens_censored,
    run_pending,
)
from dspark_obs.engine.step_records import RecordWorker, StepRecordBuilder
from dspark_obs.engine.step_rows import request_row, waiting_row
from dspark_obs.engine.types import (
    Emit,
    EngineConfig,
    EngineError,
    GenRequest,
    OnTokens,
    RequestSource,
    RunResult,
)

__all__ = ["Engine"]

Row = dict[str, Any]


class _Handover:
    """A run's way out for records: steps go to the record builder as the loop runs; the
    ``requests`` rows of finished requests wait here; :meth:`flush` hands both to the worker
    (which emits steps, req_steps, then requests, in hand-over order)."""

    def __init__(self, worker: RecordWorker) -> None:
        self.worker = worker
        self.builder = worker.builder
        self.requests: list[Row] = []

    def flush(self) -> None:
        rows, self.requests = self.requests, []
        self.worker.flush(then=[("requests", rows)] if rows else ())

    def close(self, ok: bool) -> None:
        """``ok``: everything is emitted, a worker failure raised. After a failure of the run,
        the steps not handed over are dropped and a worker failure is left to the run's."""
        if ok:
            self.worker.close()
            return
        self.builder.take()
        with contextlib.suppress(Exception):  # the run's own exception is the one raised
            self.worker.close()


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
        return uses_batched(self.cfg)

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
        self.scheduler.reset()
        waiting = sorted(requests, key=lambda r: (r.arrival_step, r.rid))
        self._prepare(requests, start=True)
        cfg = self.cfg
        builder = StepRecordBuilder(
            run_id, mode=cfg.mode, gamma=cfg.gamma, lag_steps=cfg.lag_steps, dp_rank=cfg.dp_rank
        )
        out = _Handover(RecordWorker(builder, emit))
        pipeline = StepPipeline(
            self.target, cfg, self.scheduler, self._rt, on_tokens, self._censors
        )
        ok = False
        try:
            result = self._loop(waiting, out, run_id, progress, source, pipeline)
            ok = True
        finally:
            if self._runtime is not None:
                self._runtime.busy = False
            out.close(ok)  # after a failure: what was handed over is emitted, nothing more
        result.records = out.worker.stats
        return result

    def _loop(
        self,
        waiting: list[GenRequest],
        out: _Handover,
        run_id: str,
        progress: Callable[[int], None] | None,
        source: RequestSource | None,
        pipeline: StepPipeline,
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
            out.requests.append(request_row(live, self.cfg, run_id, reason))
            result.outputs[live.req.rid] = live.output
            result.requests += 1
            if progress:
                progress(1)

        def settle() -> None:
            run_pending(pending)

        def retire(done: list[Live]) -> None:  # finished in a step: free their slots
            for live in sorted(done, key=lambda d: -d.slot):  # highest slot first
                running.remove(live)
                self._release(live, running)

        io = StepIO(result, pending, finish, out.builder.add, retire)

        def drop(req: GenRequest) -> None:  # a waiting request aborted before admission
            out.requests.append(waiting_row(req, self.cfg, run_id))
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
                        out.flush()  # a blocking poll must not hold records back
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
                for live in sorted(self._admit(arrived, out.builder), key=lambda x: -x.slot):
                    result.committed_tokens += 1  # the first token comes from the prefill
                    if live.first is not None:  # still on the device: booked when read
                        kept.append(live)
                        continue
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
                pipeline.step(running, fct, io)
                if not cfg.overlap:
                    settle()
                result.steps += 1
                fct += 1
                now = self.clock()
                if result.steps % cfg.flush_every == 0 or now - last_flush >= cfg.flush_seconds:
                    settle()
                    out.flush()
                    last_flush = now
        settle()
        out.flush()
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

    def _admit(self, reqs: Sequence[GenRequest], builder: StepRecordBuilder) -> list[Live]:
        """Prefill arrivals (one packed forward for all of them on the batched backend),
        sample each one's first token, and register each with the run's record ``builder``.
        Where :meth:`_first_on_device` allows, the first tokens (the prefill's argmax) stay on
        the device: drafts start from them there, and the host books each when it reads the
        first step that ran the request (:func:`~dspark_obs.engine.step.land_first_tokens`)."""
        if not reqs:
            return []
        rt = self._rt
        arrival = time.time()
        slots = [rt.acquire() for _ in reqs]
        logits = rt.prefill(slots, [r.prompt_ids for r in reqs])
        kept: FirstTokens | None = None
        if self._first_on_device(reqs):
            argmax_on_device = logits.argmax(-1)
            rt.set_first_anchors(slots, argmax_on_device)
            kept = FirstTokens(argmax_on_device)
            argmax = [-1] * len(reqs)  # unknown here: every row is greedy and unmasked
        else:
            argmax = logits.argmax(-1).tolist()
        lives = []
        for i, (req, logits_row, slot, top) in enumerate(
            zip(reqs, logits, slots, argmax, strict=True)
        ):
            gen = torch.Generator(device="cpu").manual_seed(int(req.seed))
            stops = self.stop_ids | frozenset(int(t) for t in req.stop_token_ids)
            if req.min_new_tokens > 0:  # the first token is output token 0: masked
                logits_row = mask_stops(logits_row[None], 1, stops)[0]
                top = int(torch.argmax(logits_row))
            first = self._sample(logits_row, req, gen, top)  # its one draw either way
            if kept is None:
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
                    output=[first] if kept is None else [],
                    arrival_time=arrival,
                    first_token_time=time.time() if kept is None else math.nan,
                    slot=slot,
                    stops=stops,
                    counts=counts,
                    rec=builder.register(
                        req.rid, workload=req.workload, temperature=req.temperature,
                        top_p=req.top_p, top_k=req.top_k,
                    ),  # fmt: skip
                    first=None if kept is None else (kept, i),
                )
            )
        return lives

    def _first_on_device(self, reqs: Sequence[GenRequest]) -> bool:
        """Whether these arrivals' first tokens stay on the device: every one greedy, with
        nothing that reads the first token on the host before a step (a ``min_new_tokens``
        mask, penalties, a single-token request); one that does makes the whole admission
        read its argmax, which is one wait either way."""
        wanted = self.cfg.first_token_on_device
        if not (self._rt.asynchronous if wanted is None else wanted):
            return False
        return all(
            r.temperature < SAMPLING_EPS and r.min_new_tokens == 0 and not r.penalties.active
            and r.max_new_tokens > 1
            for r in reqs
        )  # fmt: skip

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
            land_first_tokens(hit, self._on_tokens)
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

    def _censors(self, live: Live, correct_drafts: int, w: int, adjusted: bool) -> bool:
        """The censored-block rule the run's steps apply (:func:`~dspark_obs.engine.step.
        opens_censored`); a subclass may widen it (``bench/bench_estimator_sweep.py`` gives a
        cap-accept companion compact's estimator fields)."""
        return opens_censored(self.cfg, live, correct_drafts, w, adjusted)

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
