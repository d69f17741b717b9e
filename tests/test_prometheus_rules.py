"""The monitoring mixin (runtime/prometheus/rules): promtool accepts the rules and their unit
tests pass (each alert fires on one input and stays silent on another); every series a rule
reads is in the telemetry catalog; every alert links a runbook section that exists."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dspark_obs.sinks.catalog import METRICS

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "runtime" / "prometheus" / "rules"
RULE_FILES = sorted(RULES.glob("*.yml"))
UNIT_TESTS = RULES / "tests" / "dspark-rules.test.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian prometheus: scripts/install-test-deps.sh)",
)


def _rules() -> list[dict]:
    return [
        r for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]
    ]


@needs_promtool
def test_promtool_check_rules() -> None:
    out = subprocess.run([PROMTOOL, "check", "rules", *map(str, RULE_FILES)],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(RULE_FILES)


@needs_promtool
def test_promtool_unit_tests_fire_and_stay_silent() -> None:
    out = subprocess.run([PROMTOOL, "test", "rules", str(UNIT_TESTS)], capture_output=True,
                         text=True, cwd=UNIT_TESTS.parent)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    cases = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    fired, silent = set(), set()
    for case in cases:
        for t in case.get("alert_rule_test", []):
            (fired if t["exp_alerts"] else silent).add(t["alertname"])
            # an alert that fires for some label sets stays silent for the others
            if t["exp_alerts"] and len(case["input_series"]) > len(t["exp_alerts"]):
                silent.add(t["alertname"])
    alerts = {r["alert"] for r in _rules() if "alert" in r}
    assert len(alerts) == 9
    assert alerts == fired and alerts <= silent


def _collector_series() -> set[str]:
    """The SGLang collector's own series (dspark_obs/sglang/fleet.py), as it exposes them."""
    from types import SimpleNamespace

    from dspark_obs.sglang.collector import CollectorTotals
    from dspark_obs.sglang.fleet import CollectorMetrics

    server = SimpleNamespace(opts=SimpleNamespace(run_id="r", url="http://x"),
                             totals=CollectorTotals())  # fmt: skip
    fake = SimpleNamespace(servers=[server], up={"r": True})
    return {s.name for fam in CollectorMetrics(fake).collect() for s in fam.samples}


def test_rules_read_catalog_series_and_alerts_link_their_runbook() -> None:
    catalog = _collector_series()
    for m in METRICS:
        catalog |= (
            {m.name}
            if m.kind == "counter"
            else {f"{m.name}_{s}" for s in ("bucket", "sum", "count")}
        )
    records = {r["record"] for r in _rules() if "record" in r}
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in RUNBOOK.read_text().splitlines()
        if line.startswith("## ")
    }
    for rule in _rules():
        names = set(re.findall(r"(?<![\w:])(dspark_[a-z0-9_]+)(?![\w:])", rule["expr"]))
        names |= set(re.findall(r"\b([a-z_]+:dspark_[a-z0-9_]+:[a-z0-9_]+)\b", rule["expr"]))
        for name in names:
            assert name in catalog or name in records, (rule.get("record") or rule["alert"], name)
        if "alert" in rule:
            ann = rule["annotations"]
            assert {"summary", "description", "runbook_url"} <= set(ann), rule["alert"]
            page, _, anchor = ann["runbook_url"].partition("#")
            assert page == "docs/runbook.md" and anchor in anchors, (rule["alert"], anchor)
            assert rule["labels"]["severity"] in ("warning", "critical")
