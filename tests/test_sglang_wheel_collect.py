"""The collector and ingest-dump on payloads SGLang 0.5.23's own code builds.

Every /server_info body here comes from the wheel (tests/sglang_wheel.py): its
DsparkInfoDumper ring (fed through ``observe_decode_step``), its ``startup_time`` builders,
its FanOutCommunicator (reply order) and its ``server_info`` handler; estimator JSONL from its
BlockAcceptEstimateRecorder. Each test checks 0 lost (beyond the ranges reported), 0
duplicated, and field equality with what SGLang dumped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest
from sglang_wheel import SimHTTP, SimServer
from typer.testing import CliRunner

from dspark_obs.cli import app
from dspark_obs.sglang.collector import Collector, CollectorOptions
from dspark_obs.store import Store


def _steps(store: Store, run: str) -> dict[tuple[int, int], dict]:
    rows = store.query(f"SELECT * FROM steps WHERE run_id = '{run}'").to_pylist()
    keys = [(r["dp_rank"], r["forward_ct"]) for r in rows]
    assert len(keys) == len(set(keys)), "a step stored twice"
    return dict(zip(keys, rows, strict=True))


def _req_count(store: Store, run: str) -> int:
    total, distinct = (
        store.query(
            "SELECT count(*), count(DISTINCT (dp_rank, forward_ct, rid)) FROM req_steps "
            f"WHERE run_id = '{run}'"
        )
        .to_pylist()[0]
        .values()
    )
    assert total == distinct, "a request-step stored twice"
    return total


def _field_equal(stored: dict, dumped: dict) -> None:
    for k in ("bs", "budget", "lag_steps", "num_verify_tokens", "predicted_step_ms"):
        assert stored[k] == dumped.get(k, -1 if k in ("bs",) else None), k


def _merged(store: Store, est: Path) -> tuple[list[dict], dict[str, int]]:
    """The estimator file's lines, and the req_steps counted: all, with trimmed_tokens, with pg;
    every censored line's fields are merged (checked here)."""
    lines = [json.loads(x) for x in est.read_text().splitlines()]
    got = store.query(
        "SELECT count(*) AS n, count(trimmed_tokens) AS t, count(pg) AS p FROM req_steps"
    ).to_pylist()[0]
    assert got["t"] == sum("trimmed_tokens" in x for x in lines) > 0
    return lines, got


def _collector(srv: SimHTTP, run: str, tmp: Path, **kw) -> tuple[Collector, Store]:
    store = Store(tmp / "store")
    opts = CollectorOptions(srv.url, run, state_dir=tmp / "state", timeout_s=5.0, **kw)
    return Collector([opts], [store], interval_s=0.01), store


@pytest.mark.parametrize(("dp", "mode"), [(1, "compact"), (4, "compact"), (4, "cap-accept")])
def test_every_rank_collected_exactly_whatever_the_reply_order(sglang_wheel, tmp_path, dp, mode):
    sim = SimServer(
        sglang_wheel,
        dp=dp,
        mode=mode,
        seed=dp,
        reply_order=lambda poll: [(poll + i * 3) % dp for i in range(dp)],
    )
    srv = SimHTTP(sim)
    col, store = _collector(srv, "r", tmp_path)
    try:
        for i in range(6):
            srv.step(7)
            if i % 2:
                sim.prefill()  # forward_ct advances without a record: not a loss
            col.poll_once()
        col.finish()
    finally:
        srv.close()
    got = _steps(store, "r")
    sc = col.servers[0]
    assert sc.totals.lost_ranges == 0 and sc.totals.restarts == 0
    # our rank ids follow SGLang's ranks (first poll's order), whatever the later reply order
    first = [(1 + i * 3) % dp for i in range(dp)]
    for ours, theirs in enumerate(first):
        dumped = sim.dumped(theirs)
        assert [f for (d, f) in got if d == ours] == sorted(r["forward_ct"] for r in dumped)
        for rec in dumped:
            _field_equal(got[(ours, rec["forward_ct"])], rec)
    assert len(got) == sum(len(r.appended) for r in sim.ranks)
    assert _req_count(store, "r") == sc.totals.req_steps == srv.verify_calls
    assert sc.totals.steps == len(got)
    run = store.query(
        "SELECT mode, gamma, lag_steps, dp_size, model, config FROM runs"
    ).to_pylist()[0]
    assert (run["mode"], run["gamma"], run["lag_steps"], run["dp_size"]) == (mode, 5, 2, dp)
    cfg = json.loads(run["config"])
    assert cfg["version"] == "0.5.23" and set(cfg["startup_time"]) >= {
        "load_weight",
        "tokenizer_e2e",
    }
    assert "reconciled" in sc.reconcile()


