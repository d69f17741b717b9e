"""Shared fixtures: SGLang 0.5.23's own code from the wheel (see tests/sglang_wheel.py).

Under pytest-xdist (``make test``: ``-n 2 --dist loadfile --no-loadscope-reorder``):

- each worker keeps torch (and the programs the tests start, through OMP_NUM_THREADS) to one
  thread: two workers with two OpenMP threads each oversubscribe a 2-core box, and OpenMP's
  spinning threads then run 5-10x slower;
- the modules that take longest are handed out first (longest-processing-time order), so the
  last module a worker gets is a short one and neither worker idles at the end. xdist's own
  reordering sorts by test count, which put the few-but-slow modules (browser, Prometheus,
  real-model runs) last, both at once. A serial run keeps the plain file order.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from sglang_wheel import WHEELS, Wheel, find_wheel  # noqa: E402

# Modules by measured wall time on a 2-core box, longest first, the waiting ones (subprocesses,
# servers, a browser, fsync) beside CPU-bound ones. A scheduling hint only: a module missing here
# runs after these, in file order.
SLOW_MODULES_FIRST = (
    "test_store.py",
    "test_analytics_estimator.py",
    "test_prometheus_e2e.py",
    "test_bench_throughput.py",
    "test_dashboard_browser.py",
    "test_store_segments.py",
    "test_engine_batched.py",
    "test_dashboard_app.py",
    "test_store_robust.py",
    "test_sglang_wheel_collect.py",
    "test_grafana.py",
    "test_profile.py",
    "test_cli_run.py",
    "test_drafter.py",
    "test_model.py",
    "test_engine_penalties.py",
    "test_sglang_collect.py",
    "test_truth_surfaces.py",
    "test_engine_estimator.py",
    "test_fuzz_files.py",
    "test_sglang_formats.py",
    "test_fanout.py",
    "test_fuzz_records.py",
    "test_store_cli.py",
    "test_engine_launch_ahead.py",
    "test_sinks_serve.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):
        return
    rank = {name: i for i, name in enumerate(SLOW_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept


def pytest_configure(config: pytest.Config) -> None:
    # No test plans with a table the developer profiled for this host (`dspark-obs profile
    # --for-this-host`): the per-host table directory is an empty one of this session's
    # (subprocesses inherit it); tests of the cache point it at their own tmp_path.
    os.environ["DSPARK_OBS_COST_TABLES"] = tempfile.mkdtemp(prefix="dspark-obs-test-tables-")
    if hasattr(config, "workerinput"):  # a pytest-xdist worker, before it collects
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["MKL_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def sglang_wheel() -> Wheel:
    """The wheel's DSpark dumper, estimator recorder, startup-time builder and /server_info
    handler, loaded from its source; skips (with the reason) only when the wheel is absent."""
    path = find_wheel()
    if path is None:
        pytest.skip(f"sglang 0.5.23 wheel not in {WHEELS} (.ci/run downloads it)")
    return Wheel.load(path)
