"""``dspark-obs engine-server``: the embedded DSpark engine behind SGLang's HTTP surfaces.

So that the collector, the workload driver and any OpenAI client can be pointed at a DSpark
server on a machine without a GPU. Endpoints (SGLang 0.5.23 shapes):

    POST /generate              {"text" | "input_ids", "sampling_params", "stream", "rid"}
    POST /v1/chat/completions   OpenAI; "return_spec_tokens_details" adds sglext
    GET  /v1/models, /health, /health_generate, /server_info, /get_server_info, /metrics
    POST /flush_cache, /set_internal_state  {"server_args": {"dspark_clear_info_records":
                                true | "dspark_force_budget_frac": f | null}}

The verify mode is chosen per server as SGLang chooses it: ``SGLANG_RAGGED_VERIFY_MODE``
(static | compact | cap-accept, default static) unless ``--mode`` is given; the relay lag
from ``SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS``, the dump components from
``SGLANG_DSPARK_DEBUG_DUMP`` and the estimator file from
``SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH`` likewise. Binds 127.0.0.1 by default.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dspark_obs.engine.costs import CostTable
from dspark_obs.engine.loop import Engine, EngineConfig, EngineError, GenRequest
from dspark_obs.schema import MODES
from dspark_obs.sglang.codec import ByteCodec, Codec, TokenizerCodec
from dspark_obs.sglang.records import COMPONENTS, MAX_RECORDS
from dspark_obs.sglang.service import EngineService, FinishedRequest, ServiceConfig

__all__ = ["EngineServer", "ServerOptions", "build_service", "resolve_components", "resolve_mode"]

VERSION = "0.5.23"  # the SGLang surface this server speaks
MAX_BODY = 64 << 20


class ServerError(ValueError):
    """Bad server options (mode, components, paths): reported before anything starts."""


def resolve_mode(flag: str | None, env: Mapping[str, str] = os.environ) -> str:
    """``--mode`` if given, else SGLANG_RAGGED_VERIFY_MODE, else SGLang's default static."""
    value = flag if flag is not None else env.get("SGLANG_RAGGED_VERIFY_MODE", "static")
    if value not in MODES:
        where = "--mode" if flag is not None else "SGLANG_RAGGED_VERIFY_MODE"
        raise ServerError(f"invalid {where}={value!r}; expected one of {list(MODES)}")
    return value


def resolve_components(flag: str | None, env: Mapping[str, str] = os.environ) -> frozenset[str]:
    """Dump components: ``--dump`` or SGLANG_DSPARK_DEBUG_DUMP (comma list, "all")."""
    raw = flag if flag is not None else env.get("SGLANG_DSPARK_DEBUG_DUMP", "all")
    tokens = {t.strip() for t in raw.split(",") if t.strip()}
    if "all" in tokens:
        return frozenset(COMPONENTS)
    bad = tokens - set(COMPONENTS)
    if bad:
        raise ServerError(f"invalid dump component(s) {sorted(bad)}; valid: {COMPONENTS} or all")
    if env.get("SGLANG_DSPARK_ENABLE_SPS_RECORD", "") in ("1", "true", "True"):
        tokens |= {"core", "step_cpu_time"}
    return frozenset(tokens)


@dataclass(frozen=True)
class ServerOptions:
    """Everything ``dspark-obs engine-server`` takes (None: from the SGLang env var)."""

    host: str = "127.0.0.1"
    port: int = 30000
    mode: str | None = None
    gamma: int = 5
    lag: int | None = None
    max_batch: int = 16
    cost_table: Path | None = None
    sts: Path | None = None
    drafter: Path | None = None
    tiny: bool = False
    seed: int = 0
    device: str = "cpu"
    dump: str | None = None
    max_records: int = MAX_RECORDS
    estimator_path: Path | None = None
    run_id: str = "serve"


def tiny_models(seed: int = 0, gamma_max: int = 7) -> Any:
    """A tiny random target + drafter over the 128-id byte vocabulary (fast, for tests)."""
    import torch

    from dspark_obs.engine.drafter import Drafter, DrafterConfig
    from dspark_obs.engine.model import ModelConfig, Target
    from dspark_obs.engine.session import Models

    torch.manual_seed(seed)
    target = Target(ModelConfig.tiny(vocab_size=ByteCodec.vocab_size, max_position=1024)).eval()
    dcfg = DrafterConfig.for_target(
        target, num_layers=1, markov_rank=4, gamma_max=gamma_max, context_window=64
    )
    drafter = Drafter(dcfg, target).eval()
    return Models(target, drafter, None, (), "tiny-random", "tiny-random-drafter")


