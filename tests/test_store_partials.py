"""The store's per-segment API (``Store.segments``, ``Store.query_segment``) and the dashboard
rollups built on it: damaged and foreign files are left out and named, as every other read
path does; a path that is not an accepted segment of the store is refused."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from test_store_robust import build, damage  # noqa: E402

from dashboards.streamlit import rollups  # noqa: E402
from dspark_obs.store import Store, StoreError, StoreWarning  # noqa: E402


def _rows(store: Store) -> int:
    return store.query("SELECT count(*) AS n FROM req_steps").to_pylist()[0]["n"]


def test_rollups_leave_out_and_name_damaged_and_foreign_segments(tmp_path: Path) -> None:
    root = tmp_path / "store"
    build(root)
    good = Store(root)
    clean = rollups.partials(good, "req_steps")
    assert int(clean["n"].sum()) == _rows(good) and not clean.attrs.get("skipped")
    bad = damage(root)
    # a segment without the key column rid: its rows must not join the totals either
    seg = sorted((root / "req_steps" / "run_id=b").glob("seg-*.parquet"))[0]
    no_rid = seg.with_name("seg-00000000000000000009-1-0000000f.parquet")
    pq.write_table(pq.read_table(seg).drop_columns(["rid"]), no_rid)
    outside = tmp_path / "outside.parquet"
    shutil.copy(seg, outside)
    link = seg.with_name("seg-00000000000000000008-1-0000000e.parquet")
    link.symlink_to(outside)
    store = Store(root)
    with pytest.warns(StoreWarning, match="left out") as caught:
        got = rollups.partials(store, "req_steps")
    named = {Path(s.path).name for s in got.attrs["skipped"]}
    for kind in ("truncated", "zero-byte", "wrong schema"):
        assert bad[kind].name in named, kind
    assert {no_rid.name, link.name} <= named
    assert str(bad["truncated"]) in str(caught[0].message)
    with pytest.warns(StoreWarning):
        assert int(got["n"].sum()) == _rows(store) == int(clean["n"].sum())
    with pytest.warns(StoreWarning):  # again from the cache: still named
        again = rollups.partials(store, "req_steps")
    assert {Path(s.path).name for s in again.attrs["skipped"]} == named


def test_query_segment_reads_only_accepted_segments_of_the_store(tmp_path: Path) -> None:
    root = tmp_path / "store"
    build(root)
    store = Store(root)
    seg = next(f for f in store.segments("req_steps").files if "run_id=a" in f)
    part = store.query_segment(
        "req_steps", seg, "SELECT run_id, count(*) AS n FROM {segment} GROUP BY 1"
    )
    assert part is not None and part.to_pylist()[0]["run_id"] == "a"
    assert part.to_pylist()[0]["n"] == pq.read_metadata(seg).num_rows
    outside = tmp_path / "seg-00000000000000000001-1-00000001.parquet"
    pq.write_table(pa.table({"run_id": ["x"]}), outside)
    with pytest.raises(StoreError, match="not a segment of table"):
        store.query_segment("req_steps", str(outside), "SELECT * FROM {segment}")
    with pytest.raises(StoreError, match="not a segment of table"):
        store.query_segment("steps", seg, "SELECT * FROM {segment}")  # another table's file
    bad = damage(root)
    with pytest.raises(StoreError, match="left out"):
        store.query_segment("req_steps", str(bad["truncated"]), "SELECT * FROM {segment}")
    with pytest.raises(StoreError, match="unknown table"):
        store.segments("nope")
    with Store(root) as writer:
        writer.compact()
    assert store.query_segment("req_steps", seg, "SELECT * FROM {segment}") is None  # retired
