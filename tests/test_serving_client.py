"""The streaming client against SGLang-format streams over real HTTP (hand-timed)."""

from __future__ import annotations

import socket

import pytest
from test_serving_fakeserver import GAMMA, FakeServer

from dspark_obs.serving import ClientError, GenerationRequest, ServingClient


def _req(n=7, **kw) -> GenerationRequest:
    return GenerationRequest(rid="r1", input_ids=[5, 6, 7], max_new_tokens=n, **kw)


@pytest.mark.parametrize("style", ["cumulative", "incremental"])
def test_generate_stream_tokens_ids_and_spec_meta(style):
    with FakeServer(style=style) as server:
        res = ServingClient(server.url).generate(_req(7))
        expected = server.tokens([5, 6, 7], 7, 0.0, None)
    assert res.ok, res.error
    assert res.output_ids == expected
    assert res.text == "".join(f"<{t}>" for t in expected)
    assert res.completion_tokens == 7 and res.chunk_tokens == [3, 1, 2, 1]
    assert res.finish_reason == "length" and res.prompt_tokens == 3
    assert res.spec["spec_verify_ct"] == 4
    assert res.accept_length == pytest.approx(7 / 4)
    assert res.spec["spec_correct_drafts_histogram"][:3] == [2, 1, 1]
    sent = server.requests[-1]
    assert sent["input_ids"] == [5, 6, 7] and sent["stream"] is True
    assert sent["sampling_params"]["max_new_tokens"] == 7


def test_tpot_excludes_ttft_on_a_hand_timed_stream():
    # First chunk after 0.4 s (prefill), then 4 more decode steps 0.05 s apart.
    with FakeServer(ttft_s=0.4, step_s=0.05, accept=(2,)) as server:
        res = ServingClient(server.url).generate(_req(10))
    assert res.ok, res.error
    assert len(res.chunk_times) == 5 and res.completion_tokens == 10
    assert 0.4 <= res.ttft < 0.4 + 0.25
    decode = res.e2e - res.ttft
    assert 4 * 0.05 <= decode < 4 * 0.05 + 0.25
    assert res.tpot == pytest.approx(decode / 9)
    # Including TTFT would more than double it: the definition matters here.
    assert res.e2e / 10 > 2 * res.tpot


def test_chat_completions_stream_with_sglext():
    with FakeServer() as server:
        req = GenerationRequest(rid="c1", messages=[{"role": "user", "content": "hi"}],
                                max_new_tokens=6, temperature=0.0)
        res = ServingClient(server.url).generate(req)
        sent = server.requests[-1]
    assert res.ok, res.error
    assert res.completion_tokens == 6 and res.chunk_tokens == [3, 1, 2]
    assert res.output_ids is not None and len(res.output_ids) == 6
    assert res.spec["spec_verify_ct"] == 3 and res.accept_length == pytest.approx(2.0)
    assert res.finish_reason == "length"
    assert sent["stream_options"]["continuous_usage_stats"] is True
    assert sent["return_spec_tokens_details"] is True and sent["max_tokens"] == 6


def test_chat_deltas_without_counts_are_spread_to_the_final_usage():
    with FakeServer(continuous_usage=False) as server:
        req = GenerationRequest(rid="c2", messages=[{"role": "user", "content": "hi"}],
                                max_new_tokens=6)
        res = ServingClient(server.url).generate(req)
    assert res.ok and res.completion_tokens == 6 and len(res.chunk_times) == 3
    assert sum(res.chunk_tokens) == pytest.approx(6) and res.chunk_tokens[0] == 2.0
    assert res.tpot == pytest.approx((res.e2e - res.ttft) / 5)


def test_openai_api_sends_token_prompts_to_completions():
    client = ServingClient("http://127.0.0.1:1", api="openai")
    path, body = client.payload(_req(4, seed=3))
    assert path == "/v1/completions" and body["prompt"] == [5, 6, 7] and body["seed"] == 3


def test_errors_are_results_not_exceptions():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = ServingClient(f"http://127.0.0.1:{port}", timeout=2).generate(_req())
    assert not res.ok and "Connection" in res.error
    with FakeServer() as server:
        client = ServingClient(server.url)
        with pytest.raises(ClientError, match="HTTP 404"):
            client.request_json("GET", "/nope")
        assert client.server_info()["internal_states"][0]["dspark_info_record"]["gamma"] == GAMMA
    with pytest.raises(ClientError, match="not an http"):
        ServingClient("ftp://x")
    with pytest.raises(ValueError, match="exactly one"):
        GenerationRequest(rid="x", max_new_tokens=3)
