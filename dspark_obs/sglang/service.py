"""The embedded engine run as a long-lived service that speaks SGLang's DSpark surfaces.

One engine thread runs :meth:`Engine.run` for the service's lifetime, fed by a queue that
HTTP handlers fill (the loop's ``source`` hook) and streaming tokens back through
``on_tokens``. The records it emits become what an SGLang DSpark server exposes:

* the step dump (``dspark_info_record``): DecodeStepRecord / ReqDetail, fields at their
  default left out, confidence and survival rounded to 4 decimals, a ring buffer of
  ``max_records`` (SGLang: 200,000) that ``clear_records`` empties;
* the block-accept estimator JSONL (compact mode, pure-temperature sampled rows only, as
  SGLang writes it; flushed every 16 steps);
* per-request ``meta_info`` spec fields, and the ``sglang:*`` gauges (means over each
  ``log_interval`` decode steps) plus the ``sglang:spec_verify_calls_total`` counter.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from dspark_obs.engine.acceptance import SAMPLING_EPS
from dspark_obs.engine.loop import Engine, EngineConfig, EngineError, GenRequest
from dspark_obs.sglang.codec import Codec
from dspark_obs.sglang.records import (
    COMPONENTS,
    MAX_RECORDS,
    DecodeStepRecord,
    InfoDump,
    ReqDetail,
)

__all__ = ["EngineService", "FinishedRequest", "RequestHandle", "ServiceConfig"]

ESTIMATOR_FLUSH_STEPS = 16


@dataclass(frozen=True)
class ServiceConfig:
    """What the service runs and exposes (names as SGLang's server arguments say them)."""

    model_name: str
    drafter_name: str
    components: frozenset[str] = frozenset(COMPONENTS)
    max_records: int = MAX_RECORDS
    estimator_path: Path | None = None
    log_interval: int = 40
    default_max_new_tokens: int = 128


@dataclass
class FinishedRequest:
    """A finished request: its output and SGLang-style meta_info."""

    output_ids: list[int]
    meta_info: dict[str, Any]


@dataclass
class _Spec:
    """Per-request speculative counters, as SGLang's scheduler keeps them."""

    verify_ct: int = 0
    correct: int = 0
    cap_tokens: int = 0
    block_tokens: int = 0
    correct_hist: list[int] = field(default_factory=list)
    cap_hist: list[int] = field(default_factory=list)


class RequestHandle:
    """What an HTTP handler waits on: streamed token chunks, then the finished request."""

    def __init__(self, request: GenRequest, arrival: float) -> None:
        self.request = request
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.events: queue.Queue[list[int] | FinishedRequest | Exception] = queue.Queue()
        self.output: list[int] = []
        self.spec = _Spec()


class EngineService:
    """Owns the engine thread, the step-dump ring buffer, the estimator file and metrics."""

    def __init__(
        self,
        engine: Engine,
        codec: Codec,
        config: ServiceConfig,
        run_id: str = "serve",
        built_s: float = 0.0,
    ) -> None:
        t0 = time.perf_counter()
        unknown = set(config.components) - set(COMPONENTS)
        if unknown:
            raise EngineError(f"unknown dump component(s) {sorted(unknown)}; valid: {COMPONENTS}")
        self.engine = engine
        self.codec = codec
        self.config = config
        self.run_id = run_id
        self.startup_time = time.time()  # wall clock of the start (OpenAI ``created``)
        self._startup_durations = _startup_durations(built_s, time.perf_counter() - t0)
        self._incoming: queue.Queue[GenRequest] = queue.Queue()
        self._handles: dict[str, RequestHandle] = {}
        self._lock = threading.Lock()
        self._records: deque[DecodeStepRecord] = deque(maxlen=config.max_records)
        self._pending_steps: list[dict[str, Any]] = []
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.steps_total = 0  # decode steps run (the ring buffer keeps the last max_records)
        self._est = _EstimatorWriter(config.estimator_path, engine.cfg.gamma)
        self._metrics = _Metrics(config, engine.cfg)
        self.registry = self._metrics.registry

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let running ones finish, close the estimator file."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._est.close()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            self.engine.run(
                [], self._emit, self.run_id, source=self._source, on_tokens=self._on_tokens
            )
        except BaseException as exc:  # the thread must not die silently: fail every waiter
            self.error = exc
            with self._lock:
                handles = list(self._handles.values())
                self._handles.clear()
            for h in handles:
                h.events.put(RuntimeError(f"engine stopped: {exc}"))

    # ------------------------------------------------------------------ requests

    def submit(self, request: GenRequest) -> RequestHandle:
        """Queue a request; raises EngineError (bad input, duplicate rid, not running)."""
        if not self.healthy or self._closing.is_set():
            raise EngineError(f"engine is not running{f': {self.error}' if self.error else ''}")
        self.engine.check([request])
        handle = RequestHandle(request, time.time())
        with self._lock:
            if request.rid in self._handles:
                raise EngineError(f"request id {request.rid!r} is already running")
            self._handles[request.rid] = handle
        self._incoming.put(request)
        return handle

    def _source(self, idle: bool) -> list[GenRequest] | None:
        if self._closing.is_set() and self._incoming.empty():
            return None
        out: list[GenRequest] = []
        if idle:
            try:
                out.append(self._incoming.get(timeout=0.05))
            except queue.Empty:
                return out
        while True:
            try:
                out.append(self._incoming.get_nowait())
            except queue.Empty:
                return out

    def _on_tokens(self, rid: str, tokens: list[int]) -> None:
        h = self._handles.get(rid)
        if h is None:
            return
        if h.first_token_time is None:
            h.first_token_time = time.time()
        h.output.extend(tokens)
        h.events.put(list(tokens))

    # ------------------------------------------------------------------ records

    def _emit(self, table: str, rows: list[dict[str, Any]]) -> None:
        if table == "steps":
            self._pending_steps.extend(rows)
        elif table == "req_steps":
            self._steps_done(rows)
        elif table == "requests":
            for row in rows:
                self._finish(row)

    def _steps_done(self, rows: list[dict[str, Any]]) -> None:
        by_fct: dict[int, list[dict[str, Any]]] = {}
        for r in rows:
            by_fct.setdefault(int(r["forward_ct"]), []).append(r)
            h = self._handles.get(r["rid"])
            if h is not None:
                _count(h.spec, r, self.engine.cfg.mode)
        comps = self.config.components
        records = []
        for step in self._pending_steps:
            reqs = by_fct.get(int(step["forward_ct"]), [])
            records.append(_record(step, reqs, comps))
            self._metrics.step(step, reqs)
        self._pending_steps = []
        self.steps_total += len(records)
        if comps:
            with self._lock:
                self._records.extend(records)
        if self.engine.cfg.mode == "compact":
            self._est.rows(rows, len(records))

    def _finish(self, row: dict[str, Any]) -> None:
        with self._lock:
            h = self._handles.pop(row["rid"], None)
        if h is None:
            return
        reason = row["finish_reason"]
        output = list(row["output_tokens"])
        if reason == "stop":
            finish = {"type": "stop", "matched": int(output[-1])}
            self._est.eos(row["rid"])
        elif reason == "abort":  # the shape of SGLang 0.5.23's FINISH_ABORT.to_json()
            finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        else:
            finish = {"type": "length", "length": len(output)}
        self._est.forget(row["rid"])
        self._est.flush()  # a finished request's lines are readable before its response
        now = time.time()
        meta: dict[str, Any] = {
            "id": row["rid"],
            "finish_reason": finish,
            "prompt_tokens": int(row["prompt_tokens"]),
            "completion_tokens": len(output),
            "cached_tokens": 0,
            "e2e_latency": now - h.arrival,
        }
        meta.update(spec_meta(h.spec, len(output), self.engine.cfg.gamma, self.engine.cfg.mode))
        self._metrics.finished(h.spec.verify_ct, len(output), int(row["prompt_tokens"]))
        h.events.put(FinishedRequest(output, meta))

    # ------------------------------------------------------------------ control surfaces

    def dump(self) -> InfoDump | None:
        """The ``dspark_info_record`` (None when no dump component is enabled, as SGLang)."""
        if not self.config.components:
            return None
        with self._lock:
            records = list(self._records)
        return InfoDump(
            mode=self.engine.cfg.mode,
            gamma=self.engine.cfg.gamma,
            verify_num_draft_tokens=self.engine.cfg.gamma + 1,
            components=sorted(self.config.components),
            records=records,
        )

    def server_info(self) -> dict[str, Any]:
        """The GET /server_info body, shaped as SGLang 0.5.23's handler builds it: the server
        arguments, ``startup_time`` (a dict of start-up durations, as
        ``build_engine_startup_time`` makes it), one internal state per DP rank (its own
        scheduler ``startup_time`` and the ``dspark_info_record``), ``version``, ``frontend``."""
        cfg = self.engine.cfg
        args: dict[str, Any] = {
            "model_path": self.config.model_name,
            "served_model_name": self.config.model_name,
            "speculative_algorithm": "DSPARK",
            "speculative_draft_model_path": self.config.drafter_name,
            "speculative_dspark_block_size": cfg.gamma,
            "speculative_num_draft_tokens": cfg.gamma + 1,
            "max_running_requests": cfg.max_batch,
            "dp_size": 1,
        }
        state: dict[str, Any] = {
            **args,
            "world_size": 1,
            "startup_time": {
                k: v for k, v in self._startup_durations.items() if k != "tokenizer_e2e"
            },
            "effective_max_running_requests_per_dp": cfg.max_batch,
            "running_reqs": self.running,
        }
        dump = self.dump()
        if dump is not None:
            state["dspark_info_record"] = {**msgspec.to_builtins(dump), "simulate_acc_len": None}
        return {
            **args,
            "launch_command": "dspark-obs engine-server",
            "dspark_obs": {
                "mode": cfg.mode,
                "lag_steps": cfg.lag_steps,
                "cost_table": None if cfg.cost_table is None else cfg.cost_table.to_dict(),
                "estimator_path": None
                if self.config.estimator_path is None
                else str(self.config.estimator_path),
            },
            "startup_time": dict(self._startup_durations),
            "internal_states": [state],
            "version": SGLANG_VERSION,
            "frontend": "python",
        }

    def clear_records(self) -> None:
        with self._lock:
            self._records.clear()

    def set_forced_budget_frac(self, frac: float | None) -> None:
        if frac is not None and not (0.0 < float(frac) <= 1.0):
            raise EngineError(f"dspark_force_budget_frac must be in (0, 1] or null, got {frac}")
        self.engine.scheduler.forced_budget_frac = None if frac is None else float(frac)

    @property
    def running(self) -> int:
        return len(self._handles)


