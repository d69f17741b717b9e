"""The collector against engine-server over real HTTP: a compact run and its cap-accept
companion, exact counts, the same report as the same workload run directly, and faults
(server killed and restarted, truncated and malformed responses, ring buffer overflow).

The servers are dspark-obs's own SGLang-compatible engine server on a tiny random model:
SGLang itself needs a GPU, so it is the one stand-in here; HTTP, the store and the
processes killed with SIGKILL are real.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dspark_obs.analytics import build_report
from dspark_obs.cost_table import CostTable
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.types import EngineConfig, GenRequest
from dspark_obs.fanout import FanOut
from dspark_obs.serving.client import GenerationRequest
from dspark_obs.sglang.collector import Collector, CollectorOptions
from dspark_obs.sglang.drive import DriveTarget, drive
from dspark_obs.sglang.engine_server import EngineServer, ServerOptions, build_service
from dspark_obs.store import Store
from dspark_obs.testing.tiny_models import byte_models

TRIMMING_TABLE = {  # step time grows steeply with verify tokens: compact trims windows
    "bias_seconds": 0.01,
    "bs_probes": [1, 16],
    "alpha_seconds": [0.0, 0.0],
    "m_probes": [1, 8, 16, 64, 128],
    "theta_seconds": [0.0, 0.01, 0.03, 0.15, 0.4],
}
CEILING_COLUMNS = [
    "steps",
    "mean_window",
    "share_max_window",
    "share_window_le3",
    "mean_committed",
    "mean_ceiling",
    "utilization",
    "tokens_left",
    "est_lo",
    "est_mid",
    "est_hi",
    "est_point",
]


@pytest.fixture
def table_path(tmp_path: Path) -> Path:
    path = tmp_path / "table.json"
    path.write_text(json.dumps(TRIMMING_TABLE))
    return path


@contextlib.contextmanager
def serving(**opts):
    server = EngineServer(
        build_service(ServerOptions(port=0, **opts), env={}, models=byte_models()), "127.0.0.1", 0
    ).start()
    try:
        yield server
    finally:
        server.close()


def _requests(n: int, temperature: float, seed: int = 0, prefix: str = "q", tokens: int = 24):
    rng = np.random.default_rng(seed)
    return [
        GenerationRequest(
            rid=f"{prefix}{i}",
            input_ids=rng.integers(97, 105, 8).tolist(),
            max_new_tokens=tokens,
            temperature=temperature,
            seed=10 + i,
            workload=("math", "poetry")[i % 2],
        )
        for i in range(n)
    ]


def _keys_unique(store: Store, table: str, key: str) -> bool:
    total, distinct = (
        store.query(f"SELECT count(*), count(DISTINCT ({key})) FROM {table}")
        .to_pylist()[0]
        .values()
    )
    return total == distinct


def _report(store: Store):
    return build_report(
        store.query("FROM req_steps").to_pandas(),
        store.query("FROM requests").to_pandas(),
        store.query("FROM runs").to_pandas(),
        n_boot=20,
    )


def test_run_and_companion_collected_exactly_and_report_equals_direct(tmp_path, table_path):
    reqs = _requests(6, temperature=0.9)
    labels = {r.rid: r.workload for r in reqs}
    est = tmp_path / "estimator.jsonl"
    store = Store(tmp_path / "store")
    with (
        serving(mode="compact", max_batch=1, cost_table=table_path, estimator_path=est) as a,
        serving(mode="cap-accept", max_batch=1, cost_table=table_path) as b,
    ):
        col = Collector(
            [
                CollectorOptions(a.url, "r1", estimator_path=est, workloads=labels),
                CollectorOptions(b.url, "r1-cap", companion_of="r1", workloads=labels),
            ],
            [store],
            interval_s=0.05,
        )
        poller = threading.Thread(target=col.run)
        poller.start()
        results = drive(
            [DriveTarget(a.url, "r1"), DriveTarget(b.url, "r1-cap")],
            reqs,
            [store],
            api="sglang",
            concurrency=2,
        )
        col.stop()
        poller.join()
        col.finish()
        server_steps = {"r1": a.service.steps_total, "r1-cap": b.service.steps_total}

    # exact counts: every step once, every request-step = the servers' verify counts
    verify = {run: sum(r.spec["spec_verify_ct"] for r in res) for run, res in results.items()}
    counts = {
        r["run_id"]: r
        for r in store.query(
            "SELECT run_id, count(*) AS n, count(trimmed_tokens) AS censored FROM req_steps "
            "GROUP BY run_id"
        ).to_pylist()
    }
    for run in ("r1", "r1-cap"):
        assert counts[run]["n"] == verify[run]
        assert (
            store.query(f"SELECT count(*) AS n FROM steps WHERE run_id = '{run}'")
            .column("n")[0]
            .as_py()
            == server_steps[run]
        )
    assert counts["r1"]["censored"] > 0  # the estimator JSONL was merged in
    for sc in col.servers:
        assert sc.totals.metrics["sglang:spec_verify_calls_total"] == verify[sc.opts.run_id]
    runs = store.query(
        "SELECT run_id, source, mode, gamma, model, companion_of FROM runs ORDER BY run_id"
    ).to_pylist()
    assert [(r["mode"], r["gamma"], r["model"], r["companion_of"]) for r in runs] == [
        ("compact", 5, "tiny-random", None),
        ("cap-accept", 5, "tiny-random", "r1"),
    ]
    assert {r["source"] for r in runs} == {"sglang"}
    assert _keys_unique(store, "req_steps", "run_id, dp_rank, forward_ct, rid")

    # the same workload run directly through the engine
    direct = Store(tmp_path / "direct")
    fan = FanOut([direct])
    models = byte_models(0)
    table = CostTable.load(table_path)
    for mode, run, comp in (("compact", "d1", None), ("cap-accept", "d1-cap", "d1")):
        eng = Engine(
            models.target,
            models.drafter,
            EngineConfig(mode=mode, max_batch=1, cost_table=table),
            (),
        )
        fan.emit(
            "runs",
            [
                eng.run_row(
                    run,
                    model="tiny-random",
                    drafter="d",
                    workload="mixed",
                    temperature=0.9,
                    seed=0,
                    companion_of=comp,
                )
            ],
        )
        eng.run(
            [
                GenRequest(
                    r.rid,
                    r.input_ids,
                    r.max_new_tokens,
                    workload=r.workload,
                    temperature=r.temperature,
                    seed=r.seed,
                )
                for r in reqs
            ],
            fan.emit,
            run,
        )
    fan.close()

    got, want = _report(store).workloads, _report(direct).workloads
    assert list(got["workload"]) == list(want["workload"]) == ["math", "poetry"]
    assert got["mean_window"].lt(6).any()  # compact did trim
    pd.testing.assert_frame_equal(got[CEILING_COLUMNS], want[CEILING_COLUMNS])
    # SGLang rounds confidence to 4 decimals in its dump: calibration agrees to that precision
    assert np.allclose(got["ece_raw"], want["ece_raw"], atol=1e-3)


def test_small_ring_buffer_kept_up_with_and_overflow_reported(tmp_path):
    store = Store(tmp_path / "store")
    with serving(mode="compact", max_batch=4, max_records=24) as a:
        # polled after every request (one at a time, fewer steps each than the buffer holds)
        col = Collector([CollectorOptions(a.url, "ring", ring_size=24)], [store])
        res = drive(
            [DriveTarget(a.url, "ring")],
            _requests(8, 0.0, seed=1),
            [store],
            api="sglang",
            concurrency=1,
            on_done=lambda run, r: col.poll_once(),
        )
        col.finish()
        assert (
            store.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py()
            == a.service.steps_total
            > 24
        )
        assert store.query("SELECT count(*) AS n FROM req_steps").column("n")[0].as_py() == sum(
            r.spec["spec_verify_ct"] for r in res["ring"]
        )
        assert col.servers[0].totals.overflows == 0

        # a collector that polls too rarely: the overflow is reported, not silent
        notes: list[str] = []
        slow = Collector(
            [CollectorOptions(a.url, "slow", ring_size=24)],
            [Store(tmp_path / "s")],
            report=lambda run, msg: notes.append(msg),
        )
        slow.poll_once()
        drive(
            [DriveTarget(a.url, "ring2")],
            _requests(8, 0.0, seed=2, prefix="z", tokens=64),
            [Store(tmp_path / "s")],
            api="sglang",
            concurrency=4,
        )
        slow.poll_once()
        gaps = slow.servers[0].gaps  # the ring was already full at the first read, then it
        assert [g.why.split(":")[0] for g in gaps] == [  # overflowed between the two polls
            "before the first read",
            "the ring buffer overflowed between polls; poll more often or use --clear",
        ]
        assert any("overflowed" in n for n in notes)
        slow.finish()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(port: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SGLANG_RAGGED_VERIFY_MODE": "compact"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dspark_obs",
            "engine-server",
            "--tiny",
            "--port",
            str(port),
            "--max-batch",
            "4",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode()) from None
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("engine-server did not start")


def test_server_killed_mid_run_and_restarted(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    store = Store(tmp_path / "store")
    notes: list[str] = []
    col = Collector(
        [CollectorOptions(url, "k", state_dir=tmp_path / "state", timeout_s=5)],
        [store],
        interval_s=0.05,
        max_backoff_s=0.5,
        report=lambda run, msg: notes.append(msg),
    )
    poller = threading.Thread(target=col.run)
    first = _spawn(port)
    try:
        poller.start()
        inflight = threading.Thread(
            target=drive,
            args=([DriveTarget(url, "k")], _requests(4, 0.0, prefix="a", tokens=200), [store]),
            kwargs={"api": "sglang", "concurrency": 4},
        )
        inflight.start()
        deadline = time.monotonic() + 30
        while col.servers[0].totals.steps < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        first.send_signal(signal.SIGKILL)  # mid-run: requests in flight die with it
        first.wait()
        inflight.join()
        totals = col.servers[0].totals
        deadline = time.monotonic() + 30  # a poll fails against the dead server (counted,
        while totals.failed_polls < 1 and time.monotonic() < deadline:  # not timed)
            time.sleep(0.02)
        second = _spawn(port)
        try:
            res = drive(
                [DriveTarget(url, "k")],
                _requests(3, 0.0, prefix="b"),
                [store],
                api="sglang",
                concurrency=3,
            )
            deadline = time.monotonic() + 30  # until the poller has read the new process
            while totals.restarts < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            col.stop()
            poller.join()
            col.finish()
            second.send_signal(signal.SIGKILL)
            second.wait()
    finally:
        if first.poll() is None:
            first.kill()
    t = col.servers[0].totals
    assert t.failed_polls >= 1 and t.restarts == 1
    # reported once, whichever sign found it (a changed startup_time, or the ring's records)
    assert sum("restart at stored forward_ct" in n for n in notes) == 1, notes
    assert _keys_unique(store, "steps", "run_id, dp_rank, forward_ct")
    assert _keys_unique(store, "req_steps", "run_id, dp_rank, forward_ct, rid")
    rows = store.query("SELECT rid, forward_ct FROM req_steps").to_pandas()
    a_rows, b_rows = rows[rows.rid.str.startswith("a")], rows[rows.rid.str.startswith("b")]
    assert len(a_rows) >= 5 and b_rows.forward_ct.min() > a_rows.forward_ct.max()
    # the restarted server's steps: every one stored, exactly once
    assert len(b_rows) == sum(r.spec["spec_verify_ct"] for r in res["k"])


class _FaultyProxy:
    """Forwards to a server but answers the first /server_info calls truncated or cut."""

    def __init__(self, upstream: str, faults: list[str]):
        faults = list(faults)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                with urllib.request.urlopen(upstream + self.path) as resp:
                    body = resp.read()
                fault = faults.pop(0) if self.path == "/server_info" and faults else None
                outer.served.append(fault)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if fault == "truncated":  # the connection drops mid-body
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault == "partial":  # a complete response holding partial JSON
                    body = body[: len(body) * 2 // 3]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.served: list[str | None] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_truncated_and_partial_responses_are_retried_and_lose_nothing(tmp_path):
    store = Store(tmp_path / "store")
    with serving(mode="compact", max_batch=4) as a:
        res = drive(
            [DriveTarget(a.url, "t")],
            _requests(5, 0.0, seed=3),
            [store],
            api="sglang",
            concurrency=4,
        )
        proxy = _FaultyProxy(a.url, ["truncated", "partial", "truncated"])
        notes: list[str] = []
        col = Collector(
            [CollectorOptions(proxy.url, "t", timeout_s=5)],
            [store],
            interval_s=0.01,
            report=lambda run, msg: notes.append(msg),
        )
        try:
            col.run(duration_s=1.5)
            col.finish()
        finally:
            proxy.close()
        steps_total = a.service.steps_total
    t = col.servers[0].totals
    assert proxy.served[:3] == ["truncated", "partial", "truncated"]
    assert t.failed_polls == 3 and len([n for n in notes if "poll failed" in n]) == 3
    assert t.polls >= 1  # then a good read stored everything
    assert store.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py() == steps_total
    assert store.query("SELECT count(*) AS n FROM req_steps").column("n")[0].as_py() == sum(
        r.spec["spec_verify_ct"] for r in res["t"]
    )
    assert _keys_unique(store, "req_steps", "run_id, dp_rank, forward_ct, rid")
