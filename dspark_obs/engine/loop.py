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
top-k / top-p), so the estimator is exact for every sampling setting; SGLang skips greedy and
truncated rows instead (``EngineConfig(estimator_rows="sglang")`` does the same).

Records reach ``emit`` every ``flush_every`` steps or ``flush_seconds`` (default 1 s) after
the previous hand-over, whichever comes first, so live readers see progress and a kill loses
at most about a second of steps that were not yet handed over.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch

from dspark_obs.engine.acceptance import (
    SAMPLING_EPS,
    AcceptResult,
    accept,
    greedy_accept_argmax,
    is_truncated,
    process_logits,
    process_logprobs,
)
from dspark_obs.engine.censored import (
    ESTIMATOR_MIN_TEMPERATURE,
    Censored,
    LogpAt,
    greedy_logprobs_at,
    resolve,
    resolve_block,
)
from dspark_obs.engine.drafter import DraftBlock, Drafter, DrafterCache
from dspark_obs.engine.model import KVCache, Target
from dspark_obs.engine.scheduler import Scheduler
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


def _mask_stops(logits: torch.Tensor, rows: int, stops: frozenset[int]) -> torch.Tensor:
    """``logits`` with the stop ids of its first ``rows`` rows set to ``MASKED_LOGIT`` (a copy:
    batched step outputs are static buffers). Applied to the target rows before acceptance,
    so greedy verification and rejection sampling both stay exact for the masked target."""
    if rows <= 0 or not stops:
        return logits
    out = logits.clone()
    ids = torch.tensor(sorted(stops), device=logits.device)
    out[:rows, ids] = MASKED_LOGIT
    return out


def _run_pending(pending: list[Callable[[], None]]) -> None:
    """Run queued record work in order (a step's records, then the next step's)."""
    while pending:
        pending.pop(0)()


