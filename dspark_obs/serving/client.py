"""A streaming HTTP client for SGLang ``/generate`` and OpenAI-compatible servers.

One request in, one :class:`RequestResult` out: the send time, the arrival time and new-token
count of every streamed chunk, the text, the output token ids where the server returns them,
and SGLang's speculative-decoding ``meta_info`` (``spec_verify_ct``, ``spec_accept_length``,
histograms...). Timing follows SGLang's ``bench_serving``:

* TTFT = arrival of the first chunk that carries a token - send time;
* E2E = end of the stream - send time;
* TPOT = (E2E - TTFT) / (output tokens - 1): TTFT is excluded.

Endpoints: ``messages`` go to ``/v1/chat/completions``; a ``text`` or ``input_ids`` prompt
goes to ``/generate`` (api ``sglang``) or ``/v1/completions`` (api ``openai``). Plain stdlib
``http.client``: one connection per request, so requests on several threads never share a
socket. Both SGLang streaming styles are read: cumulative chunks (the default) and
incremental ones (``--incremental-streaming-output``).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "SPEC_FIELDS",
    "ClientError",
    "GenerationRequest",
    "RequestResult",
    "ServingClient",
]

Api = Literal["sglang", "openai"]

# SGLang 0.5.23's per-request speculative meta_info (finished requests); the same names sit
# in an OpenAI response's sglext.spec_tokens_details.
SPEC_FIELDS = (
    "spec_verify_ct",
    "spec_accept_length",
    "spec_accept_rate",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
    "spec_correct_drafts_histogram",
    "spec_cap_length",
    "spec_block_accept_length",
    "spec_cap_lens_histogram",
)


class ClientError(RuntimeError):
    """The server could not be reached or answered something that is not its protocol."""


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: exactly one of ``messages``, ``text`` or ``input_ids``."""

    rid: str
    max_new_tokens: int
    messages: list[dict[str, str]] | None = None
    text: str | None = None
    input_ids: list[int] | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    workload: str | None = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.messages, self.text, self.input_ids)]
        if sum(given) != 1:
            raise ValueError(f"request {self.rid}: give exactly one of messages, text, input_ids")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.rid}: max_new_tokens must be >= 1")


@dataclass
class RequestResult:
    """What one streamed request produced, with its chunk timeline.

    ``send_time`` is wall-clock (epoch seconds); ``chunk_times`` are seconds after the send
    (a monotonic clock), one per chunk that carried tokens, with ``chunk_tokens`` new tokens
    (fractional only when the server streamed deltas without counts and a final total).
    """

    rid: str
    send_time: float
    send_clock: float = 0.0  # time.perf_counter() at the send, to line requests up
    ok: bool = False
    error: str = ""
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[float] = field(default_factory=list)
    end_time: float = 0.0  # seconds after the send when the stream ended
    text: str = ""
    output_ids: list[int] | None = None
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    workload: str | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from send to the first chunk carrying a token."""
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (TTFT excluded); None for <= 1 token."""
        if self.completion_tokens <= 1 or self.ttft is None:
            return None
        return (self.end_time - self.ttft) / (self.completion_tokens - 1)

    @property
    def accept_length(self) -> float | None:
        """Committed tokens per verify step (bonus included), from the server's meta_info."""
        verify_ct = self.spec.get("spec_verify_ct")
        if verify_ct:
            return self.completion_tokens / verify_ct
        value = self.spec.get("spec_accept_length")
        return float(value) if value else None


class _Stream:
    """Folds streamed chunks into a RequestResult, whatever the chunk style."""

    def __init__(self, result: RequestResult, start: float):
        self.result = result
        self.start = start
        self.ids: list[int] | None = None

    def tokens(self, total: int | None, new_ids: list[int] | None, text: str, cumulative: bool):
        """Record one chunk: ``total`` cumulative completion tokens if the server says so."""
        now = time.perf_counter() - self.start
        r = self.result
        before = r.completion_tokens
        if new_ids is not None:
            if self.ids is None:
                self.ids = []
            if total is not None and len(new_ids) == total:  # cumulative ids (SGLang default)
                self.ids = list(new_ids)
            else:
                self.ids.extend(new_ids)
        if total is None:
            total = len(self.ids) if self.ids is not None else before + (1 if text else 0)
        r.text = text if cumulative else r.text + text
        if total > before:
            r.chunk_times.append(now)
            r.chunk_tokens.append(total - before)
            r.completion_tokens = total

    def finish(self) -> RequestResult:
        r = self.result
        r.end_time = time.perf_counter() - self.start
        if self.ids is not None:
            r.output_ids = self.ids
        counted = sum(r.chunk_tokens)
        if counted and counted != r.completion_tokens:
            # Deltas without per-chunk counts (no continuous usage): one chunk was counted as
            # one token; spread the server's final count over the chunks in proportion.
            scale = r.completion_tokens / counted
            r.chunk_tokens = [c * scale for c in r.chunk_tokens]
        r.ok = not r.error
        return r


