"""Compaction: merge one run's segments of a table into one, crash-safe, readers unblocked.

The merged segment goes into a new generation directory, then the run's symlink is repointed
with one rename, so a listing shows the old segments or the merged one, never both, and a
crash at any point leaves one complete generation (the other is removed at the next writer
start). The merged footer keeps the producers' segment names and rows
(``segments.SOURCES_KEY``: ``serve --follow`` counts by them) and the step ranges
(``dedupe.RANGES_KEY``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow.parquet as pq

from dspark_obs import schema
from dspark_obs.store import dedupe, layout, segments
from dspark_obs.store.layout import StoreError
from dspark_obs.store.partition import UNREADABLE, Partition, Segment, conformed

__all__ = ["Compaction", "compact_partition"]


@dataclass(frozen=True)
class Compaction:
    """One run's table after :meth:`Store.compact`: segments before (now 1), rows kept."""

    table: str
    run_id: str
    segments_before: int
    rows: int
    skipped: str | None = None


def compact_partition(part: Partition) -> Compaction:
    """Merge a locked partition's segments into one new generation and swap it in."""
    before = len(part.segments)
    rows = sum(s.rows for s in part.segments)
    if before <= 1:
        return Compaction(part.table, part.run_id, before, rows)
    tdir, pname = part.path.parent, part.path.name
    gen = layout.new_generation_name(pname)
    gdir = tdir / layout.GEN_DIR / gen
    layout.ensure_dir(gdir)
    ranges = dedupe.merge_ranges([s.ranges for s in part.segments])
    meta = {dedupe.RANGES_KEY: json.dumps({str(k): v for k, v in ranges.items()}).encode()}
    dest = gdir / layout.new_segment_name()
    sources: list[tuple[str, int]] = []
    try:
        for seg in part.segments:
            sources += segments.sources(seg.path)
    except UNREADABLE as exc:  # footer gone since the partition was loaded
        part.set_aside(seg.path, exc)
        return compact_partition(part)
    kept = {segments.SOURCES_KEY: json.dumps(sources).encode()}
    meta = {**meta, **kept} if part.by_step else kept
    writer = layout.SegmentWriter(dest, schema.TABLES[part.table], meta)
    try:
        for seg in part.segments:
            try:
                data = pq.read_table(seg.path)
            except UNREADABLE as exc:  # footer fine, pages damaged
                writer.abort()
                part.set_aside(seg.path, exc)
                return compact_partition(part)
            writer.write(conformed(part.table, data))
    except BaseException:
        writer.abort()
        raise
    writer.commit()
    if writer.rows != rows:
        raise StoreError(f"compaction of {pname} wrote {writer.rows} rows, expected {rows}")
    layout.point_link(part.path, f"{layout.GEN_DIR}/{gen}")  # the one atomic step
    part.segments = [Segment(part.path / dest.name, rows, ranges)]
    layout.clean_generations(tdir, pname)
    return Compaction(part.table, part.run_id, before, rows)
