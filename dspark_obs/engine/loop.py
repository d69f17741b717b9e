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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch

from dspark_obs.engine.acceptance import (
    SAMPLING_EPS,
    accept,
    is_truncated,
    process_logits,
    process_logprobs,
)
from dspark_obs.engine.costs import CostTable
from dspark_obs.engine.drafter import Drafter, DrafterCache
from dspark_obs.engine.model import KVCache, Target
from dspark_obs.engine.scheduler import Scheduler
from dspark_obs.schema import MODES

ESTIMATOR_MIN_TEMPERATURE = 1e-5
"""Log-probs for the estimator use ``max(T, 1e-5)`` (SGLang's floor), so greedy rows give
~0 for the argmax and a huge negative value for anything else."""

TARGET_LOGPROB_FLOOR = -1e4
"""Stored in ``pg`` for a trimmed draft that top-k / top-p removed from the target's
distribution (log p = -inf): finite for the store, and ``exp(floor - q_lp) == 0`` exactly."""

ESTIMATOR_ROWS = ("all", "sglang")
"""``all``: estimator fields on every sampling setting (exact: log p of the processed
target distribution). ``sglang``: none on greedy or top-k / top-p rows, as SGLang's recorder."""


class EngineError(ValueError):
    """Bad engine input (mode, gamma, prompt...): raised before anything is written."""


@dataclass(frozen=True)
class EngineConfig:
    """How to run DSpark. ``cost_table=None`` verifies every draft (SGLang's default)."""

    mode: str = "compact"
    gamma: int = 5
    lag_steps: int = 2
    max_batch: int = 16
    cost_table: CostTable | None = None
    dp_rank: int = 0
    flush_every: int = 32  # steps buffered before records are handed to the sinks ...
    flush_seconds: float = 1.0  # ... or this long since the last hand-over, whichever first
    estimator_rows: str = "all"  # see ESTIMATOR_ROWS

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise EngineError(f"unknown mode {self.mode!r}; expected one of {list(MODES)}")
        if self.gamma < 1:
            raise EngineError(f"gamma must be >= 1, got {self.gamma}")
        if self.max_batch < 1:
            raise EngineError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.lag_steps < 0:
            raise EngineError(f"lag_steps must be >= 0, got {self.lag_steps}")
        if self.flush_every < 1:
            raise EngineError(f"flush_every must be >= 1, got {self.flush_every}")
        if not (math.isfinite(self.flush_seconds) and self.flush_seconds > 0):
            raise EngineError(f"flush_seconds must be finite and > 0, got {self.flush_seconds}")
        if self.estimator_rows not in ESTIMATOR_ROWS:
            raise EngineError(
                f"unknown estimator_rows {self.estimator_rows!r}; expected one of "
                f"{list(ESTIMATOR_ROWS)}"
            )


@dataclass
class GenRequest:
    """One request to run: already-tokenized prompt plus its sampling settings."""

    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    workload: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    arrival_step: int = 0
    ignore_eos: bool = False  # run to max_new_tokens (SGLang's sampling_params.ignore_eos)


@dataclass
class _Censored:
    """A compact block whose trimmed drafts await resolution by later target rows."""

    src_fct: int
    start_pos: int  # absolute position of the first trimmed draft
    first_k: int  # its 1-based draft position in the block (SGLang's k): verify_len
    tokens: list[int]
    next_k: int = 0  # offset of the next unresolved trimmed draft


@dataclass
class _Live:
    """Per running request state."""

    req: GenRequest
    cache: KVCache
    dcache: DrafterCache
    gen: torch.Generator
    anchor: int
    output: list[int]
    new_hidden: torch.Tensor | None
    arrival_time: float
    first_token_time: float
    censored: list[_Censored] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.req.temperature < SAMPLING_EPS

    @property
    def truncated(self) -> bool:
        return is_truncated(self.req.top_p, self.req.top_k)


@dataclass
class RunResult:
    """What a run produced, for the caller's summary line."""

    run_id: str
    steps: int = 0
    requests: int = 0
    committed_tokens: int = 0
    target_tokens: int = 0
    seconds: float = 0.0
    outputs: dict[str, list[int]] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.committed_tokens / self.seconds if self.seconds > 0 else 0.0


Emit = Callable[[str, list[dict[str, Any]]], Any]

RequestSource = Callable[[bool], "Sequence[GenRequest] | None"]
"""Polled once per loop iteration by a long-running :meth:`Engine.run` (a server): called
with ``idle=True`` when nothing is running (it may block until requests arrive), returns new
requests (admitted at the current step), or None once closed (the run then drains)."""