# ---------------------------------------------------------------- rendering

SGLANG_VERSION = "0.5.23"  # the SGLang surface this service speaks
_GRAPH_PHASES = (
    "prefill",
    "decode",
    "target_verify",
    "draft_prefill",
    "draft_decode",
    "draft_extend",
)


def _startup_durations(load_s: float, service_s: float) -> dict[str, Any]:
    """SGLang's engine ``startup_time`` keys: what this process spent starting (seconds)."""
    return {
        "load_weight": round(load_s, 6),
        "kv_cache_allocation": 0.0,
        "scheduler_e2e": round(load_s + service_s, 6),
        "cuda_graph": dict.fromkeys(_GRAPH_PHASES, 0.0),
        "tokenizer_e2e": round(load_s + service_s, 6),
    }


def _round4(values: Sequence[float] | None) -> list[float] | None:
    return None if values is None else [round(float(v), 4) for v in values]


def _record(step: dict[str, Any], reqs: list[dict[str, Any]], comps: frozenset[str]) -> Any:
    """One engine step as SGLang's DecodeStepRecord, with the enabled components only."""
    rec = DecodeStepRecord(forward_ct=int(step["forward_ct"]))
    if "core" in comps:
        rec.bs = int(step["bs"])
        rec.mode = str(step["mode"])
        rec.budget = int(step["budget"])
        rec.lag_steps = int(step["lag_steps"])
        rec.num_running_reqs = int(step["num_running_reqs"])
        rec.num_verify_tokens = int(step["num_verify_tokens"])
        rec.verify_tokens_local = int(step["verify_tokens_local"])
        rec.predicted_step_ms = _opt_float(step.get("predicted_step_ms"))
        rec.predicted_theta = _opt_float(step.get("predicted_theta"))
    if "step_cpu_time" in comps and step.get("step_cpu_ms") is not None:
        rec.step_cpu_ms = round(float(step["step_cpu_ms"]), 4)
    if "draft_gpu_time" in comps:
        rec.draft_gpu_ms = _opt_float(step.get("draft_gpu_ms"), 4)
    if "target_verify_gpu_time" in comps:
        rec.target_verify_gpu_ms = _opt_float(step.get("target_verify_gpu_ms"), 4)
    if "reqs" in comps:
        rec.reqs = [
            ReqDetail(
                req_pool_index=int(r["req_pool_index"]),
                prefix_len=int(r["prefix_len"]),
                verify_len=int(r["verify_len"]),
                acc_len=int(r["acc_len"]),
                correct_drafts=int(r["correct_drafts"]),
                cap_trim=int(r["cap_trim"]),
                bonus_token=int(r["bonus_token"]),
                draft_tokens=[int(t) for t in r["draft_tokens"]],
                rid=r["rid"],
                confidence=_round4(r.get("confidence")),
                survival=_round4(r.get("survival")),
            )
            for r in reqs
        ]
    return rec