def build_service(opts: ServerOptions, env: Mapping[str, str] = os.environ) -> EngineService:
    """Load the models and the engine the options describe (errors before any socket)."""
    from dspark_obs.engine.session import load_cost_table, load_models

    mode = resolve_mode(opts.mode, env)
    components = resolve_components(opts.dump, env)
    lag = opts.lag
    if lag is None:
        raw = env.get("SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS", "2")
        try:
            lag = int(raw)
        except ValueError:
            raise ServerError(
                f"SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS={raw!r} is not an integer"
            ) from None
    est = opts.estimator_path
    if est is None and env.get("SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH"):
        est = Path(env["SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH"])
    if opts.max_records < 1:
        raise ServerError(f"--max-records must be >= 1, got {opts.max_records}")
    if opts.tiny:
        models = tiny_models(opts.seed, gamma_max=max(opts.gamma, 5))
        if opts.sts is not None:
            models.drafter.set_sts(opts.sts)
        codec: Codec = ByteCodec()
        table = CostTable.load(opts.cost_table) if opts.cost_table else None
    else:
        models = load_models(opts.drafter, device=opts.device, sts=opts.sts)
        codec = TokenizerCodec(models.tokenizer)
        table = load_cost_table(opts.cost_table, opts.device)
    config = EngineConfig(
        mode=mode, gamma=opts.gamma, lag_steps=lag, max_batch=opts.max_batch,
        cost_table=table, flush_every=1, estimator_rows="sglang",
        compile=opts.device.startswith("cuda"),
    )
    engine = Engine(models.target, models.drafter, config, models.stop_ids)
    svc_cfg = ServiceConfig(
        model_name=models.model_name,
        drafter_name=models.drafter_name,
        components=components,
        max_records=opts.max_records,
        estimator_path=est,
    )
    return EngineService(engine, codec, svc_cfg, run_id=opts.run_id)


class EngineServer:
    """A ThreadingHTTPServer around an EngineService; ``serve_forever`` or ``start``."""

    def __init__(self, service: EngineService, host: str = "127.0.0.1", port: int = 30000):
        self.service = service
        handler = type("Handler", (_Handler,), {"service": service})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> EngineServer:
        """Start the engine and serve in a background thread (for tests and embedding)."""
        self.service.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.service.start()
        try:
            self.httpd.serve_forever()
        finally:
            self.close()

    def close(self) -> None:
        if self._thread is not None:  # serve_forever() in our own thread: stop it
            self.httpd.shutdown()
        self.httpd.server_close()
        self.service.close()


# ---------------------------------------------------------------- HTTP


class _BadRequest(ValueError):
    pass


