"""engine-server against hostile clients (issue 19): raw sockets and http.client on loopback
against a real server with the tiny random model. Every refusal is a JSON error naming the
problem, arrives before work proportional to the request, and nothing a refused or abandoned
request did keeps holding the engine."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dspark_obs.sglang.engine_server import EngineServer, ServerOptions, build_service
from dspark_obs.sglang.http_limits import HttpLimits
from dspark_obs.testing.tiny_models import byte_models

BOUND_S = 60.0  # generous bound on a condition that must come true (never a speed claim)


@contextlib.contextmanager
def serving(**limits: Any) -> Iterator[EngineServer]:
    svc = build_service(ServerOptions(port=0, max_batch=4), env={}, models=byte_models())
    opts = {"request_timeout_s": 1.0, **limits}
    srv = EngineServer(svc, "127.0.0.1", 0, HttpLimits.for_service(svc, **opts)).start()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def server() -> Iterator[EngineServer]:
    with serving() as srv:
        yield srv


def _port(srv: EngineServer) -> int:
    return int(srv.url.rsplit(":", 1)[1])


def _raw(srv: EngineServer, data: bytes, timeout: float = BOUND_S) -> tuple[int, dict, bytes]:
    """Send raw bytes, read the response to the end (the server closes or it is complete)."""
    with socket.create_connection(("127.0.0.1", _port(srv)), timeout=timeout) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(data)
        return _read_response(sock)


def _read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), f"not an HTTP/1.1 response: {buf[:80]!r}"
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    length = int(headers.get("content-length", -1))
    while length < 0 or len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def _post(
    srv: EngineServer,
    path: str,
    body: Any,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", _port(srv), timeout=BOUND_S)
    try:
        data = raw if raw is not None else json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _json_error(status: int, headers: dict, body: bytes, expect: int, *words: str) -> str:
    assert status == expect, (status, body[:300])
    assert headers.get("content-type", "").startswith("application/json"), headers
    message = json.loads(body)["error"]["message"]
    for word in words:
        assert word in message, (word, message)
    return message


def _wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not cond():
        assert time.monotonic() < deadline, f"never true: {what}"
        time.sleep(0.02)


def _generated_tokens(srv: EngineServer) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", _port(srv), timeout=BOUND_S)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    for fam in text_string_to_metric_families(text):
        if fam.name == "sglang:generation_tokens":
            return sum(s.value for s in fam.samples if s.name.endswith("_total"))
    raise AssertionError("no sglang:generation_tokens counter")


def _generate(srv: EngineServer, sampling: dict, prompt: str = "hello", **extra: Any) -> dict:
    status, _, body = _post(
        srv, "/generate", {"text": prompt, "sampling_params": sampling, **extra}
    )
    assert status == 200, body[:300]
    return json.loads(body)


# ---------------------------------------------------------------- cost bounded first


def test_text_longer_than_the_context_is_refused_before_tokenizing(server):
    svc = server.service
    calls: list[int] = []
    real = svc.codec.encode
    svc.codec.encode = lambda text: calls.append(len(text)) or real(text)  # type: ignore
    try:
        bound = server.limits.max_prompt_chars
        assert bound == 1024  # tiny model: 1024 positions, one character per token
        status, headers, body = _post(server, "/generate", {"text": "a" * (bound + 1)})
        _json_error(status, headers, body, 400, "1025 characters", "context of 1024")
        chat = {"messages": [{"role": "user", "content": "b" * 5000}]}
        _json_error(*_post(server, "/v1/chat/completions", chat), 400, "messages", "context")
        assert calls == []  # nothing was tokenized
        # past the body limit (derived from the context): refused on the header alone
        big = server.limits.max_body_bytes + 1
        status, headers, body = _raw(
            server,
            (
                f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {big}\r\n"
                'Content-Type: application/json\r\n\r\n{"text": "'
            ).encode(),
        )
        _json_error(status, headers, body, 413, "exceeds the limit")
        # a 10 MB body is refused whole, the server keeps serving
        status, headers, body = _post(
            server, "/generate", None, raw=b'{"text": "' + b"x" * (10 << 20) + b'"}'
        )
        _json_error(status, headers, body, 413, "limit")
        assert _generate(server, {"max_new_tokens": 3})["meta_info"]["completion_tokens"] == 3
    finally:
        svc.codec.encode = real  # type: ignore[method-assign]


def test_body_limit_follows_the_tokenizer_bound_on_smollm2():
    """The character bound holds on the real SmolLM2 tokenizer for texts built to pack many
    characters into few tokens (runs of spaces, repeated words, long digits)."""
    from pathlib import Path

    tok_dir = next(Path.home().joinpath(".cache", "dspark-obs").glob("*.tokenizer"), None)
    if tok_dir is None:
        pytest.skip("the SmolLM2 tokenizer is not cached (make install fetches it)")
    from transformers import AutoTokenizer

    from dspark_obs.sglang.codec import TokenizerCodec
    from dspark_obs.sglang.http_limits import max_token_chars

    codec = TokenizerCodec(AutoTokenizer.from_pretrained(tok_dir))
    per_token = max_token_chars(codec)
    assert per_token is not None and 8 <= per_token <= 512
    texts = [
        " " * 4000,
        "\n" * 4000,
        "the " * 1000,
        "9" * 4000,
        "ab" * 2000,
        "é" * 2000,
        "hello world " * 300,
        "=" * 4000,
        "-" * 4000,
    ]
    for text in texts:
        assert len(codec.encode(text)) * per_token >= len(text), text[:20]


def test_huge_numbers_and_deep_nesting_are_a_400_not_a_dropped_connection(server):
    digits = "1" + "0" * 400
    for path, template in [
        ("/generate", '{"text": "a", "sampling_params": {"temperature": %s}}'),
        ("/generate", '{"text": "a", "sampling_params": {"top_p": %s}}'),
        ("/generate", '{"text": "a", "sampling_params": {"max_new_tokens": %s}}'),
        ("/generate", '{"text": "a", "sampling_params": {"top_k": -%s}}'),
        ("/generate", '{"text": "a", "sampling_params": {"sampling_seed": %s}}'),
        ("/generate", '{"input_ids": [%s]}'),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "x"}], "temperature": %s}',
        ),
        ("/set_internal_state", '{"server_args": {"dspark_force_budget_frac": %s}}'),
        ("/generate", '{"text": "a", "sampling_params": {"temperature": 1e999}}'),
        ("/generate", '{"text": "a", "sampling_params": {"temperature": NaN}}'),
    ]:
        raw = template.replace("%s", digits)
        status, headers, body = _post(server, path, None, raw=raw.encode())
        field = raw.split('"')[-2] if "server_args" not in raw else "dspark_force_budget_frac"
        _json_error(status, headers, body, 400, field)
    for path in ("/generate", "/v1/chat/completions", "/set_internal_state"):
        deep = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        _json_error(*_post(server, path, None, raw=deep), 400, "not valid JSON", "recursion")
    for raw in (b"{", b"nul", b'{"text": "\\ud800"}', b"\xff\xfe", b"[]", b'"text"'):
        status, headers, body = _post(server, "/generate", None, raw=raw)
        _json_error(status, headers, body, 400)


def test_malformed_chat_is_refused_before_a_stream_starts(server):
    good = {"role": "user", "content": "hi"}
    for body, word in [
        ({"messages": [1, 2]}, "messages.0"),
        ({"messages": ["hi"]}, "messages.0"),
        ({"messages": [{"content": "hi"}]}, "role"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"messages": [{"role": "user", "content": 5}]}, "content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "content"),
        ({"messages": []}, "messages"),
        ({"messages": [good], "n": "abc"}, "n"),
        ({"messages": [good], "n": [1]}, "n"),
        ({"messages": [good], "n": 0}, "n"),
        ({"messages": [good], "stream": True, "stream_options": "yes"}, "stream_options"),
        ({"messages": [good], "stream": "yes"}, "stream"),
        ({"messages": [good], "max_tokens": -1}, "max_tokens"),
        ({"messages": [good], "temperature": True}, "temperature"),
    ]:
        _json_error(*_post(server, "/v1/chat/completions", body), 400, word)


# ---------------------------------------------------------------- HTTP framing


def test_bad_content_lengths_answer_json_and_hold_nothing(server):
    for value in ("abc", "-1", "1, 2", "99999999999999999999999999"):
        status, headers, body = _raw(
            server,
            (
                f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {value}\r\n\r\n"
                '{"text": "a"}'
            ).encode(),
        )
        assert status in (400, 413), (value, status)
        _json_error(status, headers, body, status)
    # a length larger than the body: the request deadline answers 408 and closes
    status, headers, body = _raw(
        server, b'POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{"text": "a"'
    )
    _json_error(status, headers, body, 408, "did not arrive")
    # a chunked body past the limit: 413 at once; if it keeps coming, the deadline ends it
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=BOUND_S) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n" % (1 << 30)
            + b"x" * (server.limits.max_body_bytes + 1)
        )
        status, headers, body = _read_response(sock)
        _json_error(status, headers, body, 413, "limit")
        deadline = time.monotonic() + BOUND_S
        with contextlib.suppress(OSError):
            while time.monotonic() < deadline:
                sock.sendall(b"x" * 1000)
                sock.settimeout(0.1)
                with contextlib.suppress(TimeoutError):
                    if not sock.recv(1):
                        break
        assert time.monotonic() < deadline, "the drained connection was never closed"
    # a head that never ends likewise
    status, headers, body = _raw(server, b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: 1")
    _json_error(status, headers, body, 408)


def test_a_hundred_slow_clients_hold_no_threads(server):
    before = threading.active_count()
    socks = []
    try:
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", _port(server)), timeout=BOUND_S)
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            socks.append(s)
        assert _generate(server, {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
        assert threading.active_count() <= before + 2  # no thread per connection
        for s in socks:  # each is answered by the request deadline, then closed
            status, _, body = _read_response(s)
            assert status == 408 and json.loads(body)["error"]["code"] == 408
    finally:
        for s in socks:
            s.close()


def test_every_protocol_error_is_a_json_http11_response(server):
    cases = [
        (b"GET /\r\n\r\n", 400),  # HTTP/0.9 style request line
        (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03junk\r\n\r\n", 400),  # TLS hello
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),  # URI too long
        (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
        (
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            400,
        ),
        (b"BREW /generate HTTP/1.1\r\nHost: x\r\n\r\n", 405),
        (b"GET /generate HTTP/1.1\r\nHost: x\r\n\r\n", 405),
        (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404),
        (b"GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    ]
    for data, expect in cases:
        status, headers, body = _raw(server, data)
        _json_error(status, headers, body, expect)


# ---------------------------------------------------------------- sampling parameters


def test_unsupported_and_unknown_parameters_are_refused_by_name(server):
    for sp, word in [
        ({"regex": "a+"}, "regex"),
        ({"json_schema": '{"type": "object"}'}, "json_schema"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"min_p": 0.1}, "min_p"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"ebnf": "root ::= 'a'"}, "ebnf"),
        ({"temprature": 0.5}, "temprature"),
        ({"n": 17}, "n"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["s"] * 33}, "stop"),
        ({"stop_token_ids": [100000]}, "stop token id"),
        ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens"),
    ]:
        status, headers, body = _post(server, "/generate", {"text": "a", "sampling_params": sp})
        _json_error(status, headers, body, 400, word)
    _json_error(
        *_post(server, "/generate", {"text": "a", "return_logprob": True}), 400, "return_logprob"
    )
    _json_error(*_post(server, "/generate", {"text": "a", "colour": 1}), 400, "colour", "unknown")
    _json_error(
        *_post(
            server,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
        ),
        400,
        "tools",
    )
    # SGLang's defaults, sent explicitly by its clients, are fine
    out = _generate(
        server,
        {
            "max_new_tokens": 2,
            "frequency_penalty": 0.0,
            "regex": None,
            "repetition_penalty": 1.0,
            "skip_special_tokens": True,
            "n": 1,
        },
        return_logprob=False,
    )
    assert out["meta_info"]["completion_tokens"] == 2


def test_stop_strings_cut_the_text_and_end_the_request(server):
    sampled = {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}
    full = _generate(server, sampled)  # seeded: the same tokens again until the stop
    text, ids = full["text"], full["output_ids"]
    stop = next(text[i : i + 2] for i in range(4, 30) if text[i : i + 2] not in text[: i + 1])
    pos = text.find(stop)
    before = _generated_tokens(server)
    out = _generate(server, {**sampled, "stop": [stop, "never-there"]})
    assert out["text"] == text[:pos]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ids[: pos + 2]  # up to the token that completed the match
    assert out["meta_info"]["completion_tokens"] == pos + 2
    _wait_until(lambda: server.service.running == 0, "the stopped request is released")
    assert _generated_tokens(server) - before < 40  # cancelled: the engine did not go on
    kept = _generate(server, {**sampled, "stop": stop, "no_stop_trim": True})
    assert kept["text"] == text[: pos + 2]
    # streamed: no chunk ever shows text that the stop string later takes back
    status, _, body = _post(
        server,
        "/generate",
        {"text": "hello", "stream": True, "sampling_params": {**sampled, "stop": stop}},
    )
    chunks = [json.loads(e[6:]) for e in body.decode().split("\n\n") if e[6:] not in ("", "[DONE]")]
    assert status == 200 and chunks[-1]["text"] == text[:pos]
    assert all(text[:pos].startswith(c["text"]) for c in chunks)
    chat = {
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
        **sampled,
        "max_tokens": 40,
        "seed": 3,
    }
    del chat["max_new_tokens"], chat["sampling_seed"]
    full_chat = _post(server, "/v1/chat/completions", {**chat, "stream": False})
    content = json.loads(full_chat[2])["choices"][0]["message"]["content"]
    cut = content[6:8]
    status, _, body = _post(server, "/v1/chat/completions", {**chat, "stop": cut})
    events = [json.loads(e[6:]) for e in body.decode().split("\n\n") if e[6:] not in ("", "[DONE]")]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in events if c["choices"])
    assert status == 200 and streamed == content[: content.find(cut)]


def test_stop_token_ids_and_min_new_tokens(server):
    sampled = {"max_new_tokens": 30, "temperature": 1.0, "sampling_seed": 5}
    ids = _generate(server, sampled)["output_ids"]
    k = next(i for i in range(2, 20) if ids[i] not in ids[:i])
    stop_id = ids[k]
    out = _generate(server, {**sampled, "stop_token_ids": [stop_id]})
    assert out["output_ids"] == ids[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["text"] == "".join(chr(t) for t in ids[:k])  # the stop token is trimmed
    late = _generate(server, {**sampled, "stop_token_ids": [stop_id], "min_new_tokens": k + 3})
    assert len(late["output_ids"]) >= k + 3
    assert stop_id not in late["output_ids"][: k + 3]  # masked until min_new_tokens
    if late["meta_info"]["finish_reason"]["type"] == "stop":
        assert late["output_ids"].index(stop_id) == len(late["output_ids"]) - 1


def test_penalties_are_applied_and_out_of_range_ones_refused_by_name(server):
    greedy = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    plain = _generate(server, greedy)["output_ids"]
    penalized = {**greedy, "frequency_penalty": 2.0, "repetition_penalty": 2.0}
    out = _generate(server, penalized)["output_ids"]
    assert out != plain  # applied, not ignored
    assert out == _generate(server, penalized)["output_ids"]  # greedy: deterministic
    assert max(out.count(t) for t in out) < max(plain.count(t) for t in plain)
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    for body, word in [
        ({**chat, "frequency_penalty": 3.0}, "frequency_penalty"),
        ({**chat, "presence_penalty": -2.5}, "presence_penalty"),
        ({**chat, "repetition_penalty": -1.0}, "repetition_penalty"),
    ]:
        _json_error(*_post(server, "/v1/chat/completions", body), 400, word)
    status, _, body = _post(server, "/v1/chat/completions", {**chat, "presence_penalty": 1.0})
    assert status == 200, body[:300]


def test_n_samples_one_request_each_with_its_own_seed(server):
    outs = _generate(
        server,
        {"max_new_tokens": 12, "temperature": 1.0, "n": 3, "sampling_seed": 7, "ignore_eos": True},
    )
    assert isinstance(outs, list) and len(outs) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # distinct seeds, distinct samples
    assert all(o["meta_info"]["completion_tokens"] == 12 for o in outs)
    again = _generate(
        server,
        {"max_new_tokens": 12, "temperature": 1.0, "n": 3, "sampling_seed": 7, "ignore_eos": True},
    )
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]  # seeded
    status, _, body = _post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "n": 2,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    reply = json.loads(body)
    assert status == 200 and [c["index"] for c in reply["choices"]] == [0, 1]
    assert reply["usage"]["completion_tokens"] == 12


# ---------------------------------------------------------------- /set_internal_state


def test_set_internal_state_is_strictly_typed(server):
    svc = server.service
    _generate(server, {"max_new_tokens": 4})
    assert svc.dump().records
    for body, word in [
        ({"server_args": {"dspark_clear_info_records": "false"}}, "dspark_clear_info_records"),
        ({"server_args": {"dspark_clear_info_records": 2}}, "dspark_clear_info_records"),
        ({"server_args": {"dspark_force_budget_frac": True}}, "dspark_force_budget_frac"),
        ({"server_args": {"dspark_force_budget_frac": "0.5"}}, "dspark_force_budget_frac"),
        ({"server_args": {"anything": {"nested": 1}}}, "anything"),
        ({"server_args": "clear"}, "server_args"),
        ({"server_args": [1]}, "server_args"),
        ({}, "server_args"),
        ({"server_args": {}, "extra": 1}, "extra"),
        ([1, 2], ""),
    ]:
        status, headers, body_out = _post(server, "/set_internal_state", body)
        _json_error(status, headers, body_out, 400, word)
    assert svc.dump().records  # nothing was cleared
    assert svc.engine.scheduler.forced_budget_frac is None
    ok = _post(server, "/set_internal_state", {"server_args": {"dspark_clear_info_records": 1}})
    assert json.loads(ok[2]) == {"updated": True} and not svc.dump().records


# ---------------------------------------------------------------- clients that go away


def _open_stream(srv: EngineServer, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", _port(srv)), timeout=BOUND_S)
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    got = b""
    while got.count(b"data: ") < 2:  # the stream is running
        chunk = sock.recv(65536)
        assert chunk, got[:200]
        got += chunk
    return sock


def test_a_client_that_goes_away_frees_its_batch_slot(server):
    svc = server.service
    _wait_until(lambda: svc.running == 0, "idle before")
    before = _generated_tokens(server)
    long = {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}
    sock = _open_stream(server, {"text": "go", "stream": True, "sampling_params": long})
    assert svc.running == 1
    sock.close()
    _wait_until(lambda: svc.running == 0, "the abandoned stream is cancelled")
    # non-streaming: the client gives up while the request runs
    sock = socket.create_connection(("127.0.0.1", _port(server)), timeout=BOUND_S)
    data = json.dumps({"text": "go", "sampling_params": long}).encode()
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    _wait_until(lambda: svc.running == 1, "the request runs")
    sock.close()
    _wait_until(lambda: svc.running == 0, "the abandoned request is cancelled")
    assert _generated_tokens(server) - before < 2 * 900  # neither ran to its end
    assert _generate(server, {"max_new_tokens": 3})["meta_info"]["completion_tokens"] == 3


# ---------------------------------------------------------------- server-wide bounds


def test_in_flight_and_connection_caps_answer_503_json():
    with serving(max_inflight=1, max_connections=3) as srv:
        long = {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}
        sock = _open_stream(srv, {"text": "go", "stream": True, "sampling_params": long})
        try:
            status, headers, body = _post(srv, "/generate", {"text": "a"})
            _json_error(status, headers, body, 503, "busy")
            extra = [
                socket.create_connection(("127.0.0.1", _port(srv)), timeout=BOUND_S)
                for _ in range(2)
            ]
            try:
                status, headers, body = _raw(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                _json_error(status, headers, body, 503, "too many connections")
            finally:
                for s in extra:
                    s.close()
        finally:
            sock.close()
        _wait_until(lambda: srv.service.running == 0, "cancelled on close")