@dataclass
class _Live:
    """Per running request state."""

    req: GenRequest
    cache: KVCache | None  # reference backend; the batched one keeps caches in its pool
    dcache: DrafterCache | None
    gen: torch.Generator
    anchor: int
    output: list[int]
    new_hidden: torch.Tensor | None
    arrival_time: float
    first_token_time: float
    censored: list[Censored] = field(default_factory=list)
    slot: int = -1  # batched backend: the pool slot (== index in the running batch)
    stops: frozenset[int] = frozenset()  # the engine's EOS ids + the request's stop ids

    def masked_rows(self, rows: int) -> int:
        """How many of the next ``rows`` output positions still fall under
        ``min_new_tokens`` (row j produces output token ``len(output) + j``)."""
        return max(0, min(rows, self.req.min_new_tokens - len(self.output)))

    def stops_at(self, token: int) -> bool:
        """Whether committing ``token`` finishes the request (SGLang: ``ignore_eos`` turns
        every stop id off, the request's own included)."""
        return token in self.stops and not self.req.ignore_eos

    @property
    def greedy(self) -> bool:
        return self.req.temperature < SAMPLING_EPS

    @property
    def truncated(self) -> bool:
        return is_truncated(self.req.top_p, self.req.top_k)


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
        self._runtime: Any = None  # BatchedRuntime, made on the first run (batched backend)
        self._sts_rows: tuple[np.ndarray, np.ndarray] = (np.ones(0), np.ones(0))
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
        if self.cfg.backend == "auto":
            return self.target.device.type == "cuda"
        return self.cfg.backend == "batched"

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
        running: list[_Live] = []
        result = RunResult(run_id)
        tokens_before = self.target.tokens_processed
        t_start = time.perf_counter()
        last_flush = self.clock()
        fct = 0
        pending: list[Callable[[], None]] = []  # record work of the last step (overlapped)

        def finish(live: _Live, reason: str) -> None:
            buf["requests"].append(self._request_row(live, run_id, reason))
            result.outputs[live.req.rid] = live.output
            result.requests += 1
            if progress:
                progress(1)

        def settle() -> None:
            _run_pending(pending)

        def drop(req: GenRequest) -> None:  # a waiting request aborted before admission
            buf["requests"].append(self._waiting_row(req, run_id))
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
                kept: list[_Live] = []
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
                if not cfg.overlap or self._runtime is None:
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
        """Batched backend: a slot pool with room for these requests. The runtime is shared
        across runs and engines on this target (:func:`~dspark_obs.engine.batched.
        shared_runtime`), so CUDA graphs are captured once; it grows when a request needs
        more room."""
        if not self.batched:
            return
        from dspark_obs.engine.batched import shared_runtime

        need = max((len(r.prompt_ids) + r.max_new_tokens for r in requests), default=0)
        need = max(need + self.drafter.cfg.gamma_max + self.cfg.gamma + 2, 256)
        if start:  # one runtime per run: this engine's last one when it is free again
            from dspark_obs.engine.batched import BATCH_TIERS, TOKEN_TIERS

            cfg = self.cfg
            self._runtime = shared_runtime(
                self.target, self.drafter, max_batch=cfg.max_batch, max_len=need,
                gamma=cfg.gamma, cuda_graphs=cfg.cuda_graphs, compiled=cfg.compile,
                token_tiers=cfg.token_tiers or TOKEN_TIERS,
                batch_tiers=cfg.batch_tiers or BATCH_TIERS, prefer=self._runtime,
            )
            if cfg.capture_graphs:
                self._runtime.capture(need, lambda line: print(line, file=sys.stderr))
            self._sts_rows = (
                self.drafter.sts(self.cfg.gamma).float().numpy(),
                self.drafter.sts(self.cfg.gamma, greedy=True).float().numpy(),
            )
        self._runtime.reserve(self.cfg.max_batch, need)

    def _admit(self, reqs: Sequence[GenRequest]) -> list[_Live]:
        """Prefill arrivals (one packed forward for all of them on the batched backend) and
        sample each one's first token."""
        if not reqs:
            return []
        rt = self._runtime
        arrival = time.time()
        if rt is not None:
            slots = [rt.acquire() for _ in reqs]
            logits = rt.prefill(slots, [r.prompt_ids for r in reqs])
            argmax = logits.argmax(-1).tolist()
            rows: list[tuple[torch.Tensor, torch.Tensor | None, KVCache | None, int]] = [
                (logits[j], None, None, s) for j, s in enumerate(slots)
            ]
        else:
            rows, argmax = [], []
            for r in reqs:
                max_len = len(r.prompt_ids) + r.max_new_tokens + self.cfg.gamma + 2
                # check() admits need <= context: never allocate past it (the batched pool
                # clamps the same way), or a request at the edge fails after its runs row.
                cache = self.target.new_cache(min(max_len, self.target.cfg.max_position))
                out = self.target.prefill(r.prompt_ids, cache, self.drafter.hidden_layers)
                rows.append((out.logits[0][-1], out.hidden[0], cache, -1))
                argmax.append(int(torch.argmax(out.logits[0][-1])))
        lives = []
        for req, (logits_row, hidden, cache, slot), top in zip(reqs, rows, argmax, strict=True):
            gen = torch.Generator(device="cpu").manual_seed(int(req.seed))
            stops = self.stop_ids | frozenset(int(t) for t in req.stop_token_ids)
            if req.min_new_tokens > 0:  # the first token is output token 0: masked
                logits_row = _mask_stops(logits_row[None], 1, stops)[0]
                top = int(torch.argmax(logits_row))
            first = self._sample(logits_row, req, gen, top)
            if rt is not None:
                rt.set_anchor(slot, first)
            lives.append(
                _Live(
                    req=req,
                    cache=cache,
                    dcache=self.drafter.new_cache() if rt is None else None,
                    gen=gen,
                    anchor=first,
                    output=[first],
                    new_hidden=hidden,
                    arrival_time=arrival,
                    first_token_time=time.time(),
                    slot=slot,
                    stops=stops,
                )
            )
        return lives

    def _abort(
        self,
        rids: set[str],
        waiting: list[GenRequest],
        running: list[_Live],
        settle: Callable[[], None],
        finish: Callable[[_Live, str], None],
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

    def _release(self, live: _Live, running: list[_Live]) -> None:
        """Give a finished request's slot back; the request moved into it takes its number
        (``running`` stays ordered by slot: row i of a batched step is slot i)."""
        if self._runtime is None:
            return
        moved = self._runtime.release(live.slot)
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

    def _draft(self, running: list[_Live]) -> DraftBlock:
        """One block per running request (batched: launched on the device, not waited for)."""
        gamma, rt = self.cfg.gamma, self._runtime
        temps = [r.req.temperature for r in running]
        gens = [r.gen for r in running]
        if rt is not None:
            sample_sts, greedy_sts = self._sts_rows
            sts = np.stack([greedy_sts if t <= 0 else sample_sts for t in temps])
            return rt.draft(temps, sts, gens)
        hidden = [r.new_hidden for r in running]
        return self.drafter.draft_batch(
            [r.dcache for r in running], [r.anchor for r in running], gamma, temps, gens, hidden
        )

    def _step(
        self,
        running: list[_Live],
        fct: int,
        run_id: str,
        buf: dict[str, list[dict[str, Any]]],
        result: RunResult,
        pending: list[Callable[[], None]],
        finish: Callable[[_Live, str], None],
    ) -> list[_Live]:
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
        lengths_before = [self._cache_length(r) for r in running]
        if events:
            events[2].record()
        all_logits, preds, hidden = self._verify(running, draft_tokens, verify_lens, send)
        if events:
            events[3].record()
        t_verify = time.perf_counter()
        for i, live in enumerate(running):  # min_new_tokens: stop ids masked in the target
            k = live.masked_rows(int(send[i]))
            if k:
                all_logits[i] = _mask_stops(all_logits[i], k, live.stops)
                if preds is not None:
                    preds[i] = all_logits[i].argmax(-1).cpu().numpy()

        done: list[_Live] = []
        outcomes: list[tuple[AcceptResult, list[int], list[int], str | None]] = []
        vocab = self.target.cfg.vocab_size
        for i, live in enumerate(running):
            req = live.req
            w, n = int(verify_lens[i]), int(send[i])
            drafts = dt_np[i, : n - 1]
            window = w if cfg.mode == "cap-accept" else None
            if live.greedy and preds is not None:
                res = greedy_accept_argmax(preds[i], drafts, vocab, window=window)
            elif live.greedy:
                res = accept(all_logits[i], drafts, greedy=True, window=window)
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
            if self._runtime is not None:
                self._runtime.commit(live.slot, lengths_before[i] + keep, live.anchor)
            else:
                assert live.cache is not None
                live.cache.truncate(lengths_before[i] + keep)
                live.new_hidden = hidden[i][:keep]
        t_end = time.perf_counter()

        num_verify = int(send.sum())
        pred_ms = theta = None
        if decision is not None:
            if decision.predicted_step_seconds is not None:
                pred_ms = decision.predicted_step_seconds * 1000.0
            theta = decision.predicted_theta
        elif cfg.cost_table is not None and not cfg.cost_table.uninitialized:
            pred_ms = cfg.cost_table.step_seconds(bs, int(budget)) * 1000.0
        step = {
            "run_id": run_id,
            "dp_rank": cfg.dp_rank,
            "forward_ct": fct,
            "source": "engine",
            "mode": cfg.mode,
            "bs": bs,
            "budget": int(budget),
            "lag_steps": cfg.lag_steps,
            "num_running_reqs": bs,
            "num_verify_tokens": num_verify,
            "verify_tokens_local": num_verify,
            "predicted_step_ms": pred_ms,
            "predicted_theta": theta,
            "step_cpu_ms": (t_end - t0) * 1000.0,
            "draft_gpu_ms": None,
            "target_verify_gpu_ms": None,
            "ts": datetime.now(UTC),
        }
        if not events and self._timed_device:  # reference path on a GPU: synchronous calls
            step["draft_gpu_ms"] = (t_draft - t0) * 1000.0
            step["target_verify_gpu_ms"] = (t_verify - t_draft) * 1000.0

        running_now = list(running)  # the caller removes finished requests from ``running``

        def records() -> None:
            if events:  # device time of this step's draft and verify passes
                step["draft_gpu_ms"] = events[0].elapsed_time(events[1])
                step["target_verify_gpu_ms"] = events[2].elapsed_time(events[3])
            buf["steps"].append(step)
            lookups = self._gather_logprobs(running_now, outcomes, verify_lens, dt_np, all_logits)
            rows = [
                self._req_step_row(
                    live, i, fct, run_id, step["ts"], outcomes[i], lookups[i],
                    int(verify_lens[i]), lengths_before[i], dt_np[i], conf[i],
                    survival[i], draft_lp[i],
                )
                for i, live in enumerate(running_now)
            ]
            buf["req_steps"].extend(rows)
            for live, (_, _, _, reason) in zip(running_now, outcomes, strict=True):
                if reason is not None:
                    finish(live, reason)

        pending.append(records)
        return done

    def _req_step_row(
        self,
        live: _Live,
        i: int,
        fct: int,
        run_id: str,
        ts: datetime,
        outcome: tuple[AcceptResult, list[int], list[int], str | None],
        logp: Any,
        w: int,
        prefix: int,
        drafts: np.ndarray,
        conf: np.ndarray,
        survival: np.ndarray,
        draft_lp: torch.Tensor,
    ) -> dict[str, Any]:
        """The ``req_steps`` row of one request in one step, with the estimator's fields:
        earlier censored blocks resolved against this step's target rows, and this step's
        trimmed drafts (``trimmed_tokens`` / ``q_lp``) when its window was fully accepted."""
        cfg, gamma, req = self.cfg, self.cfg.gamma, live.req
        res, full, committed, reason = outcome
        censors = self._censors(live, res, w)
        pg, live.censored = resolve(live.censored, logp, full, prefix)
        row = {
            "run_id": run_id,
            "dp_rank": cfg.dp_rank,
            "forward_ct": fct,
            "rid": req.rid,
            "gamma": gamma,
            "req_pool_index": live.slot if live.slot >= 0 else i,
            "prefix_len": prefix + 1,  # tokens known, anchor included
            "verify_len": w,
            "acc_len": len(committed),
            "correct_drafts": res.correct_drafts,
            "cap_trim": res.cap_trim if cfg.mode == "cap-accept" else 0,
            "bonus_token": res.bonus_token,
            "draft_tokens": drafts.tolist(),
            "confidence": conf.tolist(),
            "survival": survival.tolist(),
            "workload": req.workload,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "is_last": reason is not None,
            "ts": ts,
            "pg": pg or None,
            "trimmed_tokens": None,
            "q_lp": None,
        }
        if censors:
            trimmed = drafts[w - 1 :].tolist()
            row["trimmed_tokens"] = trimmed
            # Greedy drafts are the drafter's argmax: log q at T -> 0 is 0.
            row["q_lp"] = [0.0] * len(trimmed) if live.greedy else draft_lp[w - 1 :].tolist()
            blk = Censored(fct, prefix + w, w, trimmed)
            # The first trimmed draft sits where this step's bonus landed: resolve it now.
            extra = resolve_block(blk, logp, full, prefix)
            if extra:
                row["pg"] = (row["pg"] or []) + extra
            if blk.next_k < len(blk.tokens):
                live.censored.append(blk)
        return row

    def _censors(self, live: _Live, res: AcceptResult, w: int) -> bool:
        """Whether this step's trimmed drafts await resolution: a compact window fully
        accepted with drafts cut off (SGLang's recorder skips greedy / truncated rows)."""
        cfg = self.cfg
        censors = cfg.mode == "compact" and res.correct_drafts == w - 1 and w - 1 < cfg.gamma
        if cfg.estimator_rows == "sglang" and (live.greedy or live.truncated):
            censors, live.censored = False, []
        return censors

    def _gather_logprobs(
        self,
        running: list[_Live],
        outcomes: list[tuple[AcceptResult, list[int], list[int], str | None]],
        verify_lens: np.ndarray,
        drafts: np.ndarray,
        logits: list[torch.Tensor],
    ) -> list[Any]:
        """Per request, log p of the target rows where the estimator needs it (None where it
        does not): the whole processed row on the reference backend; on the batched one
        only the columns of the drafts still awaiting resolution, gathered on the device for
        every request and moved to the host in one transfer (no sync per entry)."""
        out: list[Any] = [None] * len(running)
        wanted: list[tuple[int, list[int]]] = []
        for i, live in enumerate(running):
            w = int(verify_lens[i])
            censors = self._censors(live, outcomes[i][0], w)
            if not (live.censored or censors):
                continue
            if self._runtime is None:
                out[i] = self._estimator_logprobs(logits[i], live)
                continue
            cols = {int(t) for blk in live.censored for t in blk.tokens[blk.next_k :]}
            if censors:
                cols.update(int(t) for t in drafts[i, w - 1 :])
            wanted.append((i, sorted(cols)))
        if wanted:
            self._gather_at(running, wanted, logits, out)
        return out

    def _gather_at(
        self,
        running: list[_Live],
        wanted: list[tuple[int, list[int]]],
        logits: list[torch.Tensor],
        out: list[Any],
    ) -> None:
        """log p at (row, column) pairs for the requests in ``wanted``: the greedy ones in a
        handful of kernels over all their rows, the sampled ones through their processed
        distribution; one device-to-host copy for all."""
        greedy = [(i, cols) for i, cols in wanted if running[i].greedy]
        sampled = [(i, cols) for i, cols in wanted if not running[i].greedy]
        parts = []
        if greedy:
            parts.append(greedy_logprobs_at([logits[i] for i, _ in greedy], [c for _, c in greedy]))
        for i, cols in sampled:
            idx = torch.tensor(cols, device=logits[i].device)
            parts.append(self._estimator_logprobs(logits[i], running[i])[:, idx].reshape(-1))
        flat = torch.cat(parts).cpu().numpy()
        at = 0
        for i, cols in greedy + sampled:
            n = logits[i].shape[0] * len(cols)
            out[i] = LogpAt(flat[at : at + n].reshape(-1, len(cols)), cols)
            at += n

    def _cache_length(self, live: _Live) -> int:
        if self._runtime is not None:
            return self._runtime.length(live.slot)
        assert live.cache is not None
        return live.cache.length

    def _events(self) -> list[Any]:
        """CUDA events around the draft and verify launches (batched backend on a GPU)."""
        if self._runtime is None or not self._timed_device:
            return []
        return [torch.cuda.Event(enable_timing=True) for _ in range(4)]

    def _verify(
        self, running: list[_Live], drafts: torch.Tensor, verify_lens: np.ndarray, send: np.ndarray
    ) -> tuple[list[torch.Tensor], list[np.ndarray] | None, list[torch.Tensor]]:
        """One packed target forward over each request's ``send`` tokens: (logits per
        request, device argmax per request on the batched backend, drafter features on the
        reference one).

        cap-accept runs it as two forwards: first exactly the windows compact would send
        (so everything committed, and the drafter features, are bitwise those of the compact
        run, whatever the floating-point effects of a wider batch), then the trimmed drafts
        on top of the same caches, which only serve to count ``cap_trim``.
        """
        head = verify_lens if self.cfg.mode == "cap-accept" else send
        rest = [i for i in range(len(running)) if head[i] < send[i]]
        rt = self._runtime
        if rt is not None:
            rows = [[r.anchor, *drafts[i, : head[i] - 1].tolist()] for i, r in enumerate(running)]
            out = rt.forward([r.slot for r in running], rows)
            logits, preds = out.split()
            if rest:
                for i in rest:
                    logits[i] = logits[i].clone()  # the tail forward may reuse the buffers
                tails = [drafts[i, head[i] - 1 : send[i] - 1].tolist() for i in rest]
                tail_logits, tail_preds = rt.forward([running[i].slot for i in rest], tails).split()
                for j, i in enumerate(rest):
                    logits[i] = torch.cat([logits[i], tail_logits[j]])
                    preds[i] = np.concatenate([preds[i], tail_preds[j]])
            return logits, preds, []
        caches = [r.cache for r in running]
        tokens = [
            torch.cat([torch.tensor([r.anchor]), drafts[i, : head[i] - 1]])
            for i, r in enumerate(running)
        ]
        ref = self.target.forward(tokens, caches, self.drafter.hidden_layers)
        logits = list(ref.logits)
        if rest:
            tail = self.target.forward(
                [drafts[i, head[i] - 1 : send[i] - 1] for i in rest], [caches[i] for i in rest]
            )
            for j, i in enumerate(rest):
                logits[i] = torch.cat([logits[i], tail.logits[j]])
        return logits, None, list(ref.hidden)

    @staticmethod
    def _estimator_logprobs(logits: torch.Tensor, live: _Live) -> torch.Tensor:
        """log p of the distribution acceptance used (processed: temperature, top-k, top-p)."""
        req = live.req
        if live.greedy:  # one-hot whatever the filters; SGLang's temperature floor
            return torch.log_softmax(logits.double() / ESTIMATOR_MIN_TEMPERATURE, dim=-1)
        return process_logprobs(logits, req.temperature, req.top_p, req.top_k)

    @property
    def _timed_device(self) -> bool:
        return self.target.device.type == "cuda"

    def _waiting_row(self, req: GenRequest, run_id: str) -> dict[str, Any]:
        """The ``requests`` row of a request aborted before it was admitted (no tokens)."""
        now = time.time()
        return {
            "run_id": run_id,
            "rid": req.rid,
            "dp_rank": self.cfg.dp_rank,
            "workload": req.workload,
            "prompt": req.prompt,
            "prompt_tokens": len(req.prompt_ids),
            "output_tokens": [],
            "completion_tokens": 0,
            "finish_reason": "abort",
            "max_new_tokens": req.max_new_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "seed": req.seed,
            "arrival_time": now,
            "first_token_time": None,
            "finish_time": now,
        }

    def _request_row(self, live: _Live, run_id: str, reason: str) -> dict[str, Any]:
        req = live.req
        return {
            "run_id": run_id,
            "rid": req.rid,
            "dp_rank": self.cfg.dp_rank,
            "workload": req.workload,
            "prompt": req.prompt,
            "prompt_tokens": len(req.prompt_ids),
            "output_tokens": live.output,
            "completion_tokens": len(live.output),
            "finish_reason": reason,
            "max_new_tokens": req.max_new_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "seed": req.seed,
            "arrival_time": live.arrival_time,
            "first_token_time": live.first_token_time,
            "finish_time": time.time(),
        }
