"""`dspark-obs serve` feeds: following a store (incl. compaction, restarts), replaying a run,
read confinement, and the CLI's errors."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from prometheus_client import CollectorRegistry
from test_sinks_prometheus import tiny_models, tiny_requests, trimming_config, value
from typer.testing import CliRunner

from dspark_obs.cli import app
from dspark_obs.engine.session import run_with_companion
from dspark_obs.schema import TABLES
from dspark_obs.sinks import PrometheusSink
from dspark_obs.sinks.serve import StoreFollower, replay
from dspark_obs.store import Store


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve") / "store"
    store = Store(root)
    run_with_companion(
        tiny_models(), tiny_requests(6), trimming_config(), [store], "s", companion=False,
        workload="mixed",
    )  # fmt: skip
    store.close()
    return root


def sink() -> PrometheusSink:
    return PrometheusSink(registry=CollectorRegistry(), background=False)


def stored(root: Path, sql: str) -> float:
    return Store(root).query(sql).column(0)[0].as_py()


def test_follow_reads_everything_once_then_only_new_rows(store_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "store"
    shutil.copytree(store_dir, root, symlinks=True)
    prom = sink()
    follower = StoreFollower(root, prom)
    assert follower.poll() > 0
    n = stored(root, "SELECT count(*) FROM req_steps")
    assert value(prom, "dspark_req_steps_total") == n
    assert follower.poll() == 0
    # compaction rewrites the segments: nothing is counted twice
    Store(root).compact()
    assert follower.poll() == 0
    assert value(prom, "dspark_req_steps_total") == n
    # a new run, written by another writer, is picked up by the next poll
    store = Store(root)
    run_with_companion(
        tiny_models(), tiny_requests(3, seed=1), trimming_config("cap-accept"), [store], "s2",
        companion=False, workload="math",
    )  # fmt: skip
    store.close()
    assert follower.poll() > 0
    assert value(prom, "dspark_req_steps_total") == stored(root, "SELECT count(*) FROM req_steps")
    assert value(prom, "dspark_req_steps_total", mode="cap-accept") > 0
    # a restarted follower starts from what the store holds
    again = sink()
    StoreFollower(root, again).poll()
    assert value(again, "dspark_committed_tokens_total") == value(
        prom, "dspark_committed_tokens_total"
    )


def test_replay_at_once_equals_following(store_dir: Path) -> None:
    followed, replayed = sink(), sink()
    StoreFollower(store_dir, followed).poll()
    rows = replay(store_dir, "s", replayed, speed=0)
    assert rows == sum(stored(store_dir, f"SELECT count(*) FROM {t}") for t in TABLES)
    for name in (
        "dspark_req_steps_total",
        "dspark_position_accepted_total",
        "dspark_estimator_point_tokens_total",
        "dspark_request_accept_length_count",
    ):
        assert value(replayed, name) == pytest.approx(value(followed, name), rel=1e-12)


def test_replay_keeps_the_recorded_pace(store_dir: Path) -> None:
    first = stored(store_dir, "SELECT epoch_us(min(ts)) / 1e6 FROM steps")
    last = stored(store_dir, "SELECT max(finish_time) FROM requests")
    speed = (last - first) / 0.6  # the whole run re-played in about 0.6 s
    t0 = time.monotonic()
    replay(store_dir, "s", sink(), speed=speed)
    assert 0.5 <= time.monotonic() - t0 < 5.0


def test_partitions_outside_the_store_are_never_read(tmp_path: Path) -> None:
    root, outside = tmp_path / "store", tmp_path / "outside"
    (root / "req_steps").mkdir(parents=True)
    outside.mkdir()
    pq.write_table(TABLES["req_steps"].empty_table(), outside / "seg-0.parquet")
    os.symlink(outside, root / "req_steps" / "run_id=evil")
    follower = StoreFollower(root, sink())
    assert follower.poll() == 0
    assert any("outside the store" in p for p in follower.problems)


def test_serve_cli_errors_are_clear(store_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["serve", "--store", str(store_dir)])
    assert res.exit_code == 2 and "choose one feed" in res.output
    res = runner.invoke(app, ["serve", "--store", str(tmp_path / "nope"), "--follow"])
    assert res.exit_code == 2 and "no store at" in res.output
    res = runner.invoke(
        app, ["serve", "--store", str(store_dir), "--replay", "missing", "--port", "0"]
    )
    assert res.exit_code == 2 and "not in the store" in res.output
    assert "Traceback" not in res.output


def test_empty_batches_and_an_empty_store_are_fine(tmp_path: Path) -> None:
    prom = sink()
    prom.write("req_steps", TABLES["req_steps"].empty_table())
    (tmp_path / "s").mkdir()
    assert StoreFollower(tmp_path / "s", prom).poll() == 0
    assert value(prom, "dspark_req_steps_total") == 0


@pytest.mark.parametrize("damage", [b"", b"not parquet at all", b"PAR1" + b"\0" * 64])
def test_a_damaged_segment_is_skipped_and_named_never_stalls_the_rest(
    store_dir: Path, tmp_path: Path, damage: bytes
) -> None:
    root = tmp_path / "store"
    shutil.copytree(store_dir, root, symlinks=True)
    part = root / "req_steps" / "run_id=s"
    # sorts first: every later segment, table and run must still be read
    (part / "seg-00000000000000000000-1-deadbeef.parquet").write_bytes(damage)
    prom = sink()
    follower = StoreFollower(root, prom)
    assert follower.poll() > 0
    assert value(prom, "dspark_req_steps_total") == stored(root, "SELECT count(*) FROM req_steps")
    assert value(prom, "dspark_requests_total") > 0  # a table polled after req_steps
    problems = follower.health()["problems"]
    assert len(problems) == 1 and "seg-00000000000000000000-1-deadbeef.parquet" in problems[0]
    assert follower.poll() == 0
    assert len(follower.health()["problems"]) == 1  # named once, not on every poll
