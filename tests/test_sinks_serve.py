"""`dspark-obs serve` feeds: following a store (incl. compaction, restarts), replaying a run,
read confinement, and the CLI's errors."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from prometheus_client import CollectorRegistry
from test_sinks_prometheus import tiny_requests, trimming_config, value
from typer.testing import CliRunner

from dspark_obs.cli import app
from dspark_obs.engine.session import run_with_companion
from dspark_obs.schema import TABLES
from dspark_obs.sinks import PrometheusSink
from dspark_obs.sinks.serve import MAX_PROBLEMS, StoreFollower, replay
from dspark_obs.store import Store
from dspark_obs.store.check import check_store, repair
from dspark_obs.testing.tiny_models import tiny_models

sys.path.insert(0, str(Path(__file__).parent))
import test_store_source as src  # noqa: E402


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
        "dspark_request_accept_length_tokens_count",
    ):
        assert value(replayed, name) == pytest.approx(value(followed, name), rel=1e-12)


class FakeClock:
    """A clock that only moves when the replay asks to sleep: the pace is counted, not timed."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class FeedLog:
    """A sink recording the fake time at which each batch arrived."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.writes = clock, []

    def write(self, table: str, batch) -> None:
        self.writes.append((self.clock(), table, batch.num_rows))

    def close(self) -> None:
        pass


def test_replay_keeps_the_recorded_pace(store_dir: Path) -> None:
    first = stored(store_dir, "SELECT epoch_us(min(ts)) / 1e6 FROM steps")
    last = stored(store_dir, "SELECT max(finish_time) FROM requests")
    speed = 4.0
    clock = FakeClock()
    log = FeedLog(clock)
    fed = replay(store_dir, "s", log, speed=speed, clock=clock, sleep=clock.sleep)
    assert fed == sum(rows for _, _, rows in log.writes)
    assert clock.sleeps and all(s > 0 for s in clock.sleeps)
    assert sum(clock.sleeps) == pytest.approx((last - first) / speed, rel=1e-6)
    times = [t for t, _, _ in log.writes]
    assert times == sorted(times)  # never fed ahead of the recorded order
    at_once = FakeClock()
    assert replay(store_dir, "s", FeedLog(at_once), speed=0, clock=at_once,
                  sleep=at_once.sleep) == fed  # fmt: skip
    assert at_once.sleeps == []


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
    assert len(problems) == 1
    assert "seg-00000000000000000000-1-deadbeef.parquet" in problems[0]["problem"]
    assert follower.poll() == 0
    problems = follower.health()["problems"]
    assert len(problems) == 1 and problems[0]["count"] == 2  # one line, counted per poll


# ---------------------------------------------------------------- follow vs repair / damage


class Count:
    """A sink that counts rows per table (what the counters of serve add up)."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}

    def write(self, table: str, batch) -> None:
        self.rows[table] = self.rows.get(table, 0) + batch.num_rows

    def close(self) -> None:
        pass


def written(root: Path, first: int, last: int) -> None:
    """Batches first..last-1 of run "a" (req_steps: 48 rows each), by a separate writer."""
    with Store(root) as store:
        for table, k, batch in src.source("a", last):
            if k >= first or table == "runs":
                store.write(table, batch)


def truncate_first_segment(root: Path) -> Path:
    seg = sorted((root / "req_steps" / "run_id=a").glob("seg-*.parquet"))[0]
    raw = seg.read_bytes()
    seg.write_bytes(raw[: len(raw) // 2])
    return seg


@pytest.mark.parametrize("compact", [False, True])
def test_follow_never_undercounts_after_repair_sets_a_counted_segment_aside(
    tmp_path: Path, compact: bool
) -> None:
    root = tmp_path / "store"
    written(root, 0, 3)
    follower = StoreFollower(root, Count())
    follower.poll()
    assert follower.sink.rows["req_steps"] == 144
    seg = truncate_first_segment(root)  # counted, then damaged, then set aside
    follower.poll()
    assert follower.sink.rows["req_steps"] == 144
    texts = [p["problem"] for p in follower.health()["problems"]]
    assert any(seg.name in t and "counted (48 rows), now damaged" in t for t in texts), texts
    assert repair(root, check_store(root))[0].note == "quarantined"
    written(root, 3, 6)  # 144 new rows
    if compact:  # and compacted before the next poll: new rows are still told apart
        with Store(root) as store:
            store.compact()
    follower.poll()
    assert follower.sink.rows["req_steps"] == 144 + 144, "every new row counted"
    assert follower.health()["rows"] == sum(follower.sink.rows.values())
    assert Store(root).query("SELECT count(*) FROM req_steps").column(0)[0].as_py() == 96 + 144
    texts = [p["problem"] for p in follower.health()["problems"]]
    assert any("removed or set aside; its rows stay counted" in t for t in texts), texts
    assert follower.poll() == 0


def test_follow_counts_each_row_once_across_compactions_and_new_segments(tmp_path: Path) -> None:
    root = tmp_path / "store"
    follower = StoreFollower(root, Count())
    for k in range(6):
        written(root, k, k + 1)
        if k % 2:
            with Store(root) as store:  # a compacted segment holding compacted segments
                store.compact()
        follower.poll()
        assert follower.sink.rows["req_steps"] == 48 * (k + 1)
    assert StoreFollower(root, Count()).poll() == follower.health()["rows"]


def test_healthz_problems_are_bounded_and_one_line_per_problem(tmp_path: Path) -> None:
    root = tmp_path / "store"
    written(root, 0, 1)
    part = root / "req_steps" / "run_id=a"
    for i in range(30):  # 30 distinct damaged files
        (part / f"seg-0000000000000000{i:04d}-1-deadbeef.parquet").write_bytes(b"x")
    clock = iter(range(1000, 2000))
    follower = StoreFollower(root, Count(), clock=lambda: float(next(clock)))
    for _ in range(10):
        follower.poll()
    health = follower.health()
    problems = health["problems"]
    assert len(problems) == MAX_PROBLEMS
    assert health["problems_not_listed"] == 10 * (30 - MAX_PROBLEMS)
    assert len({p["problem"] for p in problems}) == len(problems)
    assert all(p["count"] == 10 for p in problems)
    assert problems[0]["last_seen"] >= problems[-1]["last_seen"]  # most recent first
    # One problem repeated on every poll never pushes out another one.
    for path in part.glob("seg-0000000000000000*-1-deadbeef.parquet"):
        path.unlink()
    (part / "seg-00000000000000000000-1-deadbeef.parquet").write_bytes(b"y")
    other = tmp_path / "other"
    other.mkdir()
    os.symlink(other, root / "req_steps" / "run_id=evil")
    follower = StoreFollower(root, Count())
    for _ in range(50):
        follower.poll()
    problems = follower.health()["problems"]
    assert len(problems) == 2 and sorted(p["count"] for p in problems) == [50, 50]