def _opt_float(v: Any, digits: int | None = None) -> float | None:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return round(float(v), digits) if digits is not None else float(v)


def _bump(hist: list[int], index: int) -> None:
    if len(hist) <= index:
        hist.extend([0] * (index + 1 - len(hist)))
    hist[index] += 1


def _count(spec: _Spec, row: dict[str, Any], mode: str) -> None:
    spec.verify_ct += 1
    spec.correct += int(row["correct_drafts"])
    _bump(spec.correct_hist, int(row["correct_drafts"]))
    spec.block_tokens += int(row["acc_len"]) + int(row["cap_trim"])
    if mode != "static":  # SGLang reports cap lengths only when a ragged layout was planned
        spec.cap_tokens += int(row["verify_len"])
        _bump(spec.cap_hist, int(row["verify_len"]))


def spec_meta(spec: _Spec, completion_tokens: int, gamma: int, mode: str) -> dict[str, Any]:
    """SGLang's per-request spec fields of meta_info (none before the first verify)."""
    if spec.verify_ct == 0:
        return {}
    proposed = spec.verify_ct * gamma
    out: dict[str, Any] = {
        "spec_accept_rate": spec.correct / proposed,
        "spec_accept_length": completion_tokens / spec.verify_ct,
        "spec_num_correct_drafts": spec.correct,
        "spec_num_proposed_drafts": proposed,
        "spec_verify_ct": spec.verify_ct,
    }
    if spec.cap_tokens > 0:
        out["spec_cap_length"] = spec.cap_tokens / spec.verify_ct
    if mode == "cap-accept":
        out["spec_block_accept_length"] = spec.block_tokens / spec.verify_ct
    if spec.correct_hist:
        out["spec_correct_drafts_histogram"] = list(spec.correct_hist)
    if spec.cap_hist:
        out["spec_cap_lens_histogram"] = list(spec.cap_hist)
    return out


