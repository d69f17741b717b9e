"""The sink queues' backpressure counters on /metrics: exact values, and valid exposition
by the real ``promtool check metrics``."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))

from test_fanout import GatedSink, ThreadClock, _steps, _wait_for  # noqa: E402

from dspark_obs.fanout import FanOut, MemorySink  # noqa: E402
from dspark_obs.sinks.backpressure import LaneCollector  # noqa: E402

PROMTOOL = shutil.which("promtool")


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[(s.name, s.labels["sink"])] = s.value
    return out


def test_backpressure_counters_are_exact_and_read_live() -> None:
    slow, fast = GatedSink(), MemorySink()
    clock = ThreadClock()
    fan = FanOut([slow, fast], threaded=True, queue_batches=1, clock=clock)
    registry = CollectorRegistry()
    registry.register(LaneCollector(fan.stats))
    fan.emit("steps", _steps(0))
    assert slow.entered.wait(60)
    fan.emit("steps", _steps(1))  # fills the slow sink's queue (the fast one's may wait too)
    producer = threading.Thread(target=fan.emit, args=("steps", _steps(2)), name="producer")
    producer.start()
    _wait_for(lambda: clock.calls.get("producer", 0) >= 1)
    before = _samples(registry)
    assert before[("dspark_sink_batches_total", "GatedSink")] == 0
    slow.gate.set()
    producer.join(60)
    fan.drain()
    got = _samples(registry)
    assert got[("dspark_sink_batches_total", "GatedSink")] == 3
    assert got[("dspark_sink_batches_total", "MemorySink")] == 3
    assert got[("dspark_sink_rows_total", "GatedSink")] == 9
    assert got[("dspark_sink_blocked_total", "GatedSink")] == 1
    assert got[("dspark_sink_blocked_seconds_total", "GatedSink")] == 1.0
    assert got[("dspark_sink_failed_batches_total", "GatedSink")] == 0
    fan.close()


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian prometheus) not installed")
def test_promtool_accepts_the_exposition() -> None:
    fan = FanOut([MemorySink()], threaded=True)
    fan.emit("steps", _steps(0))
    fan.drain()
    registry = CollectorRegistry()
    registry.register(LaneCollector(fan.stats))
    assert PROMTOOL is not None
    res = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=generate_latest(registry), capture_output=True
    )
    assert res.returncode == 0, res.stderr.decode() + res.stdout.decode()
    fan.close()


def test_a_runs_prometheus_sink_exposes_its_own_backpressure_as_the_catalog_says() -> None:
    from dspark_obs.sinks.backpressure import expose_backpressure
    from dspark_obs.sinks.catalog import BACKPRESSURE_METRICS
    from dspark_obs.sinks.prometheus import PrometheusSink

    prom, mem = PrometheusSink(background=False), MemorySink()
    fan = FanOut([mem, prom], threaded=True)
    assert expose_backpressure(fan, [mem, prom]) == 1  # only the sink that serves a registry
    fan.emit("steps", _steps(0))
    fan.drain()
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(prom.registry).decode())
    }
    for m in BACKPRESSURE_METRICS:
        assert families[m.family].type == m.kind == "counter", m.name
        assert families[m.family].documentation == m.help
        assert {s.labels["sink"] for s in families[m.family].samples} == {
            "MemorySink",
            "PrometheusSink",
        }
    got = _samples(prom.registry)
    assert got[("dspark_sink_batches_total", "PrometheusSink")] == 1
    assert got[("dspark_sink_rows_total", "MemorySink")] == 3
    fan.close()


def test_an_inline_fanout_reports_the_fold_queue_of_a_sink_that_keeps_one() -> None:
    from dspark_obs.sinks.prometheus import PrometheusSink

    folding, inline, mem = PrometheusSink(), PrometheusSink(background=False), MemorySink()
    fan = FanOut([folding, inline, mem])  # inline: written on the caller's thread
    fan.emit("steps", _steps(0))
    folding.flush()
    own, plain, memory = fan.stats()
    assert own.capacity == folding.queue_stats.capacity > 0  # its fold thread's queue
    assert (own.done, own.rows) == (1, 3)  # what the fan-out wrote to it stays the fan-out's
    assert plain.capacity == memory.capacity == 0  # no queue of their own
    assert "max queue" in fan.summary().splitlines()[0]
    fan.close()
