"""engine-server speaks SGLang's HTTP surfaces: /generate (plain and SSE), OpenAI chat with
spec details, /server_info step dump rules, /set_internal_state, /metrics, verify mode from
SGLANG_RAGGED_VERIFY_MODE; bad input is a 400 naming the problem. Tiny random model."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from dspark_obs.cli import app
from dspark_obs.sglang.engine_server import (
    EngineServer,
    ServerError,
    ServerOptions,
    build_service,
    resolve_components,
    resolve_mode,
)
from dspark_obs.testing.tiny_models import byte_models


@pytest.fixture(scope="module")
def server():
    svc = build_service(ServerOptions(port=0, max_batch=4),
                        env={"SGLANG_RAGGED_VERIFY_MODE": "cap-accept"}, models=byte_models())
    srv = EngineServer(svc, "127.0.0.1", 0).start()
    yield srv
    srv.close()


def _call(srv, path, body=None, raw=False):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(srv.url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = resp.read()
    return out if raw else json.loads(out)


def _error(srv, path, body):
    with pytest.raises(urllib.error.HTTPError) as info:
        _call(srv, path, body)
    assert info.value.code == 400
    return json.loads(info.value.read())["error"]["message"]


def test_mode_and_components_resolved_as_sglang_does():
    assert resolve_mode(None, {}) == "static"
    assert resolve_mode(None, {"SGLANG_RAGGED_VERIFY_MODE": "compact"}) == "compact"
    assert resolve_mode("cap-accept", {"SGLANG_RAGGED_VERIFY_MODE": "compact"}) == "cap-accept"
    with pytest.raises(ServerError, match="SGLANG_RAGGED_VERIFY_MODE='ragged'"):
        resolve_mode(None, {"SGLANG_RAGGED_VERIFY_MODE": "ragged"})
    assert resolve_components("core,reqs", {}) == {"core", "reqs"}
    assert resolve_components("", {"SGLANG_DSPARK_ENABLE_SPS_RECORD": "1"}) == {
        "core", "step_cpu_time"}
    with pytest.raises(ServerError, match="gpu_time"):
        resolve_components("core,gpu_time", {})


def test_generate_plain_and_streamed(server):
    out = _call(server, "/generate", {"input_ids": [97, 98, 99], "rid": "g1",
                                      "sampling_params": {"max_new_tokens": 12,
                                                          "temperature": 0}})
    meta = out["meta_info"]
    assert len(out["output_ids"]) == meta["completion_tokens"] == 12
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["spec_accept_length"] == pytest.approx(12 / meta["spec_verify_ct"])
    assert meta["spec_num_proposed_drafts"] == 5 * meta["spec_verify_ct"]
    assert sum(meta["spec_cap_lens_histogram"]) == meta["spec_verify_ct"]
    assert sum(meta["spec_correct_drafts_histogram"]) == meta["spec_verify_ct"]
    assert 1.0 <= meta["spec_block_accept_length"] <= 6.0  # cap-accept reports the ceiling
    body = _call(server, "/generate", {"text": "abc", "stream": True, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0}}, raw=True).decode()
    events = [e[len("data: "):] for e in body.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12 and len(chunks) >= 2
    assert chunks[-1]["output_ids"] == out["output_ids"]  # same prompt ids, greedy
    assert chunks[-1]["text"] == "".join(chr(t) for t in out["output_ids"])


def test_chat_completion_with_spec_details(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
            "temperature": 0, "return_spec_tokens_details": True}
    out = _call(server, "/v1/chat/completions", body)
    details = out["sglext"]["spec_tokens_details"]
    assert set(details) == {"spec_accept_rate", "spec_accept_length", "spec_cap_length",
                            "spec_block_accept_length", "spec_num_correct_drafts",
                            "spec_num_proposed_drafts", "spec_verify_ct",
                            "spec_correct_drafts_histogram", "spec_cap_lens_histogram"}
    assert out["usage"]["completion_tokens"] == 10 and out["choices"][0]["finish_reason"]
    plain = _call(server, "/v1/chat/completions", {**body, "return_spec_tokens_details": False})
    assert "sglext" not in plain
    stream = _call(server, "/v1/chat/completions", {**body, "stream": True,
                                                    "stream_options": {"include_usage": True}},
                   raw=True).decode()
    events = [json.loads(e[6:]) for e in stream.split("\n\n") if e and e != "data: [DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in events if c["choices"])
    assert text == out["choices"][0]["message"]["content"]
    assert any("sglext" in c for c in events) and events[-1]["usage"]["completion_tokens"] == 10
    assert _call(server, "/v1/models")["data"][0]["id"] == "tiny-random"


def test_server_info_dump_and_internal_state(server):
    _call(server, "/generate", {"input_ids": [97] * 5, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0}})
    info = _call(server, "/server_info")
    assert info["speculative_num_draft_tokens"] == 6
    # the start-up durations are measured (they tell this process from a restarted one)
    startup = info["startup_time"]
    assert startup["load_weight"] > 0 and startup["scheduler_e2e"] >= startup["load_weight"]
    dump = info["internal_states"][0]["dspark_info_record"]
    assert (dump["mode"], dump["gamma"], dump["verify_num_draft_tokens"]) == ("cap-accept", 5, 6)
    rec = dump["records"][-1]
    assert "step_gpu_ms" not in rec and "verify_tokens_dp_synced" not in rec  # defaults left out
    req = rec["reqs"][0]
    assert all(round(c, 4) == c for c in req["confidence"])
    assert req["acc_len"] == req["correct_drafts"] + 1 or req["acc_len"] <= req["correct_drafts"]

    assert _call(server, "/set_internal_state", {"server_args": {
        "dspark_clear_info_records": True}}) == {"updated": True}
    assert _call(server, "/server_info")["internal_states"][0]["dspark_info_record"][
        "records"] == []
    # one bad key: nothing is updated (SGLang validates every key first)
    assert _call(server, "/set_internal_state", {"server_args": {
        "dspark_force_budget_frac": 0.4, "nope": 1}}) == {"updated": False}
    assert _call(server, "/set_internal_state", {"server_args": {
        "dspark_force_budget_frac": 1.5}}) == {"updated": False}
    assert server.service.engine.scheduler.forced_budget_frac is None
    assert _call(server, "/set_internal_state", {"server_args": {
        "dspark_force_budget_frac": 0.4}}) == {"updated": True}
    try:
        _call(server, "/generate", {"input_ids": [98] * 5, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0}})
        recs = _call(server, "/server_info")["internal_states"][0]["dspark_info_record"]["records"]
        assert recs and all(r["budget"] == int(0.4 * r["bs"] * 5) for r in recs)
    finally:
        _call(server, "/set_internal_state", {"server_args": {"dspark_force_budget_frac": None}})


def test_metrics_gauges_and_counter(server):
    fams = {f.name: f for f in text_string_to_metric_families(
        _call(server, "/metrics", raw=True).decode())}
    for name in ("sglang:spec_accept_length", "sglang:spec_accept_rate", "sglang:spec_cap_length",
                 "sglang:spec_block_accept_length", "sglang:spec_num_draft_tokens"):
        assert fams[name].type == "gauge"
    calls = fams["sglang:spec_verify_calls"]
    assert calls.type == "counter"
    assert {s.labels["model_name"] for s in calls.samples} == {"tiny-random"}


def test_bad_requests_name_the_problem(server):
    assert "input_ids" in _error(server, "/generate", {"input_ids": [[1, 2], [3]]})
    assert "max_new_tokens" in _error(server, "/generate", {
        "text": "a", "sampling_params": {"max_new_tokens": 2.5}})
    assert "temperature" in _error(server, "/generate", {
        "text": "a", "sampling_params": {"temperature": -1}})
    assert "outside" in _error(server, "/generate", {"input_ids": [500]})
    assert "ignore_eos" in _error(server, "/generate", {
        "text": "a", "sampling_params": {"ignore_eos": "yes"}})
    assert "messages" in _error(server, "/v1/chat/completions", {"prompt": "x"})
    with pytest.raises(urllib.error.HTTPError) as info:
        _call(server, "/nowhere", {})
    assert info.value.code == 404


def test_cli_launch_prints_both_profiles_and_refuses_to_guess():
    runner = CliRunner()
    res = runner.invoke(app, ["sglang", "launch", "--target", "Qwen/Qwen3-8B", "--drafter",
                              "d/dspark", "--sps-table", "t.json"])
    assert res.exit_code == 0, res.output
    assert "SGLANG_RAGGED_VERIFY_MODE=compact" in res.output
    assert "SGLANG_RAGGED_VERIFY_MODE=cap-accept" in res.output
    assert res.output.count("--speculative-dspark-sps-table-path t.json") == 2
    assert "SGLANG_DSPARK_DEBUG_DUMP=core,step_cpu_time,reqs" in res.output
    res = runner.invoke(app, ["sglang", "launch", "--target", "t", "--drafter", "d", "--run"])
    assert res.exit_code == 1 and ("sglang is not installed" in res.output
                                   or "no NVIDIA GPU" in res.output)
    res = runner.invoke(app, ["engine-server", "--tiny", "--mode", "ragged", "--port", "0"])
    assert res.exit_code == 1 and "--mode='ragged'" in res.output


def test_cli_drive_then_collect(server, tmp_path):
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(
        json.dumps({"rid": f"cli{i}", "prompt": f"say {i}", "max_new_tokens": 9,
                    "temperature": 0.0, "seed": i}) + "\n" for i in range(3)))
    store = tmp_path / "store"
    runner = CliRunner()
    res = runner.invoke(app, ["drive", "--url", server.url, "--run-id", "c1",
                              "--workload-file", str(traffic), "--store", str(store)])
    assert res.exit_code == 0, res.output
    assert "c1: 3/3 ok" in res.output
    res = runner.invoke(app, ["collect", "--url", server.url, "--run-id", "c1", "--store",
                              str(store), "--duration", "0.3", "--workload-file", str(traffic),
                              "--metrics-port", "0"])
    assert res.exit_code == 0, res.output
    from dspark_obs.store import Store

    st = Store(store)
    (run,) = st.query("FROM runs").to_pylist()
    assert (run["mode"], run["workload"], run["source"]) == ("cap-accept", "custom", "sglang")
    # the driver's stored meta_info and the collected step dump agree request by request
    rows = st.query("SELECT q.rid, q.spec_verify_ct AS v, count(s.rid) AS n, "
                    "any_value(s.workload) AS w FROM requests q JOIN req_steps s USING "
                    "(run_id, rid) GROUP BY ALL").to_pylist()
    assert len(rows) == 3 and all(r["v"] == r["n"] > 0 and r["w"] == "custom" for r in rows)
    res = runner.invoke(app, ["collect", "--url", "http://127.0.0.1:9", "--store", str(store),
                              "--duration", "0.2"])
    assert res.exit_code == 1 and "poll failed" in res.output  # issue 18: nothing collected


def test_shipped_launch_profiles_are_what_server_profiles_builds():
    from pathlib import Path

    from dspark_obs.sglang.profiles import load_profiles, server_profiles

    root = Path(__file__).resolve().parents[1] / "runtime" / "sglang"
    shipped = load_profiles(root / "profiles.example.json")
    built = server_profiles("Qwen/Qwen3-8B", "/models/qwen3-8b-dspark", gamma=5,
                            sps_table="/models/qwen3-8b-dspark/sps_table.json",
                            sts="/models/qwen3-8b-dspark/sts.json",
                            out_dir="/data/dspark-obs/sglang-out")
    assert shipped == built
    assert [p.env["SGLANG_RAGGED_VERIFY_MODE"] for p in shipped] == ["compact", "cap-accept"]
    for p in shipped:
        env = dict(line.split("=", 1) for line in
                   (root / f"{p.role.replace('-', '_')}.env").read_text().splitlines())
        assert env == p.env


def test_ignore_eos_generates_exactly_max_new_tokens(server):
    out = _call(server, "/generate", {"text": "ab", "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}})
    assert out["meta_info"]["completion_tokens"] == 24
    assert out["meta_info"]["finish_reason"]["type"] == "length"