# ---------------------------------------------------------------- estimator JSONL


class _EstimatorWriter:
    """SGLang's SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH lines from compact req-step rows."""

    def __init__(self, path: Path | None, gamma: int) -> None:
        self.gamma = gamma
        self._fh = open(path, "a", encoding="utf-8") if path is not None else None  # noqa: SIM115
        self._open: dict[str, dict[int, int]] = {}  # rid -> {src_fct: drafts left to resolve}
        self._steps = 0

    def rows(self, rows: list[dict[str, Any]], steps: int) -> None:
        if self._fh is None:
            return
        enc = msgspec.json.encode
        for r in rows:
            if not _pure_temperature(r):
                self._open.pop(r["rid"], None)
                continue
            line: dict[str, Any] = {
                "rid": r["rid"],
                "fct": int(r["forward_ct"]),
                "w": int(r["verify_len"]) - 1,
                "cl": int(r["correct_drafts"]),
                "ct": int(r["cap_trim"]),
            }
            pending = self._open.setdefault(r["rid"], {})
            if r.get("trimmed_tokens"):
                line["trimmed_tokens"] = [int(t) for t in r["trimmed_tokens"]]
                line["q_lp"] = [float(x) for x in r["q_lp"]]
                pending[int(r["forward_ct"])] = len(r["trimmed_tokens"])
            if r.get("pg"):
                line["pg"] = [
                    [
                        e["src_fct"],
                        e["k"],
                        e["target_logprob"],
                        e["draft_token"],
                        e["realized_token"],
                    ]
                    for e in r["pg"]
                ]
                for e in r["pg"]:
                    left = pending.get(e["src_fct"])
                    if left is None:
                        continue
                    if e["realized_token"] != e["draft_token"] or left <= 1:
                        pending.pop(e["src_fct"])
                    else:
                        pending[e["src_fct"]] = left - 1
            self._fh.write(enc(line).decode() + "\n")
        self._steps += steps
        if self._steps >= ESTIMATOR_FLUSH_STEPS:
            self._fh.flush()
            self._steps = 0

    def eos(self, rid: str) -> None:
        """A request ended on EOS: name its unresolved blocks (SGLang's eos_end marker)."""
        pending = self._open.get(rid)
        if self._fh is not None and pending:
            self._fh.write(json.dumps({"rid": rid, "eos_end": sorted(pending)}) + "\n")

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            self._steps = 0

    def forget(self, rid: str) -> None:
        self._open.pop(rid, None)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _pure_temperature(row: dict[str, Any]) -> bool:
    """SGLang's estimator keeps plain softmax(logits / T) rows only."""
    t = row.get("temperature") or 0.0
    top_p = row.get("top_p")
    top_k = row.get("top_k")
    return t >= SAMPLING_EPS and (top_p is None or top_p >= 1.0) and (top_k is None or top_k < 0)


