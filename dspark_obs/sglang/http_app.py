"""The engine-server's HTTP routes: a FastAPI app over an :class:`EngineService`.

Every request is bounded before any work proportional to it: the body by
``HttpLimits.max_body_bytes`` (413), its JSON by pydantic's parser and the strict models of
:mod:`~dspark_obs.sglang.http_models` (400 naming the field), a prompt by its character count
against the context before tokenizing (400), the number of generations in flight by
``max_inflight`` (503). Every error is a JSON body ``{"error": {"message", "type", "code"}}``.

A client that goes away (a closed stream, or a dropped connection while a non-streaming
request waits) cancels its requests in the engine, which frees their batch slots at the next
step boundary.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dspark_obs.sglang.http_generation import ClientGone, HttpError, submit, wait_done
from dspark_obs.sglang.http_limits import HttpLimits
from dspark_obs.sglang.http_models import (
    ChatRequest,
    GenerateRequest,
    InternalStateRequest,
    ServerArgsUpdate,
)
from dspark_obs.sglang.http_protocol import error_body
from dspark_obs.sglang.http_render import ChatReply, GroupStream, generate_out, generate_stream
from dspark_obs.sglang.service import EngineService

__all__ = ["build_app"]

MAX_TARGET_BYTES = 8 << 10  # request line target (path and query)
MAX_HEAD_BYTES = 32 << 10  # all header names and values together
ModelT = TypeVar("ModelT", bound=BaseModel)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return Response(error_body(status, message), status, media_type="application/json")


def build_app(service: EngineService, limits: HttpLimits) -> FastAPI:
    """The FastAPI app of one engine-server (routes close over ``service`` and ``limits``)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(_HeadLimits)
    svc = service

    @app.exception_handler(HttpError)
    async def _http_error(_: Request, exc: HttpError) -> Response:
        return _error(exc.status, str(exc))

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(b"", 400)  # nobody reads it: the connection is closed

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return _error(404, f"no route {request.url.path[:200]}")
        if exc.status_code == 405:
            return _error(
                405, f"method {request.method[:20]} not allowed on {request.url.path[:200]}"
            )
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> Response:
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ GET surfaces

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        if svc.healthy:
            return Response(b"", 200)
        reason = f": {svc.error}" if svc.error is not None else ""
        return _error(503, f"engine is not running{reason}")

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Response:
        # SGLang's shape, built by the service; off the event loop: the dump can be large
        body = await run_in_threadpool(lambda: msgspec.json.encode(svc.server_info()))
        return Response(body, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(svc.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        name = svc.config.model_name
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": int(svc.startup_time),
                        "owned_by": "dspark-obs",
                        "root": name,
                    }
                ],
            }
        )

    @app.get("/model_info")
    async def model_info() -> Response:
        return _json({"model_path": svc.config.model_name, "is_generation": True})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        return Response(b"Cache flushed.\n", media_type="text/plain")

    # ------------------------------------------------------------------ control

    @app.api_route("/set_internal_state", methods=["POST", "PUT"])
    async def set_internal_state(request: Request) -> Response:
        body = await _parse(request, InternalStateRequest, limits)
        return _json({"updated": _set_internal_state(svc, body.server_args)})

    # ------------------------------------------------------------------ generation

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        body = await _parse(request, GenerateRequest, limits)
        if body.input_ids is not None:
            _check_ids(body.input_ids, limits)
            ids = list(body.input_ids)
        else:
            assert body.text is not None
            _check_chars(len(body.text), "text", limits)
            ids = await run_in_threadpool(svc.codec.encode, body.text)
        group = submit(svc, limits, ids, body.sampling, body.rid)
        if not body.stream:
            await wait_done(group, request)
            outs = [generate_out(g) for g in group.gens]
            return _json(outs[0] if len(outs) == 1 else outs)
        return GroupStream(group, generate_stream(group))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _parse(request, ChatRequest, limits)
        chars = sum(len(m.text()) + len(m.role) for m in body.messages)
        _check_chars(chars, "messages", limits)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = await run_in_threadpool(svc.codec.chat, messages)
        group = submit(svc, limits, ids, body.sampling(), body.rid)
        reply = ChatReply(body, group, body.model or svc.config.model_name)
        if not body.stream:
            await wait_done(group, request)
            return _json(reply.complete())
        return GroupStream(group, reply.stream())

    return app


