"""A real Prometheus scrapes `dspark-obs serve --follow` during a real engine run; PromQL over
what it scraped equals the analytics functions over the store for the same run.

Tolerance: 1e-9 relative. Counters are exact sums; the only difference is float64 rounding
order (Prometheus divides sums, the analytics average rows). The PromQL here reads the raw
counters at one instant (the whole run); over a time range the README's rate()/increase()
forms give the same ratios up to Prometheus' extrapolation.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from test_sinks_prometheus import tiny_requests, trimming_config

from dspark_obs.analytics.calibration import calibration_table, position_labels
from dspark_obs.analytics.companion import step_ceilings
from dspark_obs.analytics.windows import window_stats
from dspark_obs.engine.session import run_with_companion
from dspark_obs.store import Store
from dspark_obs.testing.tiny_models import tiny_models

PROMETHEUS = shutil.which("prometheus")
RULES = Path(__file__).resolve().parents[1] / "runtime" / "prometheus" / "rules"
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="Debian's prometheus binary is not installed (.ci/run installs it)"
)
REL = 1e-9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (OSError, http.client.HTTPException) as exc:
            last = exc
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def start_serve(store: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark_obs", "serve", "--store", str(store), "--follow",
         "--port", str(port), "--interval", "0.3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    wait_for(lambda: get(f"http://127.0.0.1:{port}/healthz"), 30, "dspark-obs serve")
    return proc


class Prometheus:
    """The real server on loopback, scraping one target every second."""

    def __init__(self, tmp: Path, target_port: int) -> None:
        self.port = free_port()
        cfg = tmp / "prometheus.yml"
        rules = [str(p) for p in sorted(RULES.glob("*.yml"))]  # the monitoring mixin
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files: {json.dumps(rules)}\n"
            "scrape_configs:\n  - job_name: dspark\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
        )
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for(lambda: get(f"{self.url}/-/ready"), 30, "prometheus ready")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def query(self, promql: str, at: float | None = None) -> list[tuple[dict, float]]:
        params = {"query": promql} | ({"time": repr(at)} if at is not None else {})
        body = get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode(params))
        data = json.loads(body)
        assert data["status"] == "success", data
        return [(r["metric"], float(r["value"][1])) for r in data["data"]["result"]]

    def scalar(self, promql: str, at: float | None = None) -> float | None:
        res = self.query(promql, at)
        return res[0][1] if res else None

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def stack(tmp_path: Path):
    store = tmp_path / "store"
    store.mkdir()
    port = free_port()
    serve = start_serve(store, port)
    prom = Prometheus(tmp_path, port)
    procs = {"serve": serve}
    yield store, port, prom, procs
    prom.close()
    for p in procs.values():
        p.terminate()
        p.wait(10)


def wait_scraped(prom: Prometheus, store: Store, timeout: float = 60) -> None:
    """Until Prometheus holds every request-step and request the store holds."""
    n_rs = store.query("SELECT count(*) AS n FROM req_steps").column("n")[0].as_py()
    n_req = store.query("SELECT count(*) AS n FROM requests").column("n")[0].as_py()

    def done() -> bool:
        return (
            prom.scalar("sum(dspark_req_steps_total)") == n_rs
            and prom.scalar("sum(dspark_requests_total)") == n_req
            # > 0, not just present: every series is born at 0 one scrape before its value
            and (prom.scalar("sum(dspark_estimator_blocks_total)") or 0) > 0
        )

    wait_for(done, timeout, f"{n_rs} req_steps and {n_req} requests scraped")


def by_label(rows: list[tuple[dict, float]], label: str) -> dict[str, float]:
    return {m[label]: v for m, v in rows}


def check_promql_equals_store(
    prom: Prometheus, store: Store, compact_run: str, expect_trim: bool = True
) -> None:
    rs = store.query("SELECT * FROM req_steps").to_pandas()
    runs = store.query("SELECT run_id, mode FROM runs").to_pandas()
    compact = rs[rs.run_id == compact_run]
    lab = position_labels(compact, runs=runs)

    acc = by_label(prom.query(
        'sum by (position) (dspark_position_accepted_total{mode="compact"})'
        ' / sum by (position) (dspark_position_observed_total{mode="compact"})'),
        "position")  # fmt: skip
    want = lab[lab.observed].groupby("position").label.mean()
    assert {int(k) for k in acc} == set(want.index)
    for j, v in want.items():
        assert acc[str(j)] == pytest.approx(v, rel=REL)

    window = by_label(prom.query(
        'sum by (workload) (dspark_verify_window_tokens_sum{mode="compact"})'
        ' / sum by (workload) (dspark_verify_window_tokens_count{mode="compact"})'),
        "workload")  # fmt: skip
    ws = window_stats(compact, by=("workload",))
    assert set(window) == set(ws.workload)
    for r in ws.itertuples():
        assert window[r.workload] == pytest.approx(r.mean_window, rel=REL)

    util = prom.scalar(
        "sum(dspark_ceiling_committed_tokens_total) / sum(dspark_ceiling_tokens_total)"
    )
    cap = step_ceilings(rs[rs.run_id == f"{compact_run}-cap"])
    assert util == pytest.approx(cap.committed.sum() / cap.ceiling.sum(), rel=REL)
    if expect_trim:  # the tiny run's cost table trims: else this comparison proves little
        assert util < 1.0

    ece = by_label(prom.query(
        'sum by (position) (abs('
        'sum by (position, bin) (dspark_calibration_predicted_probability_total{mode="compact"})'
        ' - sum by (position, bin) (dspark_calibration_accepted_total{mode="compact"})))'
        ' / sum by (position) (dspark_calibration_observations_total{mode="compact"})'),
        "position")  # fmt: skip
    table = calibration_table(lab, by=("position",))
    assert len(table) == len(ece) > 0
    for r in table.itertuples():
        assert ece[str(r.position)] == pytest.approx(r.ece, rel=1e-6, abs=1e-12)


def check_recipes_and_rules(prom: Prometheus, store: Store, compact_run: str) -> None:
    """The README's increase() / rate() recipes are exact: every series is born at 0, so an
    increase() over the whole run, evaluated at a scrape, is the run's total (no first
    increment lost, nothing extrapolated). The mixin's recorded series equal the store."""
    rs = store.query("SELECT * FROM req_steps").to_pandas()
    runs = store.query("SELECT run_id, mode FROM runs").to_pandas()
    at = prom.scalar("max(timestamp(up))")  # the last scrape: nothing to extrapolate to
    assert prom.scalar("sum(increase(dspark_req_steps_total[1h]))", at) == pytest.approx(
        len(rs), rel=REL
    )
    committed = prom.scalar('sum(increase(dspark_committed_tokens_total{mode="compact"}[1h]))', at)
    assert committed == pytest.approx(rs[rs.run_id == compact_run].acc_len.sum(), rel=REL)
    lab = position_labels(rs[rs.run_id == compact_run], runs=runs)
    ece = by_label(prom.query(
        'sum by (position) (abs('
        'sum by (position, bin) (increase(dspark_calibration_predicted_probability_total'
        '{mode="compact"}[1h]))'
        ' - sum by (position, bin) (increase(dspark_calibration_accepted_total'
        '{mode="compact"}[1h]))))'
        ' / sum by (position) (increase(dspark_calibration_observations_total'
        '{mode="compact"}[1h]))',
        at), "position")  # fmt: skip
    for r in calibration_table(lab, by=("position",)).itertuples():
        assert ece[str(r.position)] == pytest.approx(r.ece, rel=1e-6, abs=1e-12)

    # recording rules, evaluated by the same server (the run is shorter than their 5m window)
    per = lab[lab.observed].groupby(["workload", "position"]).label.mean()
    cap = step_ceilings(rs[rs.run_id == f"{compact_run}-cap"])
    by_wl = cap.groupby("workload")[["committed", "ceiling"]].sum()

    def settled(name: str, want) -> list[tuple[dict, float]]:
        """The recorded series once an evaluation after the last scrape gives ``want``."""

        def check():
            got = prom.query(name)
            ok = bool(got) and all(v == pytest.approx(want(m), rel=1e-6) for m, v in got)
            return got if ok else None

        try:
            return wait_for(check, 30, name)
        except AssertionError:
            got = prom.query(name)
            raise AssertionError(f"{name}: {[(m, v, want(m)) for m, v in got]}") from None

    acc = settled(
        'model_mode_workload_position:dspark_position_acceptance:ratio_rate5m{mode="compact"}',
        lambda m: per[(m["workload"], int(m["position"]))],
    )
    assert len(acc) == len(per)
    util = settled(
        "model_mode_workload:dspark_utilization:ratio_rate5m",
        lambda m: by_wl.loc[m["workload"]].committed / by_wl.loc[m["workload"]].ceiling,
    )
    assert {m["mode"] for m, _ in util} == {"cap-accept"}  # a compact run has no measured one
    est = wait_for(
        lambda: prom.query("model_mode_workload:dspark_utilization_estimated:ratio_rate5m"),
        30,
        "estimated utilization",
    )
    assert {m["mode"] for m, _ in est} == {"compact"} and all(0 < v <= 1 for _, v in est)
    rules = json.loads(get(f"{prom.url}/api/v1/rules"))["data"]["groups"]
    assert {g["name"] for g in rules} == {"dspark-obs.recording", "dspark-obs.alerts"}
    assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules


def metrics_text(port: int) -> dict[str, float]:
    out = {}
    for line in get(f"http://127.0.0.1:{port}/metrics").decode().splitlines():
        if line.startswith("dspark_") and "_total{" in line:
            key, _, v = line.rpartition(" ")
            out[key] = float(v)
    return out


def test_promql_over_a_live_tiny_run_equals_the_store(stack) -> None:
    store_dir, port, prom, procs = stack
    store = Store(store_dir)
    # the engine writes segments while serve follows the store and Prometheus scrapes serve
    run_with_companion(
        tiny_models(), tiny_requests(12), trimming_config(), [store], "live", companion=True,
        workload="mixed",
    )  # fmt: skip
    store.close()
    wait_scraped(prom, store)
    check_promql_equals_store(prom, store, "live")
    check_recipes_and_rules(prom, store, "live")
    assert prom.scalar("sum(dspark_records_rejected_total)") in (None, 0.0)

    # restart serve: counters resume from the store, never backwards
    before = metrics_text(port)
    procs["serve"].terminate()
    procs["serve"].wait(10)
    procs["serve"] = start_serve(store_dir, port)
    after = wait_for(lambda: (m := metrics_text(port)).keys() == before.keys() and m, 30, "totals")
    # the same totals (float sums may differ in the last bits: other summation order)
    assert after == pytest.approx(before, rel=REL)
    assert any(k.startswith("dspark_steps_total{") and v > 0 for k, v in after.items())