def test_restart_with_a_fresh_ring_is_a_new_epoch(sglang_wheel, tmp_path):
    from dspark_obs.fanout import MemorySink

    sim = SimServer(sglang_wheel, dp=2, seed=3)
    srv = SimHTTP(sim)
    store = Store(tmp_path / "store")
    seen = MemorySink()  # what a telemetry sink is handed
    col = Collector([CollectorOptions(srv.url, "re", state_dir=tmp_path / "state")], [store, seen])
    try:
        srv.step(30)
        col.poll_once()
        with srv.lock:
            sim.restart()  # a new process: fresh rings, forward_ct from 0, new startup_time
        srv.step(12)  # fewer steps than the old high-water mark
        col.poll_once()
        srv.step(40)  # and then past it
        col.poll_once()
        col.finish()
    finally:
        srv.close()
    got = _steps(store, "re")
    assert len(got) == 2 * (30 + 52)
    t = col.servers[0].totals
    assert t.restarts == 2 and t.lost_ranges == 0  # one per rank
    assert all("restart at stored forward_ct 31" in n for n in t.restart_notes)
    assert max(f for (_, f) in got) == 30 + 1 + 52
    assert _req_count(store, "re") == srv.verify_calls
    # every sink is handed the stored rows, each once (a re-read ring is never re-sent)
    assert seen.table("steps").num_rows == len(got)
    assert seen.table("req_steps").num_rows == srv.verify_calls


def test_restart_detected_from_the_data_alone(sglang_wheel, tmp_path):
    """Same startup_time and version (a server that reports none): the new process ran past
    the old mark before the poll, and forward_ct went back on another rank."""
    sim = SimServer(sglang_wheel, dp=1, seed=4)
    srv = SimHTTP(sim)
    srv.faults = [_blank_startup] * 10
    col, store = _collector(srv, "d", tmp_path)
    try:
        srv.step(20)
        col.poll_once()
        with srv.lock:
            sim.restart()
        srv.step(25)  # the record at forward_ct 20 now is another step
        col.poll_once()
        with srv.lock:
            sim.restart()
        srv.step(5)  # forward_ct went back
        col.poll_once()
        col.finish()
    finally:
        srv.close()
    assert len(_steps(store, "d")) == 20 + 25 + 5
    assert col.servers[0].totals.restarts == 2


def _blank_startup(body: bytes) -> bytes:
    data = json.loads(body)
    data["startup_time"] = None
    data["version"] = None
    for s in data["internal_states"]:
        s.pop("startup_time", None)
    return json.dumps(data).encode()


def test_small_ring_overflow_reported_exactly_without_ring_size(sglang_wheel, tmp_path):
    sim = SimServer(sglang_wheel, dp=2, seed=5, max_records=16)
    srv = SimHTTP(sim)
    col, store = _collector(srv, "o", tmp_path)  # --ring-size left at SGLang's 200,000
    try:
        srv.step(10)
        col.poll_once()
        srv.step(16)  # exactly fills the ring: nothing lost
        col.poll_once()
        srv.step(16)
        col.poll_once()
        srv.step(40)  # 24 steps fall out of the ring
        col.poll_once()
        col.finish()
    finally:
        srv.close()
    sc = col.servers[0]
    assert [(g.dp_rank, g.lo, g.hi) for g in sc.gaps] == [(0, 43, 66), (1, 43, 66)]
    got = _steps(store, "o")
    for dp in (0, 1):
        stored = {f for (d, f) in got if d == dp}
        assert stored | set(range(43, 67)) == set(sim.ranks[dp].appended)
    assert sc.totals.lost_forward_cts == 48