# ---------------------------------------------------------------- request bodies


class _HeadLimits:
    """ASGI middleware: a request line or header block over the limits is refused (414,
    431) before routing; h11 bounds only a head that arrives in pieces."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            head = sum(len(k) + len(v) for k, v in scope.get("headers") or ())
            if target > MAX_TARGET_BYTES:
                return await _error(
                    414, f"request target of {target} bytes exceeds {MAX_TARGET_BYTES}"
                )(scope, receive, send)
            if head > MAX_HEAD_BYTES:
                return await _error(
                    431, f"request headers of {head} bytes exceed {MAX_HEAD_BYTES}"
                )(scope, receive, send)
        await self.app(scope, receive, send)


async def _parse(request: Request, model: type[ModelT], limits: HttpLimits) -> ModelT:
    """Read the body under the size limit, then validate it strictly (400 naming fields)."""
    raw = await _read_body(request, limits.max_body_bytes)
    if not raw.strip():
        raise HttpError(400, "the request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise HttpError(400, _describe(exc)) from None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(413, f"request body of {declared} bytes exceeds the limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HttpError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def _describe(exc: ValidationError, most: int = 6) -> str:
    """Pydantic's errors as ``field.path: reason`` (no input echoed: it may be huge); the
    alternatives of a union are folded into one line per field."""
    by_field: dict[str, list[str]] = {}
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    for err in errors:
        path = [str(p) for p in err["loc"]]
        while path and _is_union_tag(path[-1]):
            path.pop()
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown parameter"
        elif err["type"] == "json_invalid":
            msg = f"the request body is not valid JSON: {msg.removeprefix('Invalid JSON: ')}"
        reasons = by_field.setdefault(".".join(path), [])
        if msg not in reasons:
            reasons.append(msg)
    parts = [
        f"{loc}: {' | '.join(r)}" if loc else " | ".join(r)
        for loc, r in list(by_field.items())[:most]
    ]
    if len(by_field) > most:
        parts.append(f"... and {len(by_field) - most} more fields")
    return "; ".join(parts)


def _is_union_tag(part: str) -> bool:
    """Pydantic names a union member in the error path (``str``, ``list[str]``, ...)."""
    return (
        part in {"bool", "int", "float", "str", "none", "dict", "list"}
        or any(c in part for c in "[]")
        or part.startswith(("literal", "function-", "constrained-"))
    )


def _check_chars(chars: int, field: str, limits: HttpLimits) -> None:
    bound = limits.max_prompt_chars
    if bound is not None and chars > bound:
        raise HttpError(
            400,
            f"{field} of {chars} characters cannot fit the context of "
            f"{limits.context_tokens} tokens (at most {bound} characters are accepted)",
        )


def _check_ids(ids: list[int], limits: HttpLimits) -> None:
    if not ids:
        raise HttpError(400, "input_ids is empty")
    if len(ids) > limits.context_tokens:
        raise HttpError(
            400, f"input_ids of {len(ids)} tokens exceeds the context of {limits.context_tokens}"
        )


# ---------------------------------------------------------------- /set_internal_state


def _set_internal_state(svc: EngineService, args: dict[str, Any]) -> bool:
    """SGLang's rule: every key is checked first; an unknown key or a value out of range
    updates nothing (``false``); a value of the wrong type is a 400 (pydantic, as SGLang)."""
    known = {k: v for k, v in args.items() if k in ServerArgsUpdate.model_fields}
    try:
        update = ServerArgsUpdate.model_validate(known)
    except ValidationError as exc:
        raise HttpError(400, "server_args." + _describe(exc)) from None
    if len(known) != len(args):
        return False
    frac = update.dspark_force_budget_frac
    if frac is not None and not 0.0 < frac <= 1.0:
        return False
    if "dspark_force_budget_frac" in known:
        svc.set_forced_budget_frac(frac)
    if update.dspark_clear_info_records:
        svc.clear_records()
    return True
