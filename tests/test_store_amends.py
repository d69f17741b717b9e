"""Late estimator lines become amendments of stored request-steps (table req_step_amends):
written through the store's writer, merged by the req_steps view, the catalog files, export,
info and compaction; a collector on SGLang-built payloads (tests/sglang_wheel.py) ends up with
the same req_steps whether a line came on time or late, and a crash between storing an
amendment and forgetting its line duplicates nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sglang_wheel import SimHTTP, SimServer

from dspark_obs import schema
from dspark_obs.sglang.collector import Collector, CollectorOptions
from dspark_obs.sglang.estimator_merge import EstimatorMerge
from dspark_obs.store import Store

sys.path.insert(0, str(Path(__file__).parent))
import test_store_source as src  # noqa: E402

RUN = "run-am"
ESTIMATOR = ", ".join(schema.AMENDED_FIELDS)


def _write_source(root: Path, n: int) -> None:
    with Store(root) as store:
        for table, _, batch in src.source(RUN, n):
            store.write(table, batch)


def _merged(n: int) -> list[dict]:
    """The req_steps rows the view must show: every amendment merged onto its row."""
    rows = [r for k in range(n) for r in src.merged_req_steps(RUN, k).to_pylist()]
    return sorted(rows, key=lambda r: (r["forward_ct"], r["rid"]))


def _view(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r["forward_ct"], r["rid"]))


def _fetch(con: duckdb.DuckDBPyConnection, names: tuple[str, ...]) -> list[dict]:
    rows = con.execute(f"SELECT {', '.join(names)} FROM req_steps").fetchall()
    return [dict(zip(names, r, strict=True)) for r in rows]


def test_req_steps_view_merges_amendments_everywhere(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _write_source(root, 4)
    want = _merged(4)
    assert any(r["trimmed_tokens"] is not None for r in want)
    store = Store(root)
    assert _view(store.query("SELECT * FROM req_steps").to_pylist()) == want
    # a user's duckdb shell: catalog.sql and catalog.duckdb show the same merge
    shell = duckdb.connect()
    shell.execute((root / "catalog.sql").read_text())
    names = ("forward_ct", "rid", *schema.AMENDED_FIELDS)
    part = [{k: r[k] for k in names} for r in want]
    assert _view(_fetch(shell, names)) == part
    assert (
        _view(_fetch(duckdb.connect(str(root / "catalog.duckdb"), read_only=True), names)) == part
    )
    # export: req_steps with the amendments merged, and the amendments themselves
    counts = store.export(tmp_path / "out")
    assert counts["req_step_amends"] == src.expected_counts(4)["req_step_amends"]
    back = pq.read_table(tmp_path / "out" / "req_steps.parquet").to_pylist()
    assert _view(back) == want
    # info counts them per run; compaction keeps the merge
    info = store.info()
    assert info["tables"]["req_step_amends"]["rows"] == counts["req_step_amends"]
    assert info["runs"][0]["amended"] == counts["req_step_amends"]
    with Store(root) as writer:
        done = {(c.table, c.segments_before) for c in writer.compact()}
    assert ("req_step_amends", 2) in done and ("req_steps", 4) in done
    assert _view(Store(root).query("SELECT * FROM req_steps").to_pylist()) == want


def test_a_second_amendment_of_a_key_is_a_duplicate_and_a_row_keeps_its_own_fields(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    _write_source(root, 2)
    first = src.amends_batch(RUN, 1)
    other = first.set_column(
        first.schema.get_field_index("q_lp"),
        first.schema.field("q_lp"),
        pa.array(
            [[-9.0] * len(v) for v in first.column("q_lp").to_pylist()],
            first.schema.field("q_lp").type,
        ),
    )
    with Store(root) as store:
        ack = store.write("req_step_amends", other)
    assert (ack.rows, ack.duplicates) == (0, other.num_rows)  # the first amendment stands
    # an amendment of a row stored with its own estimator fields does not change it
    with_fields = src.merged_req_steps(RUN, 1).to_pylist()[:1]
    with_fields[0].update(run_id="run-own")
    own = [dict(a, run_id="run-own", q_lp=[-7.0] * len(a["q_lp"])) for a in first.to_pylist()[:1]]
    with Store(root) as store:
        store.write("req_steps", src._valid("req_steps", with_fields))
        assert store.write("req_step_amends", src._valid("req_step_amends", own)).rows == 1
    got = Store(root).query("SELECT q_lp FROM req_steps WHERE run_id = 'run-own'").to_pylist()
    assert got == [{"q_lp": pytest.approx(with_fields[0]["q_lp"])}]
    assert Store(root).query("SELECT count(*) AS n FROM req_steps").to_pylist()[0]["n"] == (
        src.expected_counts(2)["req_steps"] + 1
    )


def test_an_amendment_breaking_the_estimator_rules_is_refused(tmp_path: Path) -> None:
    row = src.amends_batch(RUN, 1).to_pylist()[0]
    bad = [
        dict(row, trimmed_tokens=row["trimmed_tokens"] + [1], q_lp=row["q_lp"] + [-0.1]),
        dict(row, q_lp=[0.5] * len(row["q_lp"])),
        dict(row, q_lp=[None] * len(row["q_lp"])),  # a missing log-prob is not one
        dict(row, trimmed_tokens=None, q_lp=None, pg=None),
        dict(row, verify_len=0),
    ]
    with Store(tmp_path / "store") as store:
        ack = store.write(
            "req_step_amends", pa.Table.from_pylist(bad, schema=schema.REQ_STEP_AMENDS)
        )
    assert ack.rows == 0 and len(ack.rejected) == 5
    assert ack.rejected[2].row == 2 and "log-probability" in ack.rejected[2].reason
    reasons = " | ".join(e.reason for e in ack.rejected)
    assert "gamma+1-verify_len" in reasons and "log-probability" in reasons
    assert "needs trimmed_tokens, q_lp or pg" in reasons and "verify_len must be" in reasons


# ------------------------------------------------------------------ the collector


def _collect(wheel, tmp: Path, run: str, *, late: bool, dp: int) -> tuple[Store, Collector]:
    """Collect one simulated server; ``late``: every row is stored at once (hold_s 0) and
    the recorder flushes only after the poll, so every line comes after its row."""
    est = tmp / f"{run}.jsonl"
    sim = SimServer(wheel, dp=dp, seed=21, estimator_path=est)
    srv = SimHTTP(sim)
    store = Store(tmp / "store")
    opts = CollectorOptions(
        srv.url,
        run,
        state_dir=tmp / "state",
        timeout_s=5.0,
        estimator_path=est,
        hold_s=0.0 if late else 60.0,
    )
    col = Collector([opts], [store], interval_s=0.01)
    try:
        for _ in range(4):
            srv.step(6)
            if not late:
                sim.flush_estimator()
            col.poll_once()
            if late:
                sim.flush_estimator()
        col.poll_once()
        col.finish()
    finally:
        srv.close()
    return store, col


def _estimator_rows(store: Store, run: str) -> list[dict]:
    sql = (
        f"SELECT dp_rank, forward_ct, rid, verify_len, {ESTIMATOR} FROM req_steps "
        f"WHERE run_id = '{run}' ORDER BY ALL"
    )
    return store.query(sql).to_pylist()


@pytest.mark.parametrize("dp", [1, 4])
def test_late_lines_end_up_field_equal_to_on_time_lines(sglang_wheel, tmp_path, dp) -> None:
    on_store, on_col = _collect(sglang_wheel, tmp_path / "on", "x", late=False, dp=dp)
    late_store, late_col = _collect(sglang_wheel, tmp_path / "late", "x", late=True, dp=dp)
    on = _estimator_rows(on_store, "x")
    assert on_col.servers[0].totals.late_lines == 0
    assert late_col.servers[0].totals.late_lines > 0
    amended = late_store.query("SELECT count(*) AS n FROM req_step_amends").to_pylist()[0]["n"]
    assert amended == late_col.servers[0].totals.late_lines
    assert sum(r["trimmed_tokens"] is not None for r in on) > 0
    assert _estimator_rows(late_store, "x") == on
    assert not any(p.name.endswith(".estimator-late.jsonl") for p in tmp_path.rglob("*"))


def test_collector_killed_between_amending_and_forgetting_duplicates_nothing(
    sglang_wheel, tmp_path, monkeypatch
) -> None:
    est = tmp_path / "est.jsonl"
    sim = SimServer(sglang_wheel, dp=1, seed=33, estimator_path=est)
    srv = SimHTTP(sim)
    store = Store(tmp_path / "store")

    def collector() -> Collector:
        opts = CollectorOptions(
            srv.url,
            "k",
            state_dir=tmp_path / "state",
            timeout_s=5.0,
            estimator_path=est,
            hold_s=0.0,
        )
        return Collector([opts], [store], interval_s=0.01)

    class Killed(BaseException):
        pass

    def die(self: EstimatorMerge, keys: list) -> None:
        raise Killed  # the amendments are durable; the lines are not forgotten yet

    try:
        first = collector()
        srv.step(8)
        first.poll_once()  # rows stored without lines
        sim.flush_estimator()
        monkeypatch.setattr(EstimatorMerge, "settle", die)
        with pytest.raises(Killed):
            first.poll_once()
        monkeypatch.undo()
        stored = store.query("SELECT count(*) AS n FROM req_step_amends").to_pylist()[0]["n"]
        assert stored > 0
        second = collector()  # same state directory: it amends the same lines again
        second.poll_once()
        second.finish()
    finally:
        srv.close()
    lines = [json.loads(x) for x in est.read_text().splitlines()]
    with_lines = sum("trimmed_tokens" in x for x in lines)
    got = store.query(
        "SELECT count(*) AS n, count(DISTINCT (dp_rank, forward_ct, rid)) AS k FROM req_step_amends"
    ).to_pylist()[0]
    assert got["n"] == got["k"] >= stored
    merged = store.query("SELECT count(trimmed_tokens) AS t, count(*) AS n FROM req_steps")
    assert merged.to_pylist()[0]["t"] == with_lines
    assert merged.to_pylist()[0]["n"] == srv.verify_calls