def test_clear_mode_reports_each_read_to_clear_gap_and_loses_nothing_at_the_end(
    sglang_wheel, tmp_path
):
    sim = SimServer(sglang_wheel, dp=1, seed=6)
    srv = SimHTTP(sim)
    col, store = _collector(srv, "c", tmp_path, clear=True)
    real_clear = sim.clear

    def late_clear():  # two steps land between the read and its clear
        sim.step(2)
        srv.verify_calls += 2 * sim.bs
        real_clear()

    sim.clear = late_clear
    try:
        srv.step(10)
        col.poll_once()
        srv.step(5)
        col.poll_once()
        srv.step(5)
        col.finish()  # the final read is not cleared: nothing lost at the end
    finally:
        srv.close()
    sc = col.servers[0]
    assert [(g.lo, g.hi) for g in sc.gaps] == [(11, 12), (18, 19)]
    assert len(_steps(store, "c")) == 10 + 5 + 5
    assert sim.ranks[0].forward_ct == 24


def test_faults_are_reported_and_survived(sglang_wheel, tmp_path):
    sim = SimServer(sglang_wheel, dp=1, seed=7)
    srv = SimHTTP(sim, drip_s=0.05)
    col, store = _collector(srv, "f", tmp_path)
    col.servers[0].opts = CollectorOptions(
        srv.url, "f", state_dir=tmp_path / "state", timeout_s=0.5
    )
    srv.step(6)

    def bad_fields(body: bytes) -> bytes:
        data = json.loads(body)
        recs = data["internal_states"][0]["dspark_info_record"]["records"]
        recs[1]["forward_ct"] = "abc"
        recs[2]["reqs"][0]["acc_len"] = "x"
        recs[3]["forward_ct"] = None
        data["startup_time"] = 1e300
        return json.dumps(data).encode()

    srv.faults = ["truncate", "500", "drip", bad_fields]
    try:
        reps = [col.poll_once()[0] for _ in range(4)]
        srv.faults = [bad_fields] * 5  # (a changed startup_time would be a restart)
        srv.step(4)
        col.poll_once()
        col.finish()
    finally:
        srv.close()
    t = col.servers[0].totals
    assert reps[:3] == [None, None, None] and t.failed_polls == 3
    assert "poll deadline" in (t.last_error or ""), t.last_error  # the drip, bounded
    assert reps[3] is not None and reps[3].bad_records == 3
    got = _steps(store, "f")
    assert sorted(f for _, f in got) == [1, 5, 6, 7, 8, 9, 10]  # 2..4 bad in every read
    assert t.bad_records == 3  # named once, not on every poll


def test_gamma_unknown_then_known_writes_the_runs_row(sglang_wheel, tmp_path):
    sim = SimServer(sglang_wheel, dp=1, seed=8)
    srv = SimHTTP(sim)

    def no_gamma(body: bytes) -> bytes:
        data = json.loads(body)
        data["internal_states"][0]["dspark_info_record"]["gamma"] = -1
        return json.dumps(data).encode()

    srv.faults = [no_gamma, no_gamma]
    col, store = _collector(srv, "g", tmp_path)
    try:
        srv.step(3)
        first = col.poll_once()[0]
        col.poll_once()
        srv.step(3)
        col.poll_once()
        col.finish()
    finally:
        srv.close()
    assert any("gamma=-1" in n for n in first.notes)
    assert store.query("SELECT gamma FROM runs").to_pylist() == [{"gamma": 5}]
    assert len(_steps(store, "g")) == 6


def test_estimator_lines_written_while_polling_are_all_merged(sglang_wheel, tmp_path):
    est = tmp_path / "est.jsonl"
    sim = SimServer(sglang_wheel, dp=1, seed=9, estimator_path=est)
    srv = SimHTTP(sim)
    col, store = _collector(srv, "e", tmp_path, estimator_path=est)
    try:
        for i in range(8):
            srv.step(5)
            if i % 3 == 0:
                sim.flush_estimator()  # the recorder flushes every 16 steps and at prefill
            col.poll_once()
        srv.step(5)  # steps after the last snapshot whose lines come before the final read
        sim.flush_estimator()
        col.finish()
    finally:
        srv.close()
    lines, got = _merged(store, est)
    assert got["n"] == srv.verify_calls
    assert got["p"] == sum("pg" in x for x in lines) > 0
    assert col.servers[0].totals.late_lines == 0
    one = next(x for x in lines if "trimmed_tokens" in x)
    row = store.query(
        f"SELECT trimmed_tokens, q_lp FROM req_steps WHERE rid = '{one['rid']}' "
        f"AND forward_ct = {one['fct']}"
    ).to_pylist()[0]
    assert row["trimmed_tokens"] == one["trimmed_tokens"]
    assert row["q_lp"] == pytest.approx(one["q_lp"], abs=1e-6)


