"""One file-acceptance rule for every read path (store/segments.py).

A foreign or damaged file dropped into a run's directory under a segment's name must be left
out by query, export, info, compaction, re-ingest and serve --follow alike, named by
store-check, and every answer must say what it left out. A valid 0-row file is just empty.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_obs import schema
from dspark_obs.sinks.serve import StoreFollower
from dspark_obs.store import Store, StoreError, StoreWarning
from dspark_obs.store.check import check_store, repair

sys.path.insert(0, str(Path(__file__).parent))
import test_store_source as src  # noqa: E402

GOOD = 144  # req_steps rows of run "a" with 3 batches
FOREIGN = "seg-00000000000000000001-1-0000000a.parquet"  # sorts first: a segment's name


class Memory:
    def __init__(self) -> None:
        self.rows: dict[str, int] = {}

    def write(self, table: str, batch: pa.Table) -> None:
        self.rows[table] = self.rows.get(table, 0) + batch.num_rows

    def close(self) -> None:
        pass


def build(root: Path, batches: int = 3) -> Path:
    with Store(root) as store:
        for table, _, batch in src.source("a", batches):
            store.write(table, batch)
    return root / "req_steps" / "run_id=a"


def good_rows(part: Path) -> pa.Table:
    return pq.read_table(sorted(part.glob("seg-*.parquet"))[-1])


def plant(kind: str, part: Path, outside: Path, name: str = FOREIGN) -> int | None:
    """Put one bad file of ``kind`` into a run's directory; returns the rows it declares."""
    data = good_rows(part)
    dest = part / name
    if kind == "no rid":
        pq.write_table(data.drop(["rid"]), dest)
        return data.num_rows
    if kind == "rid as int":
        pq.write_table(
            data.set_column(data.column_names.index("rid"), "rid", pa.array(range(data.num_rows))),
            dest,
        )
        return data.num_rows
    if kind == "truncated":
        raw = (sorted(part.glob("seg-*.parquet"))[-1]).read_bytes()
        dest.write_bytes(raw[: len(raw) * 2 // 3])
        return None
    if kind == "symlink out":
        target = outside / f"outside-{name}"
        pq.write_table(
            data.drop(["forward_ct"]).append_column(
                "forward_ct", pa.array(range(10_000, 10_000 + data.num_rows), pa.int64())
            ),
            target,
        )
        os.symlink(target, dest)
        return None
    if kind == "symlink in":  # a second copy of an accepted segment: duplicates
        os.symlink(sorted(part.glob("seg-*.parquet"))[-1], dest)
        return None
    raise AssertionError(kind)


KINDS = ("no rid", "rid as int", "truncated", "symlink out", "symlink in")


def quiet(fn: Callable[[], object]) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", StoreWarning)
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, StoreWarning)]


@pytest.mark.parametrize("kind", KINDS)
def test_every_read_path_leaves_the_bad_file_out_and_says_so(tmp_path: Path, kind: str) -> None:
    root, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    part = build(root)
    declared = plant(kind, part, outside)
    store = Store(root)

    result, notes = quiet(
        lambda: store.query("SELECT count(*) AS n, count(rid) AS k FROM req_steps")
    )
    assert result.to_pylist() == [{"n": GOOD, "k": GOOD}]  # type: ignore[union-attr]
    assert len(notes) == 1 and FOREIGN in notes[0] and "left out 1" in notes[0]
    size = f"({declared:,} rows)" if declared is not None else "(1 file(s) of unknown size)"
    assert size in notes[0]
    skipped = json.loads(result.schema.metadata[b"dspark_obs.skipped"])  # type: ignore[union-attr]
    assert [(Path(s["path"]).name, s["rows"]) for s in skipped] == [(FOREIGN, declared)]

    counts, notes = quiet(lambda: store.export(tmp_path / "exp"))
    assert counts["req_steps"] == GOOD and len(notes) == 1  # type: ignore[index]
    exported = pq.read_table(tmp_path / "exp" / "req_steps.parquet")
    assert exported.column("rid").null_count == 0
    assert [Path(s.path).name for s in store.skipped] == [FOREIGN]

    info, notes = quiet(store.info)
    assert info["tables"]["req_steps"]["rows"] == GOOD  # type: ignore[index]
    assert info["tables"]["req_steps"]["segments"] == 3  # type: ignore[index]
    assert info["tables"]["req_steps"]["skipped_files"] == 1  # type: ignore[index]
    assert len(info["skipped"]) == 1 and len(notes) == 1  # type: ignore[index]

    follower = StoreFollower(root, Memory())
    follower.poll()
    assert follower.sink.rows["req_steps"] == GOOD  # type: ignore[attr-defined]
    assert any(FOREIGN in p["problem"] for p in follower.health()["problems"])

    findings = check_store(root)
    assert [f.path.name for f in findings] == [FOREIGN], findings

    # Compaction and re-ingest set it aside (the writer holds the lock), never merge it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)
        with Store(root) as writer:
            for table, _, batch in src.source("a", 4):  # batches 0..2 again, then 3 new
                writer.write(table, batch)
            writer.compact()
    after = (
        Store(root)
        .query(
            "SELECT count(*) AS n, count(DISTINCT (dp_rank, forward_ct, rid))"
            " AS k, max(forward_ct) AS top FROM req_steps"
        )
        .to_pylist()[0]
    )
    assert after == {"n": GOOD + 48, "k": GOOD + 48, "top": 23}
    assert check_store(root) == []
    if kind == "symlink out":
        assert (outside / f"outside-{FOREIGN}").is_file(), "what a link leads to is never moved"


