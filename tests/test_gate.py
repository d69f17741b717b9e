"""The A/B gate and the bench command over real HTTP, against SGLang-format test servers.

The servers are the scripted SGLang-format double of test_serving_fakeserver (SGLang needs
a GPU); test_gate_engine_server.py runs the same gate against `dspark-obs engine-server`.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from test_serving_fakeserver import FakeServer
from typer.testing import CliRunner

from dspark_obs.cli import app
from dspark_obs.serving import ServingClient
from dspark_obs.serving.gate import perf_verdict
from dspark_obs.serving.runner import GateOptions, gate_servers
from dspark_obs.store import Store

# The gates here run against servers on a shared, loaded machine: wall-clock timings of two
# identical servers differ by any amount, so these tests never let the performance verdict
# decide (a huge allowance); test_perf_verdict_* checks the verdict on fixed timings.
NO_PERF = 1e9
OPTS = GateOptions(prompts=3, parity_tokens=24, parity_workload="random", bench_workload="random",
                   bench_requests=4, bench_input_len=8, bench_output_len=8, warmup=1,
                   vocab_size=1000, max_regression=NO_PERF)
SMALL = ["--prompts", "3", "--parity-tokens", "24", "--parity-workload", "random",
         "--bench-workload", "random", "--bench-requests", "4", "--input-len", "8",
         "--output-len", "8", "--vocab-size", "1000", "--max-regression", str(NO_PERF)]


def _gate(base: FakeServer, new: FakeServer):
    return gate_servers(ServingClient(base.url), ServingClient(new.url), OPTS)


def _check(report, name):
    return next(c for c in report.checks if c.name == name)


def test_identical_servers_pass_every_check():
    with FakeServer() as a, FakeServer() as b:
        report = gate_servers(ServingClient(a.url), ServingClient(b.url),
                              replace(OPTS, rounds=2))
    assert report.passed, report.to_markdown()
    # Two alternated rounds pooled: 2 x 4 requests of 8 tokens per side.
    assert report.base_summary.completed == 8 and report.new_summary.output_tokens == 64
    assert [c.passed for c in report.checks] == [True, True, True, True]
    assert "72 tokens identical (token ids)" in _check(report, "greedy parity").detail
    md = report.to_markdown()
    assert md.startswith("# dspark-obs gate: PASS")
    assert "derived step time (ms) = mean TPOT x mean accept length" in md


def test_parity_fails_at_the_first_differing_token_with_context():
    with FakeServer() as a, FakeServer(perturb_at=17) as b:
        report = _gate(a, b)
        good = a.tokens(a.requests[0]["input_ids"], 24, 0.0, None)
    parity = _check(report, "greedy parity")
    assert not report.passed and parity.passed is False
    assert "3/3 prompts differ" in parity.detail
    diff = parity.differences[0]
    assert (diff.unit, diff.index) == ("token", 17)
    assert f"[{good[17]}]" in diff.base and f"[{(good[17] + 1) % 1000}]" in diff.new
    assert " ".join(map(str, good[9:17])) in diff.base  # context before the difference
    assert "first difference at token 17" in report.to_markdown()


def test_contamination_check_catches_sampling_state_leaking_into_greedy():
    with FakeServer() as a, FakeServer(leak_sampling=True) as b:
        report = _gate(a, b)
    assert _check(report, "greedy parity").passed  # the first greedy pass is clean
    leak = _check(report, "contamination")
    assert leak.passed is False and leak.differences
    assert not report.passed


def test_accept_length_change_beyond_tolerance_fails():
    with FakeServer(accept=(3, 1, 2)) as a, FakeServer(accept=(1, 2)) as b:
        report = _gate(a, b)
    accept = _check(report, "accept length")
    assert accept.passed is False and "base 2.000, new 1.500" in accept.detail
    assert _check(report, "greedy parity").passed


def test_bench_cli_writes_store_and_json_then_gate_compares_stored_runs(tmp_path):
    runner = CliRunner()
    store = tmp_path / "store"
    with FakeServer(step_s=0.002) as good, FakeServer(step_s=0.002, perturb_at=2) as bad:
        for run_id, server in (("ra", good), ("rb", good), ("rc", bad)):
            res = runner.invoke(app, ["bench", "--url", server.url, "-n", "5", "--input-len",
                                      "8", "--output-len", "6", "--vocab-size", "1000",
                                      "--run-id", run_id, "--store", str(store),
                                      "--json", str(tmp_path / f"{run_id}.json")])
            assert res.exit_code == 0, res.output
    assert "TPOT (ms, excl. TTFT)" in res.output and "phase band" in res.output
    assert "derived step time" in res.output and "rerun: dspark-obs bench" in res.output
    data = json.loads((tmp_path / "ra.json").read_text())
    assert data["summary"]["completed"] == 5 and len(data["requests"]) == 5
    assert data["summary"]["accept_length"]["mean"] == pytest.approx(2.0)
    rows = Store(store).query(
        "SELECT r.source, q.completion_tokens, q.spec_verify_ct, len(q.output_tokens) AS n "
        "FROM runs r JOIN requests q USING (run_id) WHERE run_id = 'ra'").to_pylist()
    assert len(rows) == 5  # warm-up excluded
    assert all(r == {"source": "bench", "completion_tokens": 6, "spec_verify_ct": 3, "n": 6}
               for r in rows)

    same = runner.invoke(app, ["gate", "ra", "rb", "--store", str(store),
                               "--max-regression", str(NO_PERF)])
    assert same.exit_code == 0, same.output
    assert "| contamination | not run |" in same.output
    differ = runner.invoke(app, ["gate", "ra", "rc", "--store", str(store),
                                 "--max-regression", str(NO_PERF),
                                 "--report", str(tmp_path / "gate.md")])
    assert differ.exit_code == 1, differ.output
    assert "first difference at token 2" in (tmp_path / "gate.md").read_text()
    missing = runner.invoke(app, ["gate", "ra", "nope", "--store", str(store)])
    assert missing.exit_code == 1 and "no run 'nope'" in missing.output


def test_gate_cli_over_urls_exit_codes(tmp_path):
    runner = CliRunner()
    with FakeServer() as a, FakeServer() as b, FakeServer(perturb_at=0) as c:
        ok = runner.invoke(app, ["gate", a.url, b.url, *SMALL])
        bad = runner.invoke(app, ["gate", a.url, c.url, *SMALL])
    assert ok.exit_code == 0, ok.output
    assert bad.exit_code == 1 and "first difference at token 0" in bad.output
    mixed = runner.invoke(app, ["gate", "http://127.0.0.1:9", "run1"])
    assert mixed.exit_code == 1 and "two server URLs or two stored run ids" in mixed.output
    down = runner.invoke(app, ["gate", "http://127.0.0.1:9", "http://127.0.0.1:9"])
    assert down.exit_code == 1 and "does not answer" in down.output


def _timed(tpot_ms: list[float], accept: float = 2.0) -> pd.DataFrame:
    return pd.DataFrame({"ok": True, "tpot_s": np.asarray(tpot_ms) / 1000.0,
                         "accept_length": accept})


@pytest.mark.parametrize(
    ("scale", "verdict", "ok"),
    [(1.5, "slower beyond 3%", False), (1.02, "slower, within the 3% allowance", True),
     (0.8, "faster", True), (1.0, "no significant difference", True)],
)
def test_perf_verdict_on_fixed_timings(scale: float, verdict: str, ok: bool) -> None:
    """The performance verdict from fixed per-request timings (no clock involved)."""
    base = [10.0, 10.2, 9.9, 10.1, 10.0, 9.8, 10.3, 10.0]
    new = [t * scale for t in base]
    if scale == 1.0:
        new = base[::-1]  # same values, another order: the interval straddles 1
    check, (point, lo, hi) = perf_verdict(_timed(base), _timed(new), max_regression=0.03)
    assert check.passed is ok and check.detail.endswith(verdict), check.detail
    assert lo <= point <= hi and point == pytest.approx(scale)