def test_companion_pair_from_a_targets_file(sglang_wheel, tmp_path):
    a, b = (
        SimHTTP(SimServer(sglang_wheel, dp=1, seed=10, mode=m)) for m in ("compact", "cap-accept")
    )
    targets = tmp_path / "targets.yaml"
    targets.write_text(
        f"- targets: ['{a.url[7:]}']\n  labels: {{dspark_pair: p1, cluster: c1}}\n"
        f"- targets: ['{b.url[7:]}']\n  labels: {{dspark_pair: p1, dspark_role: cap-accept}}\n"
    )
    try:
        a.step(12)
        b.step(12)
        res = CliRunner().invoke(
            app,
            [
                "collect",
                "--targets",
                str(targets),
                "--store",
                str(tmp_path / "store"),
                "--duration",
                "0.3",
                "--interval",
                "0.05",
            ],
        )
    finally:
        a.close()
        b.close()
    assert res.exit_code == 0, res.output
    store = Store(tmp_path / "store")
    runs = {r["mode"]: r for r in store.query("SELECT * FROM runs").to_pylist()}
    assert runs["cap-accept"]["companion_of"] == runs["compact"]["run_id"]
    assert json.loads(runs["compact"]["config"])["labels"]["cluster"] == "c1"
    assert len(_steps(store, runs["compact"]["run_id"])) == 12


def test_fleet_of_16_servers_with_4_ranks_each(sglang_wheel, tmp_path):
    servers = [SimHTTP(SimServer(sglang_wheel, dp=4, seed=20 + i, bs=2)) for i in range(16)]
    store = Store(tmp_path / "store")
    col = Collector(
        [
            CollectorOptions(s.url, f"fleet-{i}", state_dir=tmp_path / "state", timeout_s=10)
            for i, s in enumerate(servers)
        ],
        [store],
        workers=8,
    )
    try:
        for _ in range(3):
            for s in servers:
                s.step(4)
            col.poll_once()
        col.finish()
    finally:
        for s in servers:
            s.close()
    for i, (s, sc) in enumerate(zip(servers, col.servers, strict=True)):
        assert sc.totals.lost_ranges == 0 and sc.totals.failed_polls == 0
        assert len(_steps(store, f"fleet-{i}")) == 4 * 12
        assert _req_count(store, f"fleet-{i}") == s.verify_calls


