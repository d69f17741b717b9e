"""The gate end to end against `dspark-obs engine-server` processes on loopback (tiny models).

The tiny random target (tied embeddings) tends to repeat its last token under greedy, so
parity between different tiny targets says little. Faults are injected instead by a proxy
in front of a real engine-server (a test double of a broken server, on purpose): one flips
a greedy output token, one leaks the last sampled request's temperature and seed into later
greedy requests.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dspark_obs.serving import ServingClient
from dspark_obs.serving.runner import GateOptions, gate_servers

OPTS = GateOptions(prompts=2, parity_tokens=24, parity_workload="random", bench_workload="random",
                   bench_requests=3, bench_input_len=16, bench_output_len=12, warmup=1,
                   vocab_size=128)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(mode: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark_obs", "engine-server", "--tiny", "--port", str(port),
         "--mode", mode],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        ServingClient(url).wait_ready(timeout=120)
    except Exception:
        proc.kill()
        tail = proc.stderr.read()[-2000:]
        raise AssertionError(f"engine-server did not start: {tail!r}") from None
    return proc, url


@pytest.fixture(scope="module")
def servers():
    procs = [_start("static"), _start("compact")]
    yield {"static": procs[0][1], "compact": procs[1][1]}
    for proc, _ in procs:
        proc.terminate()
    for proc, _ in procs:
        proc.wait(timeout=30)


class FaultyProxy:
    """Forwards to ``upstream``; ``flip_at`` flips that greedy output id, ``leak`` leaks state."""

    def __init__(self, upstream: str, *, flip_at: int | None = None, leak: bool = False):
        target = urllib.parse.urlsplit(upstream)
        proxy = self
        self.last_sampled: dict | None = None

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self, method: str):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                greedy = False
                if self.path == "/generate" and body:
                    req = json.loads(body)
                    sp = req.setdefault("sampling_params", {})
                    greedy = sp.get("temperature", 1.0) == 0
                    if not greedy:
                        proxy.last_sampled = {k: sp.get(k) for k in ("temperature",
                                                                      "sampling_seed")}
                    elif leak and proxy.last_sampled is not None:
                        sp.update(proxy.last_sampled)  # the fault
                    body = json.dumps(req).encode()
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
                conn.request(method, self.path, body=body or None,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                self.send_response(resp.status)
                self.send_header("Content-Type", resp.getheader("Content-Type", ""))
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while line := resp.readline():
                    if greedy and flip_at is not None and line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        ids = event.get("output_ids") or []
                        if len(ids) > flip_at:
                            ids[flip_at] = (ids[flip_at] + 1) % 128
                        line = b"data: " + json.dumps(event).encode() + b"\n"
                    self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                conn.close()

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FaultyProxy:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def _gate(base: str, new: str):
    return gate_servers(ServingClient(base), ServingClient(new), OPTS)


def _check(report, name):
    return next(c for c in report.checks if c.name == name)


def test_static_and_compact_servers_of_one_model_pass(servers):
    report = _gate(servers["static"], servers["compact"])
    assert _check(report, "greedy parity").passed, report.to_markdown()
    assert _check(report, "contamination").passed, report.to_markdown()
    assert "token ids" in _check(report, "greedy parity").detail
    assert report.new_summary.accept_length.n == OPTS.bench_requests
    assert report.step_ratio is not None


def test_a_broken_greedy_path_is_caught_at_its_token(servers):
    with FaultyProxy(servers["compact"], flip_at=9) as broken:
        report = _gate(servers["compact"], broken.url)
    parity = _check(report, "greedy parity")
    assert parity.passed is False
    assert {d.index for d in parity.differences} == {9}
    assert "first difference at token 9" in report.to_markdown()


def test_contamination_check_catches_leaked_sampling_state(servers):
    with FaultyProxy(servers["compact"], leak=True) as leaky:
        report = _gate(servers["compact"], leaky.url)
    assert _check(report, "greedy parity").passed  # clean until a sampled request arrives
    leak = _check(report, "contamination")
    assert leak.passed is False and leak.differences, report.to_markdown()
    assert not report.passed