def test_a_valid_empty_file_is_simply_empty(tmp_path: Path) -> None:
    """0 rows, no footer metadata: not a finding, and compaction / re-ingest work."""
    root = tmp_path / "store"
    part = build(root)
    for table in schema.TABLES:  # every table, written by a plain pyarrow user
        tpart = root / table / "run_id=a"
        if tpart.exists():
            pq.write_table(schema.TABLES[table].empty_table(), tpart / FOREIGN)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreWarning)  # nothing to warn about
        assert check_store(root) == []
        assert Store(root).query("SELECT count(*) FROM req_steps").column(0)[0].as_py() == GOOD
        with Store(root) as writer:
            for table, _, batch in src.source("a", 4):
                writer.write(table, batch)
            done = writer.compact()
    assert {c.table: c.rows for c in done if c.run_id == "a"}["req_steps"] == GOOD + 48
    assert len(list(part.glob("seg-*.parquet"))) == 1


def test_a_run_directory_leading_outside_the_store(tmp_path: Path) -> None:
    root, outside = tmp_path / "store", tmp_path / "elsewhere"
    build(root)
    link = root / "req_steps" / "run_id=b"
    shutil.copytree(root / "req_steps" / "run_id=a", outside)  # run a's files, elsewhere
    os.symlink(outside, link)
    result, notes = quiet(lambda: Store(root).query("SELECT count(*) FROM req_steps"))
    assert result.column(0)[0].as_py() == GOOD  # type: ignore[union-attr]
    assert notes and "outside the store" in notes[0]
    findings = check_store(root)
    assert [(f.path, f.kind) for f in findings] == [(link, "foreign")]
    with pytest.raises(StoreError, match="leads outside the store"), Store(root) as writer:
        writer.write("req_steps", src.req_steps_batch("b", 0))
    repair(root, findings)
    assert not link.exists() and (root / "req_steps" / "run_id=a").is_symlink()
    assert check_store(root) == []


def test_the_catalog_files_never_add_rows_without_keys(tmp_path: Path) -> None:
    """A duckdb shell over catalog.sql / catalog.duckdb cannot be warned; it still never
    counts a foreign file's rows that lack a key column, and a damaged file fails loudly."""
    root = tmp_path / "store"
    part = build(root)
    plant("no rid", part, tmp_path)
    con = duckdb.connect()
    con.execute((root / "catalog.sql").read_text())
    assert con.execute("SELECT count(*) FROM req_steps").fetchone() == (GOOD,)
    ro = duckdb.connect(str(root / "catalog.duckdb"), read_only=True)
    assert ro.execute("SELECT count(*) FROM req_steps").fetchone() == (GOOD,)
    (part / FOREIGN).unlink()
    plant("truncated", part, tmp_path)
    with pytest.raises(duckdb.Error):
        con.execute("SELECT count(*) FROM req_steps").fetchone()


@pytest.fixture(scope="module")
def built_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One :func:`build` for every example below: (the root it was built at, a pristine copy).
    The catalog names segments by absolute path, so each example's copy goes back to that root."""
    base = tmp_path_factory.mktemp("mixbase")
    root, pristine = base / "store", base / "pristine"
    build(root)
    shutil.copytree(root, pristine, symlinks=True)
    return root, pristine


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3, unique=True),
    table=st.sampled_from(["steps", "req_steps"]),
)
def test_any_mix_of_bad_files_in_any_table(
    tmp_path_factory: pytest.TempPathFactory,
    built_store: tuple[Path, Path],
    kinds: list[str],
    table: str,
) -> None:
    """Several bad files at once, in either keyed table: every reader agrees on the count."""
    tmp = tmp_path_factory.mktemp("mix")
    outside = tmp / "outside"
    outside.mkdir()
    root, pristine = built_store
    shutil.rmtree(root)  # the store as build() left it: this example's bad files only
    shutil.copytree(pristine, root, symlinks=True)
    part = root / table / "run_id=a"
    expect = Store(root).query(f"SELECT count(*) FROM {table}").column(0)[0].as_py()
    for i, kind in enumerate(kinds):
        name = f"seg-0000000000000000000{i + 1}-1-0000000{i}.parquet"
        if table == "steps" and kind in ("no rid", "rid as int"):  # steps has no rid
            pq.write_table(good_rows(part).drop(["forward_ct"]), part / name)
        else:
            plant(kind, part, outside, name)
    store = Store(root)
    got, notes = quiet(lambda: store.query(f"SELECT count(*) FROM {table}"))
    assert got.column(0)[0].as_py() == expect  # type: ignore[union-attr]
    assert f"left out {len(kinds)} " in notes[0]
    counts, _ = quiet(lambda: store.export(tmp / "exp"))
    assert counts[table] == expect  # type: ignore[index]
    info, _ = quiet(store.info)
    assert info["tables"][table]["rows"] == expect  # type: ignore[index]
    assert len(check_store(root)) == len(kinds)
    follower = StoreFollower(root, Memory())
    follower.poll()
    assert follower.sink.rows[table] == expect  # type: ignore[attr-defined]