def test_collector_counters_on_metrics(sglang_wheel):
    """Per-target series: bounded labels only (target, role, the file_sd labels; no run id),
    every counter of every known target at 0 before its first increment, promtool-clean."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from dspark_obs.fanout import MemorySink
    from dspark_obs.sglang.fleet import CollectorMetrics

    sim = SimServer(sglang_wheel, dp=1, seed=30, max_records=8)
    srv = SimHTTP(sim)
    labels = {"cluster": "c1", "model": "qwen", "dspark_pair": "p"}
    col = Collector(
        [
            CollectorOptions(srv.url, "m-1a2b", scrape_metrics=False, labels=labels),
            CollectorOptions("http://127.0.0.1:9", "down-3c4d", timeout_s=1, companion_of="m"),
        ],
        [MemorySink()],
    )
    reg = CollectorRegistry()
    reg.register(CollectorMetrics(col))

    def samples() -> dict[tuple[str, str], float]:
        text = generate_latest(reg).decode()
        promtool = shutil.which("promtool")
        assert promtool, "promtool is needed (make install)"
        res = subprocess.run(
            [promtool, "check", "metrics"], input=text.encode(), capture_output=True
        )
        assert res.returncode == 0, res.stderr.decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.startswith("dspark_collect_") and not s.name.endswith("_created"):
                    assert set(s.labels) == {"target", "role", "cluster", "model"}, s
                    assert "m-1a2b" not in s.labels.values()
                    out[s.name, s.labels["target"]] = s.value
        return out

    born = samples()  # before any poll: every target, every counter, at 0
    for name in ("poll_failures", "lost_ranges", "lost_forward_cts", "polls", "restarts"):
        for target in (srv.url, "http://127.0.0.1:9"):
            assert born[f"dspark_collect_{name}_total", target] == 0.0
    try:
        srv.step(4)
        col.poll_once()
        srv.step(20)
        col.poll_once()
    finally:
        srv.close()
    text = generate_latest(reg).decode()
    after = samples()
    assert after["dspark_collect_target_up", srv.url] == 1.0
    assert after["dspark_collect_target_up", "http://127.0.0.1:9"] == 0.0
    assert after["dspark_collect_lost_ranges_total", srv.url] == 1.0
    assert after["dspark_collect_poll_failures_total", "http://127.0.0.1:9"] == 2.0
    assert (
        'dspark_collect_target_up{cluster="",model="",role="cap-accept",'
        'target="http://127.0.0.1:9"} 0.0'
    ) in text
    assert 'cluster="c1",model="qwen",role="compact"' in text
    assert col.servers[0].totals.lost_ranges == 1
    assert col.servers[1].totals.failed_polls == 2


def test_targets_file_label_names_must_be_prometheus_names(tmp_path):
    from dspark_obs.sglang.fleet import TargetsError, read_targets

    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"targets": ["a:1"], "labels": {"my-cluster": "c"}}]))
    with pytest.raises(TargetsError, match="'my-cluster'.*not Prometheus label names"):
        read_targets(path)


def test_ingest_dump_counts_stored_rows_and_takes_a_bare_record(sglang_wheel, tmp_path):
    sim = SimServer(sglang_wheel, dp=2, seed=40)
    sim.step(8)
    body = tmp_path / "server_info.json"
    body.write_bytes(msgspec.json.encode(sim.body()))
    bare = tmp_path / "record.json"
    bare.write_bytes(msgspec.json.encode(sglang_wheel.dump_info_records(sim.ranks[0].dumper)))
    store = ["--store", str(tmp_path / "store")]
    run = CliRunner()
    first = run.invoke(app, ["ingest-dump", str(body), "--run-id", "x", *store])
    again = run.invoke(app, ["ingest-dump", str(body), "--run-id", "x", *store])
    one = run.invoke(app, ["ingest-dump", str(bare), "--run-id", "y", *store])
    assert first.exit_code == 0, first.output
    assert "16 steps and 48 request-steps newly stored" in first.output
    assert "0 steps and 0 request-steps newly stored, 16 steps already stored" in again.output
    assert one.exit_code == 0 and "8 steps" in one.output
    empty = tmp_path / "empty.json"
    empty.write_text(
        json.dumps(
            {
                "mode": "compact",
                "gamma": 5,
                "verify_num_draft_tokens": 6,
                "components": [],
                "records": [],
            }
        )
    )
    res = run.invoke(app, ["ingest-dump", str(empty), "--run-id", "z", *store])
    assert res.exit_code == 1 and "nothing stored" in res.output


def test_collect_and_drive_exit_non_zero_when_nothing_useful_happened(tmp_path):
    run = CliRunner()
    res = run.invoke(
        app,
        [
            "collect",
            "--url",
            "http://127.0.0.1:9",
            "--store",
            str(tmp_path / "s"),
            "--duration",
            "0.2",
            "--interval",
            "0.05",
            "--timeout",
            "1",
        ],
    )
    assert res.exit_code == 1 and "every poll failed" in res.output


def test_drive_exits_non_zero_when_no_request_succeeded(sglang_wheel, tmp_path):
    srv = SimHTTP(SimServer(sglang_wheel, dp=1, seed=80))  # it serves no generation endpoint
    try:
        res = CliRunner().invoke(
            app,
            [
                "drive",
                "--url",
                srv.url,
                "--run-id",
                "d",
                "-n",
                "2",
                "--api",
                "sglang",
                "--store",
                str(tmp_path / "s"),
            ],
        )
    finally:
        srv.close()
    assert res.exit_code == 1, res.output
    assert "0/2 ok" in res.output and "no request succeeded" in res.output


def test_collector_killed_while_holding_rows_resumes_without_loss(sglang_wheel, tmp_path):
    """Request-steps held for estimator lines still in SGLang's file buffer are not stored: a
    successor collector (same state directory) reads them again and merges the lines."""
    est = tmp_path / "est.jsonl"
    sim = SimServer(sglang_wheel, dp=1, seed=50, estimator_path=est)
    srv = SimHTTP(sim)
    try:
        srv.step(10)
        sim.flush_estimator()
        srv.step(5)  # their lines wait in the recorder's buffer
        first, store = _collector(srv, "k", tmp_path, estimator_path=est)
        first.poll_once()
        assert first.servers[0].estimator.held_rows == 5 * sim.bs
        del first  # dies without writing them
        sim.flush_estimator()
        second = Collector(
            [CollectorOptions(srv.url, "k", state_dir=tmp_path / "state", estimator_path=est)],
            [store],
        )
        second.poll_once(final=True)
        second.finish()
    finally:
        srv.close()
    lines, got = _merged(store, est)
    assert _req_count(store, "k") == got["n"] == srv.verify_calls
    assert got["p"] == sum("pg" in x for x in lines)
    assert len(_steps(store, "k")) == 15


def test_estimator_file_rewritten_by_a_restarted_server(sglang_wheel, tmp_path):
    """A restarted SGLang reopens its estimator file with "w": the collector starts over on it
    (even when it has grown past the old offset) and merges each epoch's lines."""
    est = tmp_path / "est.jsonl"
    sim = SimServer(sglang_wheel, dp=1, seed=60, estimator_path=est)
    srv = SimHTTP(sim)
    col, store = _collector(srv, "er", tmp_path, estimator_path=est)
    try:
        srv.step(10)
        sim.flush_estimator()
        col.poll_once()
        old = [json.loads(x) for x in est.read_text().splitlines()]
        with srv.lock:
            sim.restart()
        srv.step(30)
        sim.flush_estimator()
        col.poll_once()
        col.finish()
    finally:
        srv.close()
    new = [json.loads(x) for x in est.read_text().splitlines()]
    got = store.query("SELECT count(*) AS n, count(trimmed_tokens) AS t FROM req_steps").to_pylist()
    assert got[0]["n"] == srv.verify_calls
    assert got[0]["t"] == sum("trimmed_tokens" in x for x in old + new)
    assert col.servers[0].totals.restarts == 1 and col.servers[0].totals.late_lines == 0


