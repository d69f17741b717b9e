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

HTTP is uvicorn + FastAPI, as SGLang serves it: the routes and request models live in
:mod:`~dspark_obs.sglang.http_app` / :mod:`~dspark_obs.sglang.http_models`, the cost bounds
in :mod:`~dspark_obs.sglang.http_limits`, the connection rules (JSON protocol errors,
connection cap, request deadline) in :mod:`~dspark_obs.sglang.http_protocol`.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dspark_obs.cost_table import CostTable
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.session import Models
from dspark_obs.engine.types import EngineConfig
from dspark_obs.schema import MODES
from dspark_obs.sglang.codec import ByteCodec, Codec, TokenizerCodec
from dspark_obs.sglang.http_limits import HttpLimits
from dspark_obs.sglang.records import COMPONENTS, MAX_RECORDS
from dspark_obs.sglang.service import EngineService, ServiceConfig

__all__ = [
    "EngineServer",
    "HttpLimits",
    "ServerError",
    "ServerOptions",
    "build_service",
    "resolve_components",
    "resolve_mode",
    "server_limits",
]

LISTEN_BACKLOG = 1024
GRACEFUL_SHUTDOWN_S = 5


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
    device: str = "cpu"
    draft_vocab: int | None = None  # None: the device's default (draft_vocab.py)
    dump: str | None = None
    max_records: int = MAX_RECORDS
    estimator_path: Path | None = None
    run_id: str = "serve"
    max_inflight: int | None = None  # generations queued or running (None: 8 x max_batch)
    max_connections: int = 512
    request_timeout_s: float = 30.0  # to receive a whole request
    max_body_bytes: int | None = None  # None: derived from the context (HttpLimits)


def build_service(
    opts: ServerOptions, env: Mapping[str, str] = os.environ, models: Models | None = None
) -> EngineService:
    """The engine the options describe, around ``models`` when given (``--tiny``: a random
    model without a tokenizer, served through the byte codec, from
    :func:`dspark_obs.testing.tiny_models.byte_models`), else around the models loaded from
    ``opts.drafter``; errors before any socket."""
    from dspark_obs.engine.draft_vocab import resolve_draft_vocab
    from dspark_obs.engine.session import load_cost_table, load_models

    t0 = time.perf_counter()  # start-up durations are reported as SGLang does (startup_time)
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
    if models is not None:
        if opts.sts is not None:
            models.drafter.set_sts(opts.sts)
        codec: Codec = ByteCodec() if models.tokenizer is None else TokenizerCodec(models.tokenizer)
        table = CostTable.load(opts.cost_table) if opts.cost_table else None
    else:
        models = load_models(
            opts.drafter, device=opts.device, sts=opts.sts,
            draft_vocab=resolve_draft_vocab(opts.draft_vocab, opts.device),
        )  # fmt: skip
        codec = TokenizerCodec(models.tokenizer)
        table = load_cost_table(opts.cost_table, opts.device, draft_vocab=models.draft_vocab)
    config = EngineConfig(
        mode=mode,
        gamma=opts.gamma,
        lag_steps=lag,
        max_batch=opts.max_batch,
        cost_table=table,
        flush_every=1,
        estimator_rows="sglang",
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
    return EngineService(
        engine, codec, svc_cfg, run_id=opts.run_id, built_s=time.perf_counter() - t0
    )


class EngineServer:
    """uvicorn serving the FastAPI app of :mod:`~dspark_obs.sglang.http_app` around an
    EngineService; ``serve_forever`` (the CLI) or ``start`` (a background thread).

    The socket is bound here, so a bad address fails before anything runs and ``url`` is
    known at once (port 0 picks a free one)."""

    def __init__(
        self,
        service: EngineService,
        host: str = "127.0.0.1",
        port: int = 30000,
        limits: HttpLimits | None = None,
    ) -> None:
        import uvicorn

        from dspark_obs.sglang.http_app import build_app
        from dspark_obs.sglang.http_protocol import guarded_protocol

        self.service = service
        self.limits = limits or HttpLimits.for_service(service)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
            self._socket.listen(LISTEN_BACKLOG)
        except OSError:
            self._socket.close()
            raise
        lim = self.limits
        config = uvicorn.Config(
            build_app(service, lim),
            http=guarded_protocol(lim.max_connections, lim.request_timeout_s),
            ws="none",
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=int(max(1, lim.keep_alive_s)),
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            server_header=False,
            date_header=False,
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def httpd(self) -> EngineServer:
        """Callers of the old http.server handle stop it with ``server.httpd.shutdown()``."""
        return self

    def start(self) -> EngineServer:
        """Start the engine and serve in a background thread (for tests and embedding)."""
        self.service.start()
        self._thread = threading.Thread(target=self._serve, name="engine-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until shutdown() or SIGINT/SIGTERM (uvicorn's handlers)."""
        self.service.start()
        try:
            self._serve()
        finally:
            self.close()

    def _serve(self) -> None:
        self._server.run(sockets=[self._socket])

    def shutdown(self) -> None:
        """Ask the server to stop (any thread); in-flight responses get a grace period."""
        self._server.should_exit = True

    def close(self) -> None:
        self.shutdown()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(GRACEFUL_SHUTDOWN_S + 10)
        self._socket.close()
        self.service.close()


def server_limits(service: EngineService, opts: ServerOptions) -> HttpLimits:
    """The options' HTTP limits (unset ones derived from the model, see HttpLimits)."""
    return HttpLimits.for_service(
        service,
        max_inflight=opts.max_inflight,
        max_connections=opts.max_connections,
        request_timeout_s=opts.request_timeout_s,
        max_body_bytes=opts.max_body_bytes,
    )
