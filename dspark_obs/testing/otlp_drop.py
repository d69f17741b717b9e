"""An OTLP/HTTP endpoint on loopback that accepts and drops everything.

Why: the sink-overhead benchmarks measure what exporting costs the engine, so the collector
on the other end must answer at once and keep nothing (a collector stand-in; the OTel sink's
tests use a receiver that records what it gets instead).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["start_otlp_drop"]


class _Drop(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def start_otlp_drop() -> tuple[ThreadingHTTPServer, str]:
    """Serve on a free loopback port in a daemon thread; returns the server (``shutdown()``
    stops it) and its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Drop)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