def test_engine_server_info_has_the_shape_sglang_builds(sglang_wheel):
    """engine-server's /server_info and SGLang's handler agree on every surface the collector
    reads: top-level keys, the startup_time dict keys (engine and per rank), version."""
    from dspark_obs.sglang.engine_server import ServerOptions, build_service
    from dspark_obs.testing.tiny_models import byte_models

    svc = build_service(ServerOptions(port=0, mode="compact"), env={}, models=byte_models())
    ours = msgspec.json.decode(msgspec.json.encode(svc.server_info()))
    sim = SimServer(sglang_wheel, dp=1, seed=70)
    sim.step(1)
    theirs = sim.body()
    for key in (
        "startup_time",
        "internal_states",
        "version",
        "frontend",
        "launch_command",
        "model_path",
        "speculative_draft_model_path",
    ):
        assert key in ours and key in theirs, key
    assert set(ours["startup_time"]) == set(theirs["startup_time"])
    assert set(ours["startup_time"]["cuda_graph"]) == set(theirs["startup_time"]["cuda_graph"])
    (state,) = ours["internal_states"]
    assert set(state["startup_time"]) == set(theirs["internal_states"][0]["startup_time"])
    assert ours["version"] == theirs["version"] == "0.5.23"
    assert set(state["dspark_info_record"]) >= {
        "mode",
        "gamma",
        "verify_num_draft_tokens",
        "components",
        "records",
    }


