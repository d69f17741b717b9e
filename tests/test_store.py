"""Store behaviour: readers during a write, kill -9 at any point, idempotent ingest, read-only
queries, export, empty stores. Writers run as real subprocesses (tests/test_store_source.py)."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dspark_obs import schema
from dspark_obs.store import Ack, QueryRefused, Store, StoreError

sys.path.insert(0, str(Path(__file__).parent))
import test_store_source as src  # noqa: E402

WRITER = str(Path(__file__).parent / "test_store_source.py")
RUN = "run-a"


def spawn_writer(root: Path, run_id: str, n: int, *extra: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, WRITER, str(root), run_id, str(n), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == "READY\n", line + proc.stderr.read()
    return proc


@functools.cache
def source(run_id: str, n: int) -> tuple[tuple[str, int, pa.Table], ...]:
    return tuple(src.source(run_id, n))


def ingest(root: Path, run_id: str, n: int) -> Ack:
    ack = Ack()
    with Store(root) as store:
        for table, _, batch in source(run_id, n):
            ack += store.write(table, batch)
    return ack


def counts(store: Store) -> dict[str, tuple[int, int]]:
    """Per table: (rows, distinct keys)."""
    out = {}
    for table, keys in schema.KEYS.items():
        key = ", ".join(keys)
        row = store.query(f"SELECT count(*) AS n, count(DISTINCT ({key})) AS k FROM {table}")
        out[table] = (row.column("n")[0].as_py(), row.column("k")[0].as_py())
    return out


BATCH_ROWS = {
    "runs": 1,
    "steps": src.STEPS_PER_BATCH,
    "req_steps": src.STEPS_PER_BATCH * src.REQS_PER_STEP,
    "requests": src.REQS_PER_STEP,
    "req_step_amends": src.STEPS_PER_BATCH * src.REQS_PER_STEP,
}


def batch_counts(store: Store) -> dict[tuple[str, int], int]:
    """Rows stored per (table, source batch number), in one query."""
    per = src.STEPS_PER_BATCH
    rows = store.query(
        f"""
        SELECT 'runs' AS t, 0 AS k, count(*) AS n FROM runs HAVING count(*) > 0
        UNION ALL SELECT 'steps', forward_ct // {per}, count(*) FROM steps GROUP BY ALL
        UNION ALL SELECT 'req_steps', forward_ct // {per}, count(*) FROM req_steps GROUP BY ALL
        UNION ALL SELECT 'requests', CAST(split_part(rid, '-', 2) AS BIGINT), count(*)
                  FROM requests GROUP BY ALL
        UNION ALL SELECT 'req_step_amends', forward_ct // {per}, count(*) FROM req_step_amends
                  GROUP BY ALL
        """
    ).to_pylist()
    return {(r["t"], r["k"]): r["n"] for r in rows}


def assert_exact(store: Store, n_batches: int) -> None:
    got = counts(store)
    for table, n in src.expected_counts(n_batches).items():
        assert got[table] == (n, n), (table, got[table], n)


# --------------------------------------------------------------------------- readers


def test_reader_never_blocked_while_another_process_writes(tmp_path: Path) -> None:
    root = tmp_path / "store"
    n = 40
    proc = spawn_writer(root, RUN, n, "--sleep", "0.01")
    reader = Store(root)
    per_batch = src.STEPS_PER_BATCH * src.REQS_PER_STEP
    seen: list[int] = []
    refused_second_writer = False
    shell = None
    while True:
        done = proc.poll() is not None
        t = reader.query(
            "SELECT count(*) AS n, count(DISTINCT (dp_rank, forward_ct, rid)) AS k, "
            "coalesce(max(forward_ct), -1) AS top FROM req_steps"
        ).to_pylist()[0]
        # Whole segments only, no duplicates, and always a prefix of the source.
        assert t["n"] % per_batch == 0 and t["n"] == t["k"]
        assert t["top"] == t["n"] // src.REQS_PER_STEP - 1
        assert not seen or t["n"] >= seen[-1], "counts must never go down"
        seen.append(t["n"])
        if t["n"] and not refused_second_writer:
            with pytest.raises(StoreError, match="another writer"), Store(root) as other:
                other.write("req_steps", src.req_steps_batch(RUN, 0))
            refused_second_writer = True
        if t["n"] and shell is None:
            # A user's own duckdb shell: .read catalog.sql into a plain connection.
            shell = duckdb.connect()
            shell.execute((root / "catalog.sql").read_text())
        if shell is not None:
            m = shell.execute("SELECT count(*) FROM steps").fetchone()[0]
            assert m % src.STEPS_PER_BATCH == 0
        if done:
            break
    assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
    assert refused_second_writer
    assert len(set(seen)) > 3, f"the reader should have seen the store grow: {sorted(set(seen))}"
    assert_exact(reader, n)
    ro = duckdb.connect(str(root / "catalog.duckdb"), read_only=True)
    assert ro.execute("SELECT count(*) FROM req_steps").fetchone()[0] == n * per_batch
    ro.close()


# --------------------------------------------------------------------------- crashes


def _acked(out: str) -> set[tuple[str, int]]:
    acks = set()
    for line in out.splitlines():
        if line.startswith("ACK "):
            _, table, k = line.split()
            acks.add((table, int(k)))
    return acks


CRASH_POINTS = [
    "replace:3:before",
    "replace:6:after",
    "replace:15:before",
    "replace:18:after",
    "fsync:14:before",
    "fsync:27:after",
]


@pytest.fixture(scope="module")
def fork_writer() -> Iterator[Callable[[list[str], Path], int]]:
    """Start writers by forking a process that has imported everything once (fast)."""
    proc = subprocess.Popen(
        [sys.executable, WRITER, "--zygote"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline() == "ZYGOTE\n"

    def fork(argv: list[str], out: Path) -> int:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"argv": argv, "out": str(out)}) + "\n")
        proc.stdin.flush()
        return int(proc.stdout.readline().split()[1])

    yield fork
    proc.stdin.close()
    proc.wait(10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


@pytest.mark.parametrize("trial", range(14 + len(CRASH_POINTS)))
def test_kill_9_loses_nothing_acknowledged_and_restart_duplicates_nothing(
    tmp_path: Path, trial: int, fork_writer: Callable[[list[str], Path], int]
) -> None:
    root = tmp_path / "store"
    n = 30
    writes = len(source(RUN, n))
    rng = random.Random(trial)
    acks = tmp_path / "acks.txt"
    if trial < 14:  # SIGKILL from outside, after a random number of acks, mid-write
        pid = fork_writer([str(root), RUN, str(n)], acks)
        target = rng.randrange(writes)
        _wait(lambda: not _alive(pid) or acks.exists() and acks.read_text().count("ACK") >= target)
        time.sleep(rng.uniform(0.0, 0.01))
        os.kill(pid, signal.SIGKILL)
    else:  # the writer SIGKILLs itself at a chosen point inside a write
        pid = fork_writer([str(root), RUN, str(n), "--crash", CRASH_POINTS[trial - 14]], acks)
    _wait(lambda: not _alive(pid))
    out = acks.read_text()
    assert "DONE" not in out, "the writer should have been killed mid-ingest"
    acked = _acked(out)

    store = Store(root)
    got = counts(store)
    for table, (rows, keys) in got.items():
        assert rows == keys, f"{table}: duplicates after a crash"
    # Every acknowledged batch is there, whole; and whatever is there is whole batches.
    present = batch_counts(store)
    for table, k in acked:
        assert present.get((table, k)) == BATCH_ROWS[table], (table, k, present.get((table, k)))
    for (table, k), rows in present.items():
        assert rows == BATCH_ROWS[table], f"{table} batch {k} is partly stored ({rows} rows)"

    # Restart: re-ingest the whole source. Exact counts, nothing twice, no temp files left.
    ack = ingest(root, RUN, n)
    assert_exact(store, n)
    total = sum(src.expected_counts(n).values())
    assert ack.rows + ack.duplicates == total
    assert ack.duplicates == sum(r for r, _ in got.values())
    leftovers = [p for p in root.rglob("*.tmp")]
    assert not leftovers, leftovers


# --------------------------------------------------------------------------- idempotency


def test_reingest_is_idempotent_and_acks_say_what_was_written(tmp_path: Path) -> None:
    root = tmp_path / "store"
    first = ingest(root, RUN, 10)
    total = sum(src.expected_counts(10).values())
    assert (first.rows, first.duplicates) == (total, 0)
    again = ingest(root, RUN, 10)
    assert (again.rows, again.duplicates) == (0, total)
    assert not again.segments, "a write of nothing but duplicates must not add a segment"
    more = ingest(root, RUN, 12)  # a longer source: only the new tail is written
    assert more.rows == sum(src.expected_counts(12).values()) - total
    assert_exact(Store(root), 12)


def test_duplicates_inside_a_batch_and_overlapping_batches(tmp_path: Path) -> None:
    root = tmp_path / "store"
    a, b, c = (src.req_steps_batch(RUN, k) for k in (0, 1, 2))
    shuffled = pa.concat_tables([b, a, b.slice(5, 7), a.slice(0, 3)])  # unsorted, repeats
    with Store(root) as store:
        ack = store.write("req_steps", shuffled)
        assert (ack.rows, ack.duplicates) == (a.num_rows + b.num_rows, 10)
        # Overlaps stored steps (slow path) and adds new ones.
        ack = store.write("req_steps", pa.concat_tables([b.slice(10), c]))
        assert (ack.rows, ack.duplicates) == (c.num_rows, b.num_rows - 10)
        # Same steps on another DP rank are other facts.
        ack = store.write("req_steps", src.req_steps_batch(RUN, 0, dp_rank=1))
        assert ack.rows == a.num_rows
        steps = src.steps_batch(RUN, 0)
        assert store.write("steps", pa.concat_tables([steps, steps])).rows == steps.num_rows
        assert store.write("runs", pa.concat_tables([src.run_row(RUN)] * 2)).rows == 1
        assert store.write("runs", src.run_row(RUN)).rows == 0
        req = src.requests_batch(RUN, 0)
        assert store.write("requests", pa.concat_tables([req, req.slice(2)])).rows == req.num_rows
        assert store.write("requests", req).rows == 0
    n, k = counts(Store(root))["req_steps"]
    assert n == k == 4 * a.num_rows
    # What was stored is exactly the first occurrence of each key, values included.
    got = Store(root).query(
        "SELECT * FROM req_steps WHERE dp_rank = 0 ORDER BY forward_ct, rid"
    ).to_pylist()
    want = sorted(
        pa.concat_tables([a, b, c]).to_pylist(), key=lambda r: (r["forward_ct"], r["rid"])
    )
    assert [r["draft_tokens"] for r in got] == [r["draft_tokens"] for r in want]


def test_a_batch_with_several_runs_and_odd_run_ids(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ids = ["a/b", "50%", "__HIVE_DEFAULT_PARTITION__", "sp ace=[x]*?", "ünï", "123"]
    batch = pa.concat_tables([src.steps_batch(r, 0) for r in ids])
    with Store(root) as store:
        assert store.write("steps", batch).rows == batch.num_rows
        assert store.write("steps", batch).rows == 0
    got = Store(root).query("SELECT run_id, count(*) AS n FROM steps GROUP BY run_id")
    per_run = zip(got.column("run_id").to_pylist(), got.column("n").to_pylist(), strict=True)
    assert dict(per_run) == dict.fromkeys(ids, src.STEPS_PER_BATCH)
    one = Store(root).query("SELECT count(*) AS n FROM steps WHERE run_id = 'a/b'")
    assert one.column("n")[0].as_py() == src.STEPS_PER_BATCH


def test_buffered_mode_acknowledges_on_flush(tmp_path: Path) -> None:
    root = tmp_path / "store"
    batch = src.req_steps_batch(RUN, 0)  # 48 rows
    store = Store(root, flush_rows=100)
    assert store.write("req_steps", batch) == Ack()
    assert counts(Store(root))["req_steps"] == (0, 0), "buffered rows are not visible yet"
    ack = store.write("req_steps", src.req_steps_batch(RUN, 1))
    assert ack.rows == 0
    ack = store.write("req_steps", src.req_steps_batch(RUN, 2))  # 144 >= 100: flushed
    assert ack.rows == 3 * batch.num_rows and len(ack.segments) == 1
    store.write("req_steps", src.req_steps_batch(RUN, 3))
    assert store.flush().rows == batch.num_rows
    store.write("steps", src.steps_batch(RUN, 0))
    assert store.close().rows == src.STEPS_PER_BATCH
    assert counts(Store(root))["req_steps"] == (4 * batch.num_rows,) * 2
    with pytest.raises(StoreError, match="closed"):
        store.write("steps", src.steps_batch(RUN, 1))
    timed = Store(root, flush_seconds=0.0)
    assert timed.write("steps", src.steps_batch(RUN, 1)).rows == src.STEPS_PER_BATCH
    timed.close()


def test_second_writer_of_the_same_run_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    root = tmp_path / "store"
    first = Store(root)
    first.write("steps", src.steps_batch(RUN, 0))
    second = Store(root)
    with pytest.raises(StoreError, match=r"another writer \(pid \d+\).*'steps'.*'run-a'"):
        second.write("steps", src.steps_batch(RUN, 1))
    second.write("steps", src.steps_batch("run-b", 0))  # another run is fine
    second.write("req_steps", src.req_steps_batch(RUN, 0))  # and another table
    first.close()
    assert second.write("steps", src.steps_batch(RUN, 1)).rows == src.STEPS_PER_BATCH
    second.close()


def test_write_refuses_bad_input(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    with pytest.raises(StoreError, match="unknown table"):
        store.write("nope", src.steps_batch(RUN, 0))
    bad = src.steps_batch(RUN, 0).set_column(0, "run_id", pa.array([None] * 6, pa.string()))
    ack = store.write("steps", bad)  # Store.write validates: every row refused, by name
    assert ack.rows == 0 and len(ack.rejected) == 6
    assert str(ack.rejected[0]) == "steps[0].run_id=None: required field is missing"
    assert not (tmp_path / "store").exists(), "nothing written, nothing created"
    # A batch with the right columns but other types is cast to the schema.
    loose = src.steps_batch(RUN, 0).cast(
        pa.schema([f.with_type(pa.int64()) if f.name == "dp_rank" else f for f in schema.STEPS])
    )
    assert store.write("steps", loose).rows == src.STEPS_PER_BATCH


# --------------------------------------------------------------------------- queries


@pytest.mark.parametrize(
    ("sql", "kind"),
    [
        ("INSERT INTO steps VALUES (1)", "INSERT"),
        ("UPDATE runs SET mode = 'static'", "UPDATE"),
        ("DELETE FROM runs", "DELETE"),
        ("CREATE TABLE t AS SELECT 1", "CREATE"),
        ("DROP VIEW runs", "DROP"),
        ("COPY (SELECT 1) TO 'x.csv'", "COPY"),
        ("ATTACH 'x.duckdb' AS x", "ATTACH"),
        ("PRAGMA enable_profiling", "PRAGMA"),
        ("CALL checkpoint()", "CALL"),
        ("SET threads = 1", "SET"),
        ("EXPORT DATABASE 'dump'", "EXPORT"),
        ("ALTER VIEW runs RENAME TO r", "ALTER"),
        ("SELECT 1; DROP VIEW runs", "DROP"),
        ("EXPLAIN ANALYZE INSERT INTO steps VALUES (1)", "INSERT"),
    ],
)
def test_query_refuses_writes_naming_the_statement(tmp_path: Path, sql: str, kind: str) -> None:
    root = tmp_path / "store"
    ingest(root, RUN, 1)
    with pytest.raises(QueryRefused, match=rf"read-only: refused a {kind} statement"):
        Store(root).query(sql)
    assert counts(Store(root))["runs"] == (1, 1)


def test_query_allows_reads(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ingest(root, RUN, 2)
    store = Store(root)
    assert store.query("DESCRIBE req_steps").num_rows == len(schema.REQ_STEPS)
    assert "steps" in store.query("SHOW TABLES").column(0).to_pylist()
    assert store.query("PRAGMA table_info('runs')").num_rows == len(schema.RUNS)
    assert store.query("EXPLAIN SELECT * FROM steps").num_rows >= 1
    assert store.query("WITH x AS (FROM steps) SELECT count(*) FROM x").column(0)[0].as_py() == 12
    with pytest.raises(duckdb.Error):
        store.query("SELECT nope FROM steps")


def test_workload_summary_matches_a_direct_computation(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ingest(root, RUN, 4)
    rows = pa.concat_tables([src.req_steps_batch(RUN, k) for k in range(4)]).to_pandas()
    got = {r["workload"]: r for r in Store(root).query("FROM workload_summary").to_pylist()}
    assert set(got) == {"math", "chat", "poetry"}
    for wl, g in rows.groupby("workload"):
        s = got[wl]
        ceiling = g.acc_len + g.cap_trim
        assert s["run_id"] == RUN and s["mode"] == "cap-accept"
        assert s["req_steps"] == len(g) and s["steps"] == g.forward_ct.nunique()
        assert s["requests"] == g.rid.nunique()
        assert s["mean_verify_len"] == pytest.approx(g.verify_len.mean())
        assert s["mean_acc_len"] == pytest.approx(g.acc_len.mean())
        assert s["mean_ceiling"] == pytest.approx(ceiling.mean())
        assert s["committed_tokens"] == g.acc_len.sum()
        assert s["utilization"] == pytest.approx(g.acc_len.sum() / ceiling.sum())
        assert s["utilization"] < 1.0  # this source has trimmed acceptance


def test_empty_store_views_work_and_are_typed(tmp_path: Path) -> None:
    never = Store(tmp_path / "missing")
    for view in ("runs", "steps", "req_steps", "requests", "workload_summary"):
        assert never.query(f"SELECT * FROM {view}").num_rows == 0
    for table, sch in schema.TABLES.items():
        got = never.query(f"SELECT * FROM {table}").schema
        assert got.names == sch.names
        assert [f.type for f in got] == [f.type for f in sch], table
    assert not (tmp_path / "missing").exists(), "reading must not create the store"
    # Initialized, but only one table has rows: the others' views still work.
    root = tmp_path / "store"
    with Store(root) as store:
        store.write("runs", src.run_row(RUN))
    only_runs = Store(root)
    assert only_runs.query("SELECT count(*) FROM req_steps").column(0)[0].as_py() == 0
    assert only_runs.query("FROM workload_summary").num_rows == 0
    con = duckdb.connect()
    con.execute((root / "catalog.sql").read_text())
    assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 1
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 0


def test_long_lived_connection_sees_new_segments(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root)
    store.write("steps", src.steps_batch(RUN, 0))
    con = store.connect()
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 6
    store.write("steps", src.steps_batch(RUN, 1))
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 12
    store.close()


# --------------------------------------------------------------------------- export


def test_export_round_trips(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ingest(root, RUN, 5)
    ingest(root, "run-b", 2)
    store = Store(root)
    got = store.export(tmp_path / "out")
    want = {t: src.expected_counts(5)[t] + src.expected_counts(2)[t] for t in schema.TABLES}
    assert got == want
    for table, sch in schema.TABLES.items():
        back = pq.read_table(tmp_path / "out" / f"{table}.parquet")
        assert [f.type for f in back.schema] == [f.type for f in sch]
        # Export is in key order; compare with the source in the same order.
        batches = [
            src.merged_req_steps(r, k) if t == "req_steps" else b  # amendments merged on
            for r, n in ((RUN, 5), ("run-b", 2))
            for t, k, b in source(r, n)
            if t == table
        ]
        keys = [(k, "ascending") for k in schema.KEYS[table]]
        orig = pa.concat_tables(batches).sort_by(keys)
        assert back.cast(sch).equals(orig), table
    one = store.export(tmp_path / "one", run_id="run-b")
    assert one == src.expected_counts(2)
    assert set(pq.read_table(tmp_path / "one" / "steps.parquet").column("run_id").to_pylist()) == {
        "run-b"
    }


def test_info_reports_tables_segments_and_runs(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ingest(root, RUN, 5)
    info = Store(root).info()
    assert info["tables"]["req_steps"]["rows"] == src.expected_counts(5)["req_steps"]
    assert info["tables"]["req_steps"]["segments"] == 5
    assert info["tables"]["steps"]["bytes"] > 0
    (run,) = info["runs"]
    assert run["run_id"] == RUN and run["mode"] == "cap-accept"
    assert run["req_steps"] == src.expected_counts(5)["req_steps"]


def test_segments_are_parquet_with_the_table_schema(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ingest(root, RUN, 2)
    files = sorted((root / "req_steps").glob("run_id=run-a/seg-*.parquet"))
    assert len(files) == 2
    t = pq.read_table(files[0])
    assert t.schema.equals(schema.REQ_STEPS, check_metadata=False)
    want = src.req_steps_batch(RUN, 0).column("forward_ct").to_numpy()
    assert np.array_equal(t.column("forward_ct").to_numpy(), want)
    assert os.path.exists(root / "req_steps" / ".locks" / "run_id=run-a.lock")
    assert os.path.islink(root / "req_steps" / "run_id=run-a")


# --------------------------------------------------------------------------- compaction


def _table_snapshot(store: Store) -> dict[str, pa.Table]:
    return {
        t: store.query(f"SELECT * FROM {t} ORDER BY {', '.join(k)}")
        for t, k in schema.KEYS.items()
    }


def _generations(root: Path, table: str) -> list[str]:
    return sorted(os.listdir(root / table / ".gen"))


def test_compact_merges_segments_and_keeps_every_row(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ingest(root, RUN, 10)
    ingest(root, "run-b", 3)
    before = _table_snapshot(Store(root))
    with Store(root) as store:
        done = {(c.table, c.run_id): c for c in store.compact()}
        assert done[("req_steps", RUN)].segments_before == 10
        assert done[("req_steps", RUN)].rows == 10 * BATCH_ROWS["req_steps"]
        assert done[("runs", RUN)].segments_before == 1  # nothing to merge
        # Still the writer of these runs: re-ingest is deduplicated against the merged
        # segment (row-group statistics), and new batches land in the new generation.
        for table, _, batch in source(RUN, 12):
            store.write(table, batch)
    after = Store(root)
    assert after.info()["tables"]["req_steps"]["segments"] == 1 + 2 + 1  # run-a: 1+2, run-b: 1
    ref = tmp_path / "ref"  # the same facts ingested without any compaction
    ingest(ref, RUN, 12)
    ingest(ref, "run-b", 3)
    assert _table_snapshot(after) == _table_snapshot(Store(ref))
    assert before["req_steps"].num_rows == 13 * BATCH_ROWS["req_steps"]
    # Only the published generation of each run is left.
    assert len(_generations(root, "req_steps")) == 2  # run-a, run-b


def test_store_query_stays_consistent_while_the_writer_compacts(tmp_path: Path) -> None:
    root = tmp_path / "store"
    n = 30
    proc = spawn_writer(root, RUN, n, "--compact-every", "3")
    reader = Store(root)
    per_batch = BATCH_ROWS["req_steps"]
    last = 0
    while True:
        done = proc.poll() is not None
        t = reader.query(
            "SELECT count(*) AS n, count(DISTINCT (forward_ct, rid)) AS k FROM req_steps"
        ).to_pylist()[0]
        assert t["n"] % per_batch == 0 and t["n"] == t["k"] and t["n"] >= last
        last = t["n"]
        if done:
            break
    assert proc.wait(30) == 0
    assert_exact(reader, n)
    assert reader.info()["tables"]["req_steps"]["segments"] <= 3, "the writer compacted"


def test_compact_refuses_a_run_another_process_writes(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ingest(root, RUN, 3)
    writer = Store(root)
    writer.write("steps", src.steps_batch(RUN, 3))
    other = Store(root)
    results = {(c.table, c.run_id): c for c in other.compact()}
    assert "another writer" in (results[("steps", RUN)].skipped or "")
    assert results[("req_steps", RUN)].segments_before == 3
    with pytest.raises(StoreError, match="another writer"):
        other.compact("steps", RUN)
    writer.close()
    other.close()


COMPACT_CRASHES = [
    "replace:1:before",
    "replace:1:after",
    "replace:2:before",
    "replace:2:after",
    "replace:4:after",
    "fsync:2:after",
    "fsync:5:before",
]


@pytest.mark.parametrize("point", COMPACT_CRASHES)
def test_kill_9_during_compaction(
    tmp_path: Path, point: str, fork_writer: Callable[[list[str], Path], int]
) -> None:
    root = tmp_path / "store"
    ingest(root, RUN, 6)
    before = _table_snapshot(Store(root))
    acks = tmp_path / "acks.txt"
    pid = fork_writer([str(root), RUN, "0", "--compact-only", "--crash", point], acks)
    _wait(lambda: not _alive(pid))
    assert "DONE" not in acks.read_text(), "the compaction should have been killed"
    after = _table_snapshot(Store(root))
    for table in before:
        assert after[table].equals(before[table]), f"{table} changed by a crashed compaction"
    # Restart: compaction completes, nothing lost or doubled, and the leftovers go.
    with Store(root) as store:
        store.compact()
    assert _table_snapshot(Store(root)) == before
    for table in ("steps", "req_steps", "requests"):
        assert len(_generations(root, table)) == 1, _generations(root, table)
    assert not list(root.rglob("*.tmp"))
    assert_exact(Store(root), 6)