class ServingClient:
    """Streaming client of one server (``url`` like ``http://127.0.0.1:30000``).

    ``api`` is ``sglang`` (``/generate`` for token/text prompts) or ``openai``
    (``/v1/completions``); chat messages always use ``/v1/chat/completions``.
    """

    def __init__(self, url: str, api: Api = "sglang", model: str = "default",
                 timeout: float = 600.0):
        parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ClientError(f"not an http(s) URL: {url!r}")
        if api not in ("sglang", "openai"):
            raise ClientError(f"api must be 'sglang' or 'openai', got {api!r}")
        self.url = f"{parsed.scheme}://{parsed.netloc}{parsed.path.rstrip('/')}"
        self._https = parsed.scheme == "https"
        self._host, self._port = parsed.hostname, parsed.port
        self._prefix = parsed.path.rstrip("/")
        self.api: Api = api
        self.model = model
        self.timeout = timeout

    # ------------------------------------------------------------------ plumbing
    def _connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self.timeout)

    def request_json(self, method: str, path: str, body: Any = None) -> Any:
        """One plain JSON request; ClientError on a transport error or a non-2xx status."""
        conn = self._connection()
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            conn.request(method, self._prefix + path, body=payload, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise ClientError(f"{method} {self.url}{path}: {exc}") from exc
        finally:
            conn.close()
        if not 200 <= resp.status < 300:
            raise ClientError(f"{method} {self.url}{path}: HTTP {resp.status}: {data[:300]!r}")
        try:
            return json.loads(data) if data.strip() else None
        except ValueError:
            return data.decode(errors="replace")

    def health(self) -> bool:
        try:
            self.request_json("GET", "/health")
            return True
        except ClientError:
            return False

    def wait_ready(self, timeout: float = 60.0, interval: float = 0.2) -> None:
        """Poll ``/health`` until it answers 200; ClientError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() > deadline:
                raise ClientError(f"{self.url} not healthy after {timeout:.0f} s")
            time.sleep(interval)

    def server_info(self) -> dict | None:
        """SGLang's ``/server_info`` (DSpark step dump inside), or None if not served."""
        try:
            info = self.request_json("GET", "/server_info")
        except ClientError:
            return None
        return info if isinstance(info, dict) else None

    def flush_cache(self) -> bool:
        try:
            self.request_json("POST", "/flush_cache")
            return True
        except ClientError:
            return False

    # ------------------------------------------------------------------ generation
    def payload(self, req: GenerationRequest) -> tuple[str, dict]:
        """The endpoint path and JSON body for ``req``."""
        if req.messages is None and self.api == "sglang":
            sampling = {
                "max_new_tokens": req.max_new_tokens,
                "temperature": req.temperature,
                "top_p": req.top_p,
                "top_k": req.top_k,
                "ignore_eos": req.ignore_eos,
            }
            if req.seed is not None:
                sampling["sampling_seed"] = req.seed
            body: dict[str, Any] = {"rid": req.rid, "sampling_params": sampling, "stream": True}
            body["text" if req.text is not None else "input_ids"] = (
                req.text if req.text is not None else [int(t) for t in req.input_ids]
            )
            return "/generate", body
        body = {
            "model": self.model,
            "max_tokens": req.max_new_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ignore_eos": req.ignore_eos,
            "return_spec_tokens_details": True,
            "return_output_ids_in_sglext": True,
            "rid": req.rid,
        }
        if req.top_k > 0:
            body["top_k"] = req.top_k
        if req.seed is not None:
            body["seed"] = req.seed
        if req.messages is not None:
            body["messages"] = req.messages
            return "/v1/chat/completions", body
        body["prompt"] = req.text if req.text is not None else [int(t) for t in req.input_ids]
        return "/v1/completions", body

    def generate(self, req: GenerationRequest) -> RequestResult:
        """Send ``req``, stream the answer; errors end up in ``result.error``, never raised."""
        path, body = self.payload(req)
        start = time.perf_counter()
        result = RequestResult(rid=req.rid, send_time=time.time(), send_clock=start,
                               workload=req.workload)
        stream = _Stream(result, start)
        conn = self._connection()
        try:
            conn.request("POST", self._prefix + path, body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json",
                                  "Accept": "text/event-stream"})
            resp = conn.getresponse()
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            else:
                read_event = _sglang_event if path == "/generate" else _openai_event
                for data in _sse_data(resp):
                    if data == "[DONE]":
                        break
                    try:
                        event = json.loads(data)
                    except ValueError:
                        result.error = f"not JSON in the stream: {data[:200]!r}"
                        break
                    if not isinstance(event, dict):
                        result.error = f"unexpected stream event: {data[:200]!r}"
                        break
                    if "error" in event:
                        result.error = f"server error: {event['error']}"
                        break
                    read_event(event, stream)
        except (OSError, http.client.HTTPException) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()
        stream.finish()
        if result.ok and result.completion_tokens == 0:
            result.ok, result.error = False, "stream ended without a token"
        return result