OnTokens = Callable[[str, list[int]], Any]
"""Called with a request's id and the tokens it just committed (the prefill token, then each
step's), for streaming; the request's ``requests`` row marks its end."""


class Engine:
    """Runs requests through target + drafter in one verify mode and emits records."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter,
        config: EngineConfig,
        stop_ids: Sequence[int] = (),
    ) -> None:
        if config.gamma > drafter.cfg.gamma_max:
            limit = drafter.cfg.gamma_max
            raise EngineError(f"gamma={config.gamma} exceeds the drafter's trained maximum {limit}")
        self.target = target
        self.drafter = drafter
        self.cfg = config
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.scheduler = Scheduler(config.cost_table, config.gamma, config.lag_steps)
        self._on_tokens: OnTokens | None = None

    # ------------------------------------------------------------------ public

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
        self._on_tokens = on_tokens
        cfg = self.cfg
        self.scheduler.relay.reset()
        waiting = sorted(requests, key=lambda r: (r.arrival_step, r.rid))
        running: list[_Live] = []
        result = RunResult(run_id)
        buf: dict[str, list[dict[str, Any]]] = {"steps": [], "req_steps": [], "requests": []}
        tokens_before = self.target.tokens_processed
        t_start = time.perf_counter()
        last_flush = t_start
        fct = 0

        def finish(live: _Live, reason: str) -> None:
            buf["requests"].append(self._request_row(live, run_id, reason))
            result.outputs[live.req.rid] = live.output
            result.requests += 1
            if progress:
                progress(1)

        with torch.inference_mode():
            while waiting or running or source is not None:
                if source is not None:
                    idle = not waiting and not running
                    if idle:
                        self._flush(emit, buf)  # a blocking poll must not hold records back
                    new = source(idle)
                    if new is None:
                        source = None
                    elif new:
                        self.check(new)
                        for r in new:
                            r.arrival_step = fct
                        waiting = sorted([*waiting, *new], key=lambda r: (r.arrival_step, r.rid))
                    if not waiting and not running:
                        continue
                while waiting and waiting[0].arrival_step <= fct and len(running) < cfg.max_batch:
                    live = self._admit(waiting.pop(0))
                    result.committed_tokens += 1  # the first token comes from the prefill
                    if self._on_tokens is not None:
                        self._on_tokens(live.req.rid, [live.anchor])
                    if live.anchor in self.stop_ids and not live.req.ignore_eos:
                        finish(live, "stop")
                    elif live.req.max_new_tokens == 1:
                        finish(live, "length")
                    else:
                        running.append(live)
                if not running:  # idle until the next arrival
                    fct = max(fct + 1, waiting[0].arrival_step) if waiting else fct + 1
                    continue
                for live, reason in self._step(running, fct, run_id, buf, result):
                    running.remove(live)
                    finish(live, reason)
                result.steps += 1
                fct += 1
                now = time.perf_counter()
                if result.steps % cfg.flush_every == 0 or now - last_flush >= cfg.flush_seconds:
                    self._flush(emit, buf)
                    last_flush = now
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

    def _admit(self, req: GenRequest) -> _Live:
        arrival = time.time()
        gen = torch.Generator(device="cpu").manual_seed(int(req.seed))
        max_len = len(req.prompt_ids) + req.max_new_tokens + self.cfg.gamma + 2
        cache = self.target.new_cache(max_len)
        out = self.target.prefill(req.prompt_ids, cache, self.drafter.hidden_layers)
        logits = out.logits[0][-1]
        first = self._sample(logits, req, gen)
        return _Live(
            req=req,
            cache=cache,
            dcache=self.drafter.new_cache(),
            gen=gen,
            anchor=first,
            output=[first],
            new_hidden=out.hidden[0],
            arrival_time=arrival,
            first_token_time=time.time(),
        )

    @staticmethod
    def _sample(logits: torch.Tensor, req: GenRequest, gen: torch.Generator) -> int:
        """First token from the prompt's last logits; draws one uniform either way."""
        u = float(torch.rand(1, generator=gen, dtype=torch.float64))
        if req.temperature < SAMPLING_EPS:
            return int(torch.argmax(logits))
        p = process_logits(logits.double(), req.temperature, req.top_p, req.top_k)
        cdf = torch.cumsum(p, 0)
        return int(min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), p.numel() - 1))

    def _step(
        self,
        running: list[_Live],
        fct: int,
        run_id: str,
        buf: dict[str, list[dict[str, Any]]],
        result: RunResult,
    ) -> list[tuple[_Live, str]]:
        cfg, gamma = self.cfg, self.cfg.gamma
        t0 = time.perf_counter()
        bs = len(running)
        block = self.drafter.draft_batch(
            [r.dcache for r in running],
            [r.anchor for r in running],
            gamma,
            [r.req.temperature for r in running],
            [r.gen for r in running],
            [r.new_hidden for r in running],
        )
        conf = block.confidence.float().cpu().numpy()
        survival = np.cumprod(conf, axis=1)
        draft_tokens = block.tokens.cpu()
        draft_lp = block.logprobs.float().cpu()
        t_draft = time.perf_counter()

        if cfg.mode == "static":
            budget, verify_lens = bs * gamma, np.full(bs, gamma + 1, dtype=np.int64)
            decision = None
        else:
            budget, verify_lens = self.scheduler.plan([r.req.rid for r in running], survival)
            decision = self.scheduler.last_decision
        send = verify_lens if cfg.mode == "compact" else np.full(bs, gamma + 1, dtype=np.int64)
        lengths_before = [r.cache.length for r in running]
        all_logits, hidden = self._verify(running, draft_tokens, verify_lens, send)
        t_verify = time.perf_counter()

        now = datetime.now(UTC)
        done: list[tuple[_Live, str]] = []
        rows: list[dict[str, Any]] = []
        for i, live in enumerate(running):
            req = live.req
            w = int(verify_lens[i])
            n = int(send[i])
            logits = all_logits[i]  # [n, vocab]
            drafts = draft_tokens[i, : n - 1]
            if live.greedy:
                res = accept(
                    logits, drafts, greedy=True, window=w if cfg.mode == "cap-accept" else None
                )
            else:
                probs = process_logits(logits.double(), req.temperature, req.top_p, req.top_k)
                res = accept(
                    probs,
                    drafts,
                    block.probs[i, : n - 1].double(),
                    live.gen,
                    window=w if cfg.mode == "cap-accept" else None,
                    block_size=gamma,
                )
            full = list(res.tokens)  # uncut by EOS / length: what the estimator resolves against
            censors = cfg.mode == "compact" and res.correct_drafts == w - 1 and w - 1 < gamma
            if cfg.estimator_rows == "sglang" and (live.greedy or live.truncated):
                censors, live.censored = False, []  # SGLang's recorder skips such rows
            logp = None
            if live.censored or censors:
                logp = self._estimator_logprobs(logits, live)
            pg = self._resolve(live, logp, full, lengths_before[i])
            committed = full
            remaining = req.max_new_tokens - len(live.output)
            cut, reason = len(committed), None
            for j, tok in enumerate(committed):
                if tok in self.stop_ids and not req.ignore_eos:
                    cut, reason = j + 1, "stop"
                    break
            if cut > remaining or (reason is None and cut == remaining):
                cut, reason = remaining, "length"
            committed = committed[:cut]
            live.output.extend(committed)
            result.committed_tokens += len(committed)
            if self._on_tokens is not None:
                self._on_tokens(req.rid, committed)
            is_last = reason is not None
            row = {
                "run_id": run_id,
                "dp_rank": cfg.dp_rank,
                "forward_ct": fct,
                "rid": req.rid,
                "gamma": gamma,
                "req_pool_index": i,
                "prefix_len": lengths_before[i] + 1,  # tokens known, anchor included
                "verify_len": w,
                "acc_len": len(committed),
                "correct_drafts": res.correct_drafts,
                "cap_trim": res.cap_trim if cfg.mode == "cap-accept" else 0,
                "bonus_token": res.bonus_token,
                "draft_tokens": draft_tokens[i].tolist(),
                "confidence": conf[i].tolist(),
                "survival": survival[i].tolist(),
                "workload": req.workload,
                "temperature": req.temperature,
                "top_p": req.top_p,
                "top_k": req.top_k,
                "is_last": is_last,
                "ts": now,
                "pg": pg or None,
                "trimmed_tokens": None,
                "q_lp": None,
            }
            if censors:
                trimmed = draft_tokens[i, w - 1 :].tolist()
                row["trimmed_tokens"] = trimmed
                # Greedy drafts are the drafter's argmax: log q at T -> 0 is 0.
                row["q_lp"] = [0.0] * len(trimmed) if live.greedy else draft_lp[i, w - 1 :].tolist()
                blk = _Censored(fct, lengths_before[i] + w, w, trimmed)
                # The first trimmed draft sits where this step's bonus landed: resolve it now.
                extra = self._resolve_block(blk, logp, full, lengths_before[i])
                if extra:
                    row["pg"] = (row["pg"] or []) + extra
                if blk.next_k < len(blk.tokens):
                    live.censored.append(blk)
            rows.append(row)
            if is_last:
                done.append((live, reason or "length"))
                continue
            # Keep anchor + accepted drafts in the caches; the bonus becomes the next anchor.
            keep = res.correct_drafts + 1
            live.cache.truncate(lengths_before[i] + keep)
            live.new_hidden = hidden[i][:keep]
            live.anchor = committed[-1]

        t_end = time.perf_counter()
        num_verify = int(send.sum())
        pred_ms = theta = None
        if decision is not None:
            if decision.predicted_step_seconds is not None:
                pred_ms = decision.predicted_step_seconds * 1000.0
            theta = decision.predicted_theta
        buf["steps"].append(
            {
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
                "draft_gpu_ms": (t_draft - t0) * 1000.0 if self._timed_device else None,
                "target_verify_gpu_ms": (t_verify - t_draft) * 1000.0
                if self._timed_device
                else None,
                "ts": now,
            }
        )
        buf["req_steps"].extend(rows)
        return done

    def _verify(
        self, running: list[_Live], drafts: torch.Tensor, verify_lens: np.ndarray, send: np.ndarray
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One packed target forward over each request's ``send`` tokens: (logits, hidden).

        cap-accept runs it as two forwards: first exactly the windows compact would send
        (so everything committed, and the drafter features, are bitwise those of the compact
        run, whatever the floating-point effects of a wider batch), then the trimmed drafts
        on top of the same caches, which only serve to count ``cap_trim``.
        """
        caches = [r.cache for r in running]
        head = verify_lens if self.cfg.mode == "cap-accept" else send
        tokens = [
            torch.cat([torch.tensor([r.anchor]), drafts[i, : head[i] - 1]])
            for i, r in enumerate(running)
        ]
        out = self.target.forward(tokens, caches, self.drafter.hidden_layers)
        logits = list(out.logits)
        rest = [i for i in range(len(running)) if head[i] < send[i]]
        if rest:
            tail = self.target.forward(
                [drafts[i, head[i] - 1 : send[i] - 1] for i in rest], [caches[i] for i in rest]
            )
            for j, i in enumerate(rest):
                logits[i] = torch.cat([logits[i], tail.logits[j]])
        return logits, out.hidden

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

    def _resolve(
        self, live: _Live, logp: torch.Tensor | None, tokens: list[int], prefix_len: int
    ) -> list[dict[str, Any]]:
        """Resolve earlier censored blocks (oldest first) against this step's target rows."""
        entries: list[dict[str, Any]] = []
        still: list[_Censored] = []
        for blk in live.censored:
            entries.extend(self._resolve_block(blk, logp, tokens, prefix_len))
            if blk.next_k < len(blk.tokens):
                still.append(blk)
        live.censored = still
        return entries

    @staticmethod
    def _resolve_block(
        blk: _Censored, logp: torch.Tensor | None, tokens: list[int], prefix_len: int
    ) -> list[dict[str, Any]]:
        """Walk the block's trimmed drafts over this step's rows; stop after the first miss.

        Row ``r`` of this step's target output predicts absolute position ``prefix_len+1+r``
        (``prefix_len`` is the anchor's position), whose realized token is ``tokens[r]``
        (accepted drafts then the bonus, before any EOS / length cut).
        """
        entries = []
        while blk.next_k < len(blk.tokens) and logp is not None:
            r = blk.start_pos + blk.next_k - (prefix_len + 1)
            if r < 0 or r >= len(tokens):
                break
            draft = blk.tokens[blk.next_k]
            realized = tokens[r]
            entries.append(
                {
                    "src_fct": blk.src_fct,
                    "k": blk.first_k + blk.next_k,
                    "target_logprob": max(float(logp[r, draft]), TARGET_LOGPROB_FLOOR),
                    "draft_token": draft,
                    "realized_token": realized,
                }
            )
            blk.next_k += 1
            if realized != draft:
                blk.next_k = len(blk.tokens)  # diverged: the rest can never be resolved
                break
        return entries

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
