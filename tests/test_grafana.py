"""The Grafana dashboard: generated JSON = committed JSON; every panel reads catalog metrics
and guards its divisions; every panel's PromQL returns data from a real Prometheus
(/usr/bin/prometheus on loopback) scraping a real `dspark-obs serve --follow` while a run is
being written into its store.

Grafana itself is not installable here, so its two query-time substitutions are done by the
test: $__rate_interval becomes a window of a few scrapes, $__range the test's span, and the
$model / $mode / $workload variables their "All" value (.*).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "dashboards" / "grafana"))
sys.path.insert(0, str(ROOT / "dashboards"))

import build  # noqa: E402
from screenshots import free_port, wait_http  # noqa: E402

from dspark_obs.sinks.catalog import METRICS  # noqa: E402
from dspark_obs.store import Store  # noqa: E402
from dspark_obs.testing import sample_store  # noqa: E402

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
RULES = ROOT / "runtime" / "prometheus" / "rules"  # the mixin the panels read
SCRAPE_S = 1


def test_committed_json_is_what_build_generates() -> None:
    assert build.OUT.read_text() == build.render(), "run python dashboards/grafana/build.py"
    d = json.loads(build.OUT.read_text())
    assert d["uid"] == build.UID
    titles = [p["title"] for p in d["panels"] if p["type"] != "row"]
    assert len(titles) == sum(len(ps) for _, ps in build.PANELS) == len(set(titles))


def test_panels_name_their_catalog_metrics_and_guard_divisions() -> None:
    catalog = {m.name for m in METRICS}
    for _, panels in build.PANELS:
        for p in panels:
            assert p.metrics, p.title
            assert set(p.metrics) <= catalog, (p.title, set(p.metrics) - catalog)
            for m in p.metrics:
                assert m in p.description, (p.title, m)
            for q in p.queries:
                # every division is by a parenthesized "(... > 0)" group
                for tail in q.expr.split(" / ")[1:]:
                    depth, end = 0, None
                    for i, ch in enumerate(tail):
                        depth += {"(": 1, ")": -1}.get(ch, 0)
                        if depth == 0:
                            end = i
                            break
                    assert tail.startswith("(") and end is not None, (p.title, q.expr)
                    assert tail[:end].rstrip().endswith("> 0"), (p.title, q.expr)


def _prom_query(base: str, expr: str, **params: str) -> list[dict]:
    path = "query_range" if "start" in params else "query"
    qs = urllib.parse.urlencode({"query": expr, **params})
    with urllib.request.urlopen(f"{base}/api/v1/{path}?{qs}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _grafana_expr(expr: str, rate_window: str, range_window: str) -> str:
    out = expr.replace("$__rate_interval", rate_window).replace("$__range", range_window)
    return re.sub(r"\$\{?(model|mode|workload)\}?", ".*", out)


def _values(result: list[dict]) -> list[float]:
    vals = []
    for series in result:
        pairs = series.get("values") or [series["value"]]
        vals += [float(v) for _, v in pairs]
    return vals


@pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="Debian prometheus not installed")
def test_every_panel_query_returns_data(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    tables = sample_store.synthetic_tables(n_requests=12, max_new_tokens=32, seed=2, prefix="g")
    store.write("runs", sample_store._arrow("runs", tables["runs"]))
    metrics_port, prom_port = free_port(), free_port()
    (tmp_path / "prometheus.yml").write_text(
        f"global:\n  scrape_interval: {SCRAPE_S}s\n  evaluation_interval: {SCRAPE_S}s\n"
        f"rule_files: {json.dumps([str(p) for p in sorted(RULES.glob('*.yml'))])}\n"
        "scrape_configs:\n  - job_name: dspark-obs\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{metrics_port}']\n"
    )
    serve = subprocess.Popen(
        [sys.executable, "-m", "dspark_obs", "serve", "--follow", "--store", str(store.root),
         "--port", str(metrics_port), "--interval", "0.5"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{prom_port}"
    try:
        wait_http(f"http://127.0.0.1:{metrics_port}/healthz")
        wait_http(f"{base}/-/ready")
        start = time.time()
        writer = threading.Thread(
            target=sample_store.write_in_slices, args=(store, tables, 8, 1.0), daemon=True
        )
        writer.start()
        writer.join(timeout=60)
        time.sleep(6 * SCRAPE_S)  # a flat tail: windows with no traffic must give no NaN
        end = time.time()
        span = f"{math.ceil(end - start) + 5}s"
        missing, bad = [], []
        for _, panels in build.PANELS:
            for p in panels:
                for q in p.queries:
                    expr = _grafana_expr(q.expr, f"{4 * SCRAPE_S}s", span)
                    if q.instant:
                        result = _prom_query(base, expr, time=f"{end:.3f}")
                    else:
                        result = _prom_query(
                            base, expr, start=f"{start:.3f}", end=f"{end:.3f}", step="1"
                        )
                    vals = _values(result)
                    if not vals:
                        missing.append(f"{p.title}: {q.legend}")
                    if any(not math.isfinite(v) for v in vals):
                        bad.append(f"{p.title}: {q.legend}")
        assert not missing, f"queries without data: {missing}"
        assert not bad, f"queries with NaN/Inf (unguarded division): {bad}"
        # the guard really drops idle windows: after the run, ratios have no sample at all
        accept_length = {p.title: p for _, ps in build.PANELS for p in ps}["Accept length"]
        idle = _grafana_expr(accept_length.queries[0].expr, f"{4 * SCRAPE_S}s", span)
        assert _prom_query(base, idle, time=f"{end:.3f}") == []
    finally:
        for proc in (prom, serve):
            proc.terminate()
        for proc in (prom, serve):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_per_position_acceptance_never_sums_modes() -> None:
    """Mode = All: compact and cap-accept counts of the same requests stay separate series."""
    panel = {p.title: p for _, ps in build.PANELS for p in ps}["Acceptance per position"]
    (q,) = panel.queries
    rule = build.RECORDING_RULES[panel.recorded[0]]
    assert "mode" in re.search(r"sum by \(([^)]*)\)", rule).group(1)
    assert "{{mode}}" in q.legend


def test_compact_utilization_is_estimated_with_its_interval() -> None:
    panel = next(p for _, ps in build.PANELS for p in ps if p.title.startswith("Utilization"))
    legends = [q.legend for q in panel.queries]
    assert [g.split(" {{")[0] for g in legends] == [
        "measured", "estimated", "estimated lo", "estimated hi"]  # fmt: skip
    measured = build.RECORDING_RULES[panel.recorded[panel.recorded.index(
        "model_mode_workload:dspark_utilization:ratio_rate5m")]]  # fmt: skip
    assert "dspark_ceiling_tokens_total" in measured  # exact ceilings only (no compact series)
