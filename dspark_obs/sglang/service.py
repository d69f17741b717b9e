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

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa

from dspark_obs.engine.loop import Engine
from dspark_obs.engine.types import EngineError, GenRequest
from dspark_obs.sglang.codec import Codec
from dspark_obs.sglang.estimator_writer import EstimatorWriter
from dspark_obs.sglang.records import (
    COMPONENTS,
    MAX_RECORDS,
    DecodeStepRecord,
    InfoDump,
    step_record,
)
from dspark_obs.sglang.spec_stats import SpecCounts, SpecMetrics, spec_meta

__all__ = ["EngineService", "FinishedRequest", "RequestHandle", "ServiceConfig"]


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


class RequestHandle:
    """What an HTTP handler waits on: streamed token chunks, then the finished request."""

    def __init__(self, request: GenRequest, arrival: float) -> None:
        self.request = request
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.events: queue.Queue[list[int] | FinishedRequest | Exception] = queue.Queue()
        self.output: list[int] = []
        self.spec = SpecCounts()


class EngineService:
    """Owns the engine thread, the step-dump ring buffer, the estimator file and metrics."""

    def __init__(
        self,
        engine: Engine,
        codec: Codec,
        config: ServiceConfig,
        *,
        built_s: float,
        run_id: str = "serve",
    ) -> None:
        """``built_s``: what loading the models and building the engine took, measured by the
        caller; it is ``startup_time``'s ``load_weight`` (no default: a made-up 0.0 would let
        two processes send the same ``startup_time`` and a restart pass for a re-read)."""
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
        self._est = EstimatorWriter(config.estimator_path)
        cfg = engine.cfg
        self._metrics = SpecMetrics(
            config.model_name, cfg.dp_rank, cfg.mode, cfg.gamma, config.log_interval
        )
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

    def _emit(self, table: str, batch: pa.Table | list[dict[str, Any]]) -> None:
        """The engine's records (on its record worker's thread): the step tables arrive as
        Arrow, turned into the row dicts SGLang's surfaces are rendered from here, once."""
        rows = batch.to_pylist() if isinstance(batch, pa.Table) else batch
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
                h.spec.count(r, self.engine.cfg.mode)
        comps = self.config.components
        records = []
        for step in self._pending_steps:
            reqs = by_fct.get(int(step["forward_ct"]), [])
            records.append(step_record(step, reqs, comps))
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
