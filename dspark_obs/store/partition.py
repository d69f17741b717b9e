"""One (table, run) held for writing: its lock, what it stores, and appending to it.

Writers: one per (table, run), enforced with ``flock`` on the partition's lock file (the
kernel drops it when a writer dies, even by kill -9). The writer holding the lock knows every
key stored for its partition (``store/dedupe.py``), so it drops rows already stored (restart,
re-ingest) or repeated inside a batch: a key (``schema.KEYS``) is ingested at most once. A
segment the acceptance rule refuses (``store/segments.py``) is moved to the quarantine folder
when the partition is loaded: the lock holder is the only one who moves files of the run.
"""

from __future__ import annotations

import fcntl
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dspark_obs import schema, validation
from dspark_obs.store import dedupe, layout, segments
from dspark_obs.store.layout import StoreError, StoreWarning
from dspark_obs.validation import RecordError

__all__ = ["Ack", "Partition", "Segment", "conformed", "open_partition"]


@dataclass(frozen=True)
class Ack:
    """What a write or flush made durable: rows written, rows dropped as already stored,
    and the rows :meth:`Store.write` refused as invalid (one RecordError each)."""

    rows: int = 0
    duplicates: int = 0
    segments: tuple[str, ...] = ()
    rejected: tuple[RecordError, ...] = ()

    def __add__(self, other: Ack) -> Ack:
        return Ack(
            self.rows + other.rows,
            self.duplicates + other.duplicates,
            self.segments + other.segments,
            self.rejected + other.rejected,
        )


@dataclass
class Segment:
    """One stored segment as the writer knows it: where, how many rows, which steps."""

    path: Path
    rows: int
    ranges: dict[int, tuple[int, int]]  # per dp_rank, for tables keyed by forward_ct


@dataclass
class Partition:
    """Writer-side state of one (table, run): its lock and what it already stores."""

    root: Path
    table: str
    run_id: str
    path: Path  # the run's symlink; segments are addressed through it
    lock_fd: int
    key_cols: tuple[str, ...]
    segments: list[Segment] = field(default_factory=list)
    keys: pa.Table | None = None  # stored keys, kept in memory for the small tables only

    @property
    def by_step(self) -> bool:
        return "forward_ct" in self.key_cols

    def append(self, batch: pa.Table) -> Ack:
        """Write the batch's new rows as one segment, durable when this returns."""
        n_in = batch.num_rows
        batch = dedupe.dedupe_in_batch(batch, self.key_cols)
        batch = self.drop_stored(batch)
        if batch.num_rows == 0:
            return Ack(0, n_in, ())
        ranges = dedupe.step_ranges(batch) if self.by_step else {}
        dest = self.path / layout.new_segment_name()
        meta = {dedupe.RANGES_KEY: json.dumps({str(k): v for k, v in ranges.items()}).encode()}
        layout.write_parquet_atomic(batch, dest, meta if self.by_step else None)
        # Durable from here on: record it so later batches are checked against it.
        self.segments.append(Segment(dest, batch.num_rows, ranges))
        if not self.by_step:
            new_keys = batch.select(list(self.key_cols))
            self.keys = new_keys if self.keys is None else pa.concat_tables([self.keys, new_keys])
        return Ack(batch.num_rows, n_in - batch.num_rows, (str(dest),))

    def drop_stored(self, batch: pa.Table) -> pa.Table:
        """The rows of a (de-duplicated) batch whose key this partition does not store."""
        if not self.segments:
            return batch
        if not self.key_cols:  # runs: one row per run, and it is stored already
            return batch.slice(0, 0)
        if self.by_step:
            ranges = dedupe.step_ranges(batch)
            overlap = [
                s
                for s in self.segments
                if any(
                    d in s.ranges and s.ranges[d][0] <= hi and lo <= s.ranges[d][1]
                    for d, (lo, hi) in ranges.items()
                )
            ]
            if not overlap:  # fast path: every step is newer (or on another rank)
                return batch
            try:
                stored = dedupe.read_keys([s.path for s in overlap], ranges, self.key_cols)
            except UNREADABLE as exc:  # footer fine, pages damaged: set it aside, re-check
                bad = first_unreadable(self.table, [s.path for s in overlap])
                if bad is None:
                    raise StoreError(f"cannot read the stored keys of {self.path}: {exc}") from exc
                self.set_aside(bad, exc)
                return self.drop_stored(batch)
            if stored.num_rows == 0:
                return batch
        else:
            stored = self.keys
            if stored is None or stored.num_rows == 0:
                return batch
        return dedupe.anti_join(batch, stored, self.key_cols)

    def set_aside(self, path: Path, exc: BaseException) -> None:
        """Quarantine a segment whose data cannot be read, then reload the partition."""
        _set_aside_unreadable(self.root, path, exc, stacklevel=5)
        self.segments, self.keys = [], None
        load_partition(self)

    def close(self) -> None:
        """Release the lock (closing the descriptor drops the flock)."""
        os.close(self.lock_fd)