def test_promql_over_a_real_smollm2_run_equals_the_store(stack) -> None:
    from dspark_obs.engine.weights import ModelFetchError, fetch_model

    try:
        fetch_model(progress=False)
    except ModelFetchError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")
    store_dir, _, prom, _ = stack
    live_port = free_port()  # the run's own in-process endpoint, polled while it runs
    err = store_dir.parent / "run.err"
    run = subprocess.Popen(
        [sys.executable, "-m", "dspark_obs", "run", "-n", "4", "--max-new-tokens", "24",
         "--companion", "--store", str(store_dir), "--run-id", "real", "--seed", "1",
         "--metrics-port", str(live_port)],
        stdout=subprocess.DEVNULL, stderr=err.open("w"),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    live_steps = 0.0
    while run.poll() is None:
        try:
            text = get(f"http://127.0.0.1:{live_port}/metrics", timeout=2).decode()
            live_steps = max(live_steps, sum(
                float(line.rpartition(" ")[2]) for line in text.splitlines()
                if line.startswith("dspark_req_steps_total{")))  # fmt: skip
        except (OSError, http.client.HTTPException):
            pass  # not up yet, or the run exited in the middle of this scrape
        time.sleep(0.2)
    assert run.returncode == 0, err.read_text()[-2000:]
    assert live_steps > 0  # `run --metrics-port` exposed the run while it ran
    store = Store(store_dir)
    wait_scraped(prom, store)
    check_promql_equals_store(prom, store, "real", expect_trim=False)
    models = {m["model"] for m, _ in prom.query("dspark_steps_total")}
    assert models == {"SmolLM2-135M-Instruct"}