def test_rows_without_lines_wait_only_until_the_recorder_has_flushed(sglang_wheel, tmp_path):
    """Greedy rows never get a line: they are stored once their rank ran 17 forward_cts past
    them (SGLang's recorder has flushed by then), not after a wall-clock wait."""
    sim = SimServer(sglang_wheel, dp=1, seed=90)  # writes no estimator line at all
    srv = SimHTTP(sim)
    col, store = _collector(srv, "w", tmp_path, estimator_path=tmp_path / "none.jsonl")
    try:
        srv.step(5)
        col.poll_once()
        est = col.servers[0].estimator
        assert est.held_rows == 5 * sim.bs
        srv.step(20)  # forward_ct 25: steps 1..8 are 17 behind
        col.poll_once()
        assert est.held_rows == (25 - 8) * sim.bs
        assert _req_count(store, "w") == 8 * sim.bs
        col.finish()
    finally:
        srv.close()
    assert _req_count(store, "w") == srv.verify_calls


def test_a_poll_failing_after_it_stored_rows_counts_what_it_stored(
    sglang_wheel, tmp_path, monkeypatch
):
    """The totals are the sum of the polls' reports, a failed poll's included: rows it stored
    before failing are counted once (and the poll is not counted as a success)."""
    from dspark_obs.sglang.server_collector import ServerCollector

    sim = SimServer(sglang_wheel, dp=2, mode="compact", seed=11)
    srv = SimHTTP(sim)
    col, store = _collector(srv, "r", tmp_path)
    sc = col.servers[0]
    real = ServerCollector._save_state
    calls: list[int] = []

    def save_then_fail(self: ServerCollector) -> None:
        calls.append(1)
        if len(calls) == 1:  # right after the first rank's rows were stored
            raise OSError("disk full")
        real(self)

    try:
        srv.step(6)
        monkeypatch.setattr(ServerCollector, "_save_state", save_then_fail)
        with pytest.raises(OSError, match="disk full"):
            sc.poll()
        monkeypatch.setattr(ServerCollector, "_save_state", real)
        stored_after_failure = len(_steps(store, "r"))
        assert stored_after_failure > 0
        assert sc.totals.steps == stored_after_failure and sc.totals.polls == 0
        assert sc.totals.req_steps == _req_count(store, "r")
        col.poll_once()
        col.finish()
    finally:
        srv.close()
    got = _steps(store, "r")
    assert len(got) == sum(len(r.appended) for r in sim.ranks)
    assert sc.totals.steps == len(got) and sc.totals.req_steps == _req_count(store, "r")


def test_a_restart_found_by_a_poll_that_then_fails_is_still_reported(
    sglang_wheel, tmp_path, monkeypatch
):
    """A poll that sees the new process, then fails, still reports the restart it found (the
    restart is counted either way; its note must not be lost with the failed poll)."""
    from dspark_obs.sglang.fetch import CollectError
    from dspark_obs.sglang.server_collector import ServerCollector

    sim = SimServer(sglang_wheel, dp=1, seed=5)
    srv = SimHTTP(sim)
    store = Store(tmp_path / "store")
    notes: list[str] = []
    opts = CollectorOptions(srv.url, "rf", state_dir=tmp_path / "state", timeout_s=5.0)
    col = Collector([opts], [store], interval_s=0.01, report=lambda run, msg: notes.append(msg))
    real = ServerCollector._read_estimator

    def fail_once(self: ServerCollector, rep: object) -> None:
        monkeypatch.setattr(ServerCollector, "_read_estimator", real)
        raise CollectError("estimator file vanished")

    try:
        srv.step(10)
        col.poll_once()
        with srv.lock:
            sim.restart()
        srv.step(3)
        monkeypatch.setattr(ServerCollector, "_read_estimator", fail_once)
        col.poll_once()  # sees the new process, then fails
        t = col.servers[0].totals
        assert t.restarts == 1 and t.failed_polls == 1
        assert [n for n in notes if "restart at stored forward_ct 11" in n]
        assert notes[-1].startswith("poll failed") and "estimator file vanished" in notes[-1]
        col.poll_once()
        col.finish()
    finally:
        srv.close()
    assert len(_steps(store, "rf")) == 10 + 3