class _Handler(BaseHTTPRequestHandler):
    service: EngineService
    protocol_version = "HTTP/1.1"
    server_version = "dspark-obs-engine-server"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        pass

    # -------------------------------------------------------------- plumbing

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, obj: Any, status: int = 200) -> None:
        self._send(status, msgspec.json.encode(obj))

    def _error(self, status: int, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._json({"error": {"message": message, "type": kind, "code": status}}, status)

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise _BadRequest(f"request body of {n} bytes exceeds {MAX_BODY}")
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise _BadRequest(f"request body is not JSON: {exc}") from None

    def _start_sse(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _sse(self, obj: Any) -> None:
        data = obj if isinstance(obj, bytes) else msgspec.json.encode(obj)
        self.wfile.write(b"data: " + data + b"\n\n")
        self.wfile.flush()

    # -------------------------------------------------------------- routes

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        path = self.path.split("?", 1)[0]
        svc = self.service
        if path in ("/health", "/health_generate"):
            self._send(200 if svc.healthy else 503, b"")
        elif path in ("/server_info", "/get_server_info"):
            self._json(_server_info(svc))
        elif path == "/metrics":
            self._send(200, generate_latest(svc.registry), CONTENT_TYPE_LATEST)
        elif path == "/v1/models":
            name = svc.config.model_name
            self._json({"object": "list", "data": [
                {"id": name, "object": "model", "created": int(svc.startup_time),
                 "owned_by": "dspark-obs", "root": name}]})
        elif path == "/model_info":
            self._json({"model_path": svc.config.model_name, "is_generation": True})
        elif path == "/flush_cache":
            self._send(200, b"Cache flushed.\n", "text/plain")
        else:
            self._error(404, f"no route {path}")

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        path = self.path.split("?", 1)[0]
        try:
            body = self._body()
            if path == "/generate":
                self._generate(body)
            elif path == "/v1/chat/completions":
                self._chat(body)
            elif path == "/set_internal_state":
                self._json({"updated": _set_internal_state(self.service, body)})
            elif path == "/flush_cache":
                self._send(200, b"Cache flushed.\n", "text/plain")
            else:
                self._error(404, f"no route {path}")
        except (_BadRequest, EngineError) as exc:
            self._error(400, str(exc))
        except (BrokenPipeError, ConnectionResetError):
            pass

    do_PUT = do_POST  # noqa: N815 - SGLang accepts PUT on /generate and /set_internal_state

    # -------------------------------------------------------------- /generate

    def _generate(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise _BadRequest("the request body must be a JSON object")
        svc = self.service
        if "input_ids" in body and body["input_ids"] is not None:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise _BadRequest("input_ids must be one list of token ids (batches: send each)")
        elif isinstance(body.get("text"), str):
            ids = svc.codec.encode(body["text"])
        else:
            raise _BadRequest("give 'text' (a string) or 'input_ids' (a list of ints)")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise _BadRequest("sampling_params must be an object")
        req = _gen_request(svc, ids, sp, body.get("rid"), sp.get("sampling_seed"))
        handle = svc.submit(req)
        if not body.get("stream"):
            done = _wait(handle)
            self._json(_generate_out(svc, done))
            return
        self._start_sse()
        while True:
            event = handle.events.get()
            if isinstance(event, Exception):
                self._sse({"error": {"message": str(event), "type": "server_error"}})
                break
            if isinstance(event, FinishedRequest):
                self._sse(_generate_out(svc, event))
                break
            self._sse({
                "text": svc.codec.decode(handle.output),
                "output_ids": list(handle.output),
                "meta_info": {"id": req.rid, "finish_reason": None,
                              "prompt_tokens": len(ids),
                              "completion_tokens": len(handle.output)},
            })
        self._sse(b"[DONE]")

    # -------------------------------------------------------------- chat

    def _chat(self, body: Any) -> None:
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise _BadRequest("a chat request needs 'messages' (a list)")
        if int(body.get("n") or 1) != 1:
            raise _BadRequest("only n = 1 is supported")
        svc = self.service
        ids = svc.codec.chat(body["messages"])
        sp = {
            "max_new_tokens": body.get("max_completion_tokens") or body.get("max_tokens"),
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "top_k": body.get("top_k", -1),
            "ignore_eos": body.get("ignore_eos", False),
        }
        req = _gen_request(svc, ids, sp, body.get("rid"), body.get("seed"))
        handle = svc.submit(req)
        want_spec = bool(body.get("return_spec_tokens_details"))
        cid = f"chatcmpl-{req.rid}"
        created = int(time.time())
        model = body.get("model") or svc.config.model_name
        if not body.get("stream"):
            done = _wait(handle)
            out: dict[str, Any] = {
                "id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": svc.codec.decode(done.output_ids)},
                    "finish_reason": done.meta_info["finish_reason"]["type"],
                }],
                "usage": _usage(done),
            }
            ext = _sglext(body, done, want_spec)
            if ext:
                out["sglext"] = ext
            self._json(out)
            return
        self._start_sse()
        chunk = {"id": cid, "object": "chat.completion.chunk", "created": created,
                 "model": model}
        self._sse({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                "content": ""},
                                         "finish_reason": None}]})
        sent = ""
        opts = body.get("stream_options") or {}
        while True:
            event = handle.events.get()
            if isinstance(event, Exception):
                self._sse({"error": {"message": str(event), "type": "server_error"}})
                break
            if isinstance(event, FinishedRequest):
                text = svc.codec.decode(event.output_ids)
                self._sse({**chunk, "choices": [{
                    "index": 0, "delta": {"content": text[len(sent):]},
                    "finish_reason": event.meta_info["finish_reason"]["type"]}]})
                ext = _sglext(body, event, want_spec)
                if ext:
                    self._sse({**chunk, "choices": [], "sglext": ext})
                if opts.get("include_usage"):
                    self._sse({**chunk, "choices": [], "usage": _usage(event)})
                break
            text = svc.codec.decode(handle.output)
            if len(text) > len(sent):
                delta = {**chunk, "choices": [{"index": 0, "delta": {"content": text[len(sent):]},
                                               "finish_reason": None}]}
                if opts.get("continuous_usage_stats"):
                    p = len(req.prompt_ids)
                    c = len(handle.output)
                    delta["usage"] = {"prompt_tokens": p, "completion_tokens": c,
                                      "total_tokens": p + c}
                self._sse(delta)
                sent = text
        self._sse(b"[DONE]")


# ---------------------------------------------------------------- helpers


