"""A scripted HTTP server that speaks SGLang 0.5.23's serving formats, for client tests.

Test double: the real SGLang DSpark server needs a GPU. This one streams SSE exactly as
SGLang's /generate (cumulative or incremental chunks, meta_info with spec fields) and its
OpenAI /v1/chat/completions (deltas, continuous usage, sglext spec details and output ids)
do, over real HTTP/1.1 chunked transfer, with scripted delays so TTFT and TPOT can be
checked against hand-timed streams. Its "model" is a deterministic token recurrence;
switches make it faulty on purpose (a perturbed greedy token, sampling state that leaks
into later greedy requests).
"""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

GAMMA = 5


class FakeServer:
    """Serve on 127.0.0.1 (a free port); ``url`` once started; use as a context manager."""

    def __init__(self, *, vocab: int = 1000, ttft_s: float = 0.0, step_s: float = 0.0,
                 style: str = "cumulative", accept: tuple[int, ...] = (3, 1, 2),
                 perturb_at: int | None = None, leak_sampling: bool = False,
                 continuous_usage: bool = True):
        self.vocab, self.ttft_s, self.step_s, self.style = vocab, ttft_s, step_s, style
        self.accept, self.perturb_at, self.leak_sampling = accept, perturb_at, leak_sampling
        self.continuous_usage = continuous_usage
        self._leaked: tuple[float, int] | None = None
        self.requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                if self.path == "/health":
                    self._json({})
                elif self.path == "/server_info":
                    self._json({"model_path": "fake-model", "speculative_algorithm": "DSPARK",
                                "speculative_num_draft_tokens": GAMMA + 1,
                                "internal_states": [{"dspark_info_record": {
                                    "mode": "compact", "gamma": GAMMA, "records": []}}]})
                else:
                    self.send_error(404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                fake.requests.append(body)
                if self.path == "/flush_cache":
                    self._json({})
                elif self.path == "/generate":
                    self._stream(fake._generate_events(body))
                elif self.path == "/v1/chat/completions":
                    self._stream(fake._chat_events(body))
                else:
                    self.send_error(404)

            def _json(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, events):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for delay, payload in events:
                        if delay:
                            time.sleep(delay)
                        data = f"data: {payload}\n\n".encode()
                        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):  # the client hung up
                    self.close_connection = True

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeServer:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------ the "model"
    def tokens(self, prompt: list[int], n: int, temperature: float, seed: int | None,
               ignore_eos: bool = True) -> list[int]:
        if temperature == 0 and self._leaked is not None:
            temperature, seed = self._leaked  # the fault: a previous request's sampling state
        if temperature > 0 and self.leak_sampling:
            self._leaked = (temperature, seed or 0)
        rng = random.Random(seed)
        out, prev = [], sum(prompt) % self.vocab
        for pos in range(n):
            if temperature > 0:
                tok = rng.randrange(self.vocab)
            else:
                tok = (prev * 7919 + pos * 104729 + 13) % self.vocab
            if self.perturb_at == pos and temperature == 0:
                tok = (tok + 1) % self.vocab
            out.append(tok)
            prev = tok
        return out

    def steps(self, n: int) -> list[int]:
        """Tokens committed per decode step (cycling ``accept``), summing to n."""
        sizes, i = [], 0
        while sum(sizes) < n:
            sizes.append(min(self.accept[i % len(self.accept)], n - sum(sizes)))
            i += 1
        return sizes

    def spec_meta(self, n: int) -> dict:
        steps = self.steps(n)
        hist = [0] * (GAMMA + 1)
        for s in steps:
            hist[s - 1] += 1
        return {"spec_verify_ct": len(steps), "spec_accept_length": n / len(steps),
                "spec_num_correct_drafts": n - len(steps),
                "spec_num_proposed_drafts": len(steps) * GAMMA,
                "spec_accept_rate": (n - len(steps)) / (len(steps) * GAMMA),
                "spec_correct_drafts_histogram": hist}

    def _plan(self, body: dict, prompt: list[int], n: int, temperature: float, seed):
        ids = self.tokens(prompt, n, temperature, seed)
        return ids, self.steps(n)

    def _generate_events(self, body: dict):
        sp = body.get("sampling_params", {})
        prompt = body.get("input_ids") or list(body.get("text", "").encode())
        n = sp["max_new_tokens"]
        ids, steps = self._plan(body, prompt, n, sp.get("temperature", 0.0),
                                sp.get("sampling_seed"))
        done = 0
        for k, size in enumerate(steps):
            new = ids[done:done + size]
            done += size
            last = done == n
            meta = {"id": body.get("rid"), "prompt_tokens": len(prompt),
                    "completion_tokens": done,
                    "finish_reason": {"type": "length", "length": n} if last else None}
            if last:
                meta.update(self.spec_meta(n))
            if self.style == "incremental":
                event = {"text": "".join(f"<{t}>" for t in new), "output_ids": new}
            else:
                event = {"text": "".join(f"<{t}>" for t in ids[:done]),
                         "output_ids": ids[:done]}
            event["meta_info"] = meta
            yield (self.ttft_s if k == 0 else self.step_s), json.dumps(event)
        yield 0.0, "[DONE]"

    def _chat_events(self, body: dict):
        prompt = list(json.dumps(body["messages"]).encode())
        n = body["max_tokens"]
        ids, steps = self._plan(body, prompt, n, body.get("temperature", 0.0), body.get("seed"))
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m"}
        yield 0.0, json.dumps({**base, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        done = 0
        for k, size in enumerate(steps):
            new = ids[done:done + size]
            done += size
            event = {**base, "choices": [
                {"index": 0, "delta": {"content": "".join(f"<{t}>" for t in new)}}]}
            if self.continuous_usage:
                event["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": done,
                                  "total_tokens": len(prompt) + done}
            yield (self.ttft_s if k == 0 else self.step_s), json.dumps(event)
        yield 0.0, json.dumps({**base, "choices": [
            {"index": 0, "delta": {}, "finish_reason": "length"}]})
        yield 0.0, json.dumps({**base, "choices": [], "sglext": {
            "spec_tokens_details": self.spec_meta(n), "output_ids": [ids]}})
        yield 0.0, json.dumps({**base, "choices": [], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": n,
            "total_tokens": len(prompt) + n}})
        yield 0.0, "[DONE]"


@pytest.fixture
def fake_server():
    with FakeServer() as server:
        yield server


def test_fake_model_is_deterministic_and_faults_switch_on():
    ok, bad = FakeServer(), FakeServer(perturb_at=3)
    try:
        a, b = ok.tokens([1, 2], 8, 0.0, None), bad.tokens([1, 2], 8, 0.0, None)
        assert a == ok.tokens([1, 2], 8, 0.0, None)
        assert a[:3] == b[:3] and a[3] != b[3]
        assert ok.steps(7) == [3, 1, 2, 1]
    finally:
        for s in (ok, bad):
            s._server.server_close()