# ---------------------------------------------------------------- /metrics


class _Metrics:
    """SGLang's spec gauges (means over each log interval) and verify-call counter."""

    def __init__(self, config: ServiceConfig, engine: EngineConfig) -> None:
        self.registry = CollectorRegistry()
        labels = {
            "model_name": config.model_name,
            "engine_type": "unified",
            "tp_rank": "0",
            "dp_rank": str(engine.dp_rank),
        }
        names = list(labels)
        self.interval = max(1, int(config.log_interval))
        self.mode = engine.mode
        self.gamma = engine.gamma

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        self.accept_length = gauge("sglang:spec_accept_length", "Mean accept length per verify.")
        self.accept_rate = gauge("sglang:spec_accept_rate", "Accepted / proposed drafts.")
        self.cap_length = gauge("sglang:spec_cap_length", "Mean scheduled window incl. bonus.")
        self.block_length = gauge(
            "sglang:spec_block_accept_length", "Mean uncapped accept length (cap-accept)."
        )
        self.num_steps = gauge("sglang:spec_num_steps", "Active speculative_num_steps.")
        self.num_draft = gauge("sglang:spec_num_draft_tokens", "Active num_draft_tokens.")
        self.running = gauge("sglang:num_running_reqs", "Running requests.")
        self.verify_calls = Counter(
            "sglang:spec_verify_calls", "Speculative verify calls.", names, registry=self.registry
        ).labels(**labels)
        self.gen_tokens = Counter(
            "sglang:generation_tokens", "Generated tokens.", names, registry=self.registry
        ).labels(**labels)
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Prefill tokens.", names, registry=self.registry
        ).labels(**labels)
        self.num_steps.set(self.gamma)
        self.num_draft.set(self.gamma + 1)
        self._reset()

    def _reset(self) -> None:
        self._steps = self._rows = self._accept = self._correct = self._cap = self._block = 0

    def step(self, step: dict[str, Any], reqs: list[dict[str, Any]]) -> None:
        self._steps += 1
        self._rows += len(reqs)
        for r in reqs:
            self._accept += int(r["acc_len"])
            self._correct += int(r["correct_drafts"])
            self._block += int(r["acc_len"]) + int(r["cap_trim"])
            if self.mode != "static":
                self._cap += int(r["verify_len"])
        self.running.set(int(step["bs"]))
        if self._steps >= self.interval and self._rows:
            self.accept_length.set(self._accept / self._rows)
            self.accept_rate.set(self._correct / (self._rows * self.gamma))
            self.cap_length.set(self._cap / self._rows)
            self.block_length.set(self._block / self._rows if self.mode == "cap-accept" else 0)
            self._reset()

    def finished(self, verify_ct: int, completion: int, prompt: int) -> None:
        if verify_ct > 0:
            self.verify_calls.inc(verify_ct)
        self.gen_tokens.inc(completion)
        self.prompt_tokens.inc(prompt)
