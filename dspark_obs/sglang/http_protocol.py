"""uvicorn's h11 protocol with the engine-server's connection rules.

uvicorn handles the HTTP framing (Content-Length checks, header-size limit, keep-alive); this
subclass adds what a server facing hostile clients needs beyond that:

* every protocol-level refusal is a JSON error with h11's own status hint (400, 431, 501)
  instead of uvicorn's plain-text 400;
* a connection cap: past ``max_connections`` open connections a new one gets a JSON 503
  and is closed (uvicorn's own limit answers in plain text);
* a request deadline: a request whose head and body have not fully arrived within
  ``request_timeout_s`` of its first byte gets a JSON 408 and is closed, so a client that
  announces more bytes than it sends (or trickles headers) holds nothing for long.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["GuardedH11Protocol", "error_body"]


def error_body(status: int, message: str) -> bytes:
    """The engine-server's one error shape (OpenAI's, as SGLang's handlers answer)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return msgspec.json.encode({"error": {"message": message, "type": kind, "code": status}})


class GuardedH11Protocol(H11Protocol):
    """One connection; ``max_connections`` and ``request_timeout_s`` come from the class
    (set by :func:`guarded_protocol`)."""

    max_connections = 512
    request_timeout_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._protocol_error: h11.RemoteProtocolError | None = None
        self._deadline: asyncio.TimerHandle | None = None
        real_next_event = self.conn.next_event

        def next_event() -> Any:  # keep h11's reason, which uvicorn replaces by a fixed text
            try:
                return real_next_event()
            except h11.RemoteProtocolError as exc:
                self._protocol_error = exc
                raise

        self.conn.next_event = next_event  # type: ignore[method-assign]

    # ---------------------------------------------------------------- connection cap

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._reply_and_close(
                503, f"too many connections (limit {self.max_connections}); retry later"
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    # ---------------------------------------------------------------- request deadline

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is not h11.DONE:
            self._deadline = self.loop.call_later(self.request_timeout_s, self._timed_out)
        super().data_received(data)
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._cancel_deadline()  # the whole request is in: the handler's time is its own

    def on_response_complete(self) -> None:
        if self.conn.their_state is not h11.SEND_BODY:  # else: a refused body still arrives
            self._cancel_deadline()  # and uvicorn drains it, within the same deadline
        super().on_response_complete()

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the handler's body read ends; nothing more to send
            self.cycle.message_event.set()
        message = (
            f"the request did not arrive within {self.request_timeout_s:g} s "
            "(incomplete head or body)"
        )
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and (
            self.cycle is None or not self.cycle.response_started
        ):
            self._reply_and_close(408, message)
        else:
            self.transport.close()

    # ---------------------------------------------------------------- JSON refusals

    def send_400_response(self, msg: str) -> None:
        exc = self._protocol_error
        status = exc.error_status_hint if exc is not None else 400
        reason = str(exc)[:120] if exc is not None else msg
        if status == 431:
            reason = "request head too large (request line or headers over the limit)"
        self._reply_and_close(status, f"invalid HTTP request: {reason}")

    def _reply_and_close(self, status: int, message: str) -> None:
        """Write a complete JSON error response by hand (h11's state may be broken)."""
        body = error_body(status, message)
        phrase = _PHRASES.get(status, "Error")
        head = (
            f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode("ascii")
        self._cancel_deadline()
        if not self.transport.is_closing():
            self.transport.write(head + body)
            self.transport.close()


_PHRASES = {
    400: "Bad Request",
    408: "Request Timeout",
    413: "Content Too Large",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    501: "Not Implemented",
    503: "Service Unavailable",
}


def guarded_protocol(max_connections: int, request_timeout_s: float) -> type[GuardedH11Protocol]:
    """A protocol class with these limits (uvicorn instantiates the class per connection)."""
    return type(
        "EngineServerProtocol",
        (GuardedH11Protocol,),
        {"max_connections": max_connections, "request_timeout_s": request_timeout_s},
    )