def _gen_request(
    svc: EngineService, ids: list[int], sp: dict[str, Any], rid: Any, seed: Any
) -> GenRequest:
    max_new = sp.get("max_new_tokens")
    max_new = svc.config.default_max_new_tokens if max_new is None else max_new
    temperature = sp.get("temperature")
    temperature = 1.0 if temperature is None else temperature  # SGLang's default
    for name, value in (("max_new_tokens", max_new), ("top_k", sp.get("top_k", -1))):
        if not isinstance(value, int) or isinstance(value, bool):
            raise _BadRequest(f"sampling_params.{name} must be an integer, got {value!r}")
    for name, value in (("temperature", temperature), ("top_p", sp.get("top_p", 1.0))):
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _BadRequest(f"sampling_params.{name} must be a number, got {value!r}")
    ignore_eos = sp.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _BadRequest(f"sampling_params.ignore_eos must be true or false, got {ignore_eos!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise _BadRequest(f"sampling_seed must be an integer, got {seed!r}")
    if rid is not None and not isinstance(rid, str):
        raise _BadRequest(f"rid must be a string, got {rid!r}")
    return GenRequest(
        rid=rid or uuid.uuid4().hex,
        prompt_ids=list(ids),
        max_new_tokens=int(max_new),
        temperature=float(temperature),
        top_p=float(sp.get("top_p", 1.0)),
        top_k=int(sp.get("top_k", -1)),
        seed=int(seed) if seed is not None else 0,
        ignore_eos=ignore_eos,
    )


def _wait(handle: Any) -> FinishedRequest:
    while True:
        event = handle.events.get()
        if isinstance(event, Exception):
            raise EngineError(str(event))
        if isinstance(event, FinishedRequest):
            return event


def _generate_out(svc: EngineService, done: FinishedRequest) -> dict[str, Any]:
    return {"text": svc.codec.decode(done.output_ids), "output_ids": done.output_ids,
            "meta_info": done.meta_info}


def _sglext(body: dict[str, Any], done: FinishedRequest, spec: bool) -> dict[str, Any]:
    """SGLang's response-level extension: spec details and output ids, when asked for."""
    ext: dict[str, Any] = {}
    if spec and _spec_details(done.meta_info) is not None:
        ext["spec_tokens_details"] = _spec_details(done.meta_info)
    if body.get("return_output_ids_in_sglext"):
        ext["output_ids"] = [list(done.output_ids)]
    return ext


def _usage(done: FinishedRequest) -> dict[str, int]:
    p, c = done.meta_info["prompt_tokens"], done.meta_info["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


_SPEC_KEYS = {
    "spec_accept_rate": 0.0, "spec_accept_length": 0.0, "spec_cap_length": 0.0,
    "spec_block_accept_length": 0.0, "spec_num_correct_drafts": 0,
    "spec_num_proposed_drafts": 0, "spec_verify_ct": 0,
    "spec_correct_drafts_histogram": [], "spec_cap_lens_histogram": [],
}


def _spec_details(meta: dict[str, Any]) -> dict[str, Any] | None:
    """SGLang's SpecTokensDetails: every field, zero / empty when meta_info lacks it."""
    if not any(k in meta for k in _SPEC_KEYS):
        return None
    return {k: meta.get(k) or default for k, default in _SPEC_KEYS.items()}


def _server_info(svc: EngineService) -> dict[str, Any]:
    cfg = svc.engine.cfg
    state: dict[str, Any] = {"running_reqs": svc.running}
    dump = svc.dump()
    if dump is not None:
        state["dspark_info_record"] = dump
    return {
        "model_path": svc.config.model_name,
        "served_model_name": svc.config.model_name,
        "speculative_algorithm": "DSPARK",
        "speculative_draft_model_path": svc.config.drafter_name,
        "speculative_dspark_block_size": cfg.gamma,
        "speculative_num_draft_tokens": cfg.gamma + 1,
        "max_running_requests": cfg.max_batch,
        "dspark_obs": {
            "mode": cfg.mode, "lag_steps": cfg.lag_steps,
            "cost_table": None if cfg.cost_table is None else cfg.cost_table.to_dict(),
            "estimator_path": None if svc.config.estimator_path is None
            else str(svc.config.estimator_path),
        },
        "startup_time": svc.startup_time,
        "internal_states": [state],
        "version": VERSION,
        "frontend": "python",
    }


def _set_internal_state(svc: EngineService, body: Any) -> bool:
    """SGLang's rule: every key is validated first; any unknown or bad key updates nothing."""
    args = body.get("server_args") if isinstance(body, dict) else None
    if not isinstance(args, dict):
        return False
    for key, value in args.items():
        if key == "dspark_force_budget_frac":
            if value is not None and not (
                isinstance(value, int | float) and 0.0 < float(value) <= 1.0
            ):
                return False
        elif key != "dspark_clear_info_records":
            return False
    for key, value in args.items():
        if key == "dspark_force_budget_frac":
            svc.set_forced_budget_frac(value)
        elif value:
            svc.clear_records()
    return True


def serve(opts: ServerOptions) -> None:
    """Build and serve until interrupted (the CLI entry)."""
    svc = build_service(opts)
    server = EngineServer(svc, opts.host, opts.port)
    server.serve_forever()