def open_partition(root: Path, table: str, run_id: str) -> Partition:
    """Lock a (table, run) for writing and load what it stores; create it if new. A second
    writer of the same partition (any process) gets a StoreError."""
    link = layout.partition_dir(root, table, run_id)
    tdir = link.parent
    layout.ensure_dir(tdir / layout.LOCK_DIR)
    layout.ensure_dir(tdir / layout.GEN_DIR)
    fd = os.open(layout.lock_path(root, table, run_id), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StoreError(
            f"another writer (pid {holder}) is writing table {table!r} of run {run_id!r}; "
            "a run's table takes one writer at a time"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        if link.is_symlink() and not link.exists():  # its generation is gone
            warnings.warn(
                f"{link} pointed to a missing generation; starting the run's table afresh",
                StoreWarning,
                stacklevel=4,
            )
        if not link.exists():
            gen = layout.new_generation_name(link.name)
            layout.ensure_dir(tdir / layout.GEN_DIR / gen)
            layout.point_link(link, f"{layout.GEN_DIR}/{gen}")
        elif link.is_symlink() and not leads_into(link, tdir / layout.GEN_DIR):
            raise StoreError(
                f"{link} leads outside the store ({os.readlink(link)}); "
                "`dspark-obs store-check --repair` sets the link aside"
            )
        elif not link.is_symlink():
            raise StoreError(
                f"{link} is a plain directory where a symlink to a generation belongs "
                "(copied in?); `dspark-obs store-check --repair` adopts it"
            )
        layout.clean_generations(tdir, link.name)
        layout.remove_stale_tmp(link)
        key_cols = tuple(k for k in schema.KEYS[table] if k != "run_id")
        part = Partition(root, table, run_id, link, fd, key_cols)
        load_partition(part)
    except BaseException:
        os.close(fd)
        raise
    return part


def load_partition(part: Partition) -> None:
    """Read what a partition stores: segment footers (step ranges) or key columns.

    A segment the acceptance rule refuses (``store/segments.py``) is moved to the quarantine
    folder and named in a StoreWarning: the writer holds the partition's lock, so nobody else
    moves it.
    """
    for path in layout.segment_files(part.path):
        reason = segments.problem(part.root, path, part.table)
        if reason is not None:
            dest = layout.quarantine(part.root, path, reason)
            warnings.warn(
                f"{path}: {reason}; moved to {dest} (its rows, if any, are not in the store)",
                StoreWarning,
                stacklevel=5,
            )
            continue
        md = pq.read_metadata(path)
        ranges: dict[int, tuple[int, int]] = {}
        if part.by_step:
            try:
                raw = json.loads((md.metadata or {})[dedupe.RANGES_KEY])
                ranges = {int(k): (int(v[0]), int(v[1])) for k, v in raw.items()}
            except (KeyError, ValueError, TypeError, IndexError):  # absent or garbled
                ranges = dedupe.step_ranges(pq.read_table(path, columns=["dp_rank", "forward_ct"]))
        part.segments.append(Segment(path, md.num_rows, ranges))
    if not part.by_step and part.key_cols and part.segments:
        # Whole segments (these tables are small): a row counts as stored only when its stored
        # copy reads back, or a damaged non-key page would cost the replayed row (dedupe.py).
        keys, readable = [], []
        for seg in part.segments:
            try:
                keys.append(pq.read_table(seg.path).select(list(part.key_cols)))
                readable.append(seg)
            except UNREADABLE as exc:
                _set_aside_unreadable(part.root, seg.path, exc, stacklevel=6)
        part.segments = readable
        part.keys = pa.concat_tables(keys) if keys else None


UNREADABLE = (OSError, pa.ArrowException)


def _set_aside_unreadable(root: Path, path: Path, exc: BaseException, stacklevel: int) -> None:
    """Quarantine a segment whose data failed to read with ``exc`` and say so (StoreWarning;
    ``stacklevel`` counts this function's frame)."""
    reason = f"unreadable data ({str(exc).splitlines()[0][:160]})"
    dest = layout.quarantine(root, path, reason)
    warnings.warn(f"{path}: {reason}; moved to {dest}", StoreWarning, stacklevel=stacklevel)


def first_unreadable(table: str, paths: list[Path]) -> Path | None:
    """The first of ``paths`` that does not read in full (pyarrow's errors name no file)."""
    sch = schema.TABLES[table]
    return next((p for p in paths if layout.inspect_segment(p, sch, deep=True)), None)


def leads_into(link: Path, directory: Path) -> bool:
    """Whether a run's symlink resolves to a generation inside ``directory``."""
    real = Path(os.path.realpath(link))
    return real.parent == Path(os.path.realpath(directory))


def conformed(table: str, data: pa.Table) -> pa.Table:
    """A stored segment in the current schema (columns added since then read as null)."""
    if data.schema.equals(schema.TABLES[table], check_metadata=False):
        return data
    return validation.to_table(table, data)[0]