def _sse_data(resp: http.client.HTTPResponse):
    """The ``data:`` payloads of a server-sent-event stream, one per event."""
    lines: list[str] = []
    while True:
        raw = resp.readline()
        if not raw:
            break
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if line.startswith("data:"):
            lines.append(line[5:].removeprefix(" "))
        elif not line and lines:
            yield "\n".join(lines)
            lines = []
    if lines:
        yield "\n".join(lines)


def _finish_type(reason: Any) -> str | None:
    if isinstance(reason, dict):
        reason = reason.get("type")
    if reason in ("stop", "length", "abort"):
        return reason
    return None if reason is None else "stop"  # tool_calls / content_filter: stopped


def _take_spec(source: dict | None, result: RequestResult) -> None:
    if isinstance(source, dict):
        for key in SPEC_FIELDS:
            if source.get(key) is not None:
                result.spec[key] = source[key]


def _sglang_event(event: dict, stream: _Stream) -> None:
    """One ``/generate`` chunk: cumulative (default) or incremental text and output_ids."""
    meta = event.get("meta_info") or {}
    total = meta.get("completion_tokens")
    ids = event.get("output_ids")
    text = event.get("text") or ""
    # Cumulative style repeats every id so far: its ids list has completion_tokens entries.
    cumulative = ids is None or total is None or len(ids) == total
    if ids is None and total is not None and text.startswith(stream.result.text):
        cumulative = True
    stream.tokens(total, ids, text, cumulative)
    r = stream.result
    if meta.get("prompt_tokens") is not None:
        r.prompt_tokens = int(meta["prompt_tokens"])
    if meta.get("finish_reason") is not None:
        r.finish_reason = _finish_type(meta["finish_reason"])
    _take_spec(meta, r)


def _openai_event(event: dict, stream: _Stream) -> None:
    """One OpenAI chunk: deltas, continuous usage, and SGLang's sglext at the end."""
    r = stream.result
    usage = event.get("usage") or {}
    total = usage.get("completion_tokens")
    if usage.get("prompt_tokens") is not None:
        r.prompt_tokens = int(usage["prompt_tokens"])
    sglext = event.get("sglext") or {}
    details = sglext.get("spec_tokens_details")
    _take_spec(details[0] if isinstance(details, list) and details else details, r)
    if sglext.get("output_ids"):
        r.output_ids = [int(t) for t in sglext["output_ids"][0]]
        stream.ids = r.output_ids
    for choice in event.get("choices") or []:
        if choice.get("index", 0) != 0:
            continue
        delta = choice.get("delta")
        text = (delta.get("content") if delta is not None else choice.get("text")) or ""
        if text or (total is not None and total > r.completion_tokens):
            stream.tokens(total, None, text, cumulative=False)
        if choice.get("finish_reason") is not None:
            r.finish_reason = _finish_type(choice["finish_reason"])
        _take_spec(choice.get("meta_info"), r)
    if not event.get("choices") and total is not None and total > r.completion_tokens:
        # A final usage-only chunk (no continuous usage): the true count, no new timing.
        r.completion_tokens = int(total)
