"""Where a store keeps its files, and the filesystem steps that make a write crash-safe.

Layout (``root`` is the store directory)::

    root/catalog.sql                          CREATE VIEW statements for a duckdb shell
    root/catalog.duckdb                       the same views in a database file (read-only)
    root/<table>/run_id=<enc>                 symlink -> .gen/run_id=<enc>.<generation>
    root/<table>/.gen/run_id=<enc>.<gen>/seg-*.parquet   immutable segments of one run
    root/<table>/.locks/run_id=<enc>.lock     the per-(table, run) writer lock
    root/<table>/run_id=+schema/seg-schema.parquet   zero rows: keeps the glob non-empty
    root/.quarantine/<stamp>/<path>           damaged or foreign files, set aside (never deleted)

``<enc>`` is the run_id percent-encoded so that DuckDB's hive partitioning decodes it back
exactly. Readers glob ``<table>/run_id=*/seg-*.parquet`` (the writer counts the same files:
a stray ``backup.parquet`` is neither read nor counted); the glob follows each run's
symlink, so a reader lists one generation of a run, never two. A segment is written under
a name the glob does not match (``.tmp``), fsynced, renamed into place and its directory
fsynced: readers see whole segments or none. Compaction writes a new generation and swaps
the symlink with one rename (a listing shows one generation, never both), then deletes the
old generation (files in it the store did not write go to ``.quarantine`` first).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq

from dspark_obs._atomic import TMP_SUFFIX, fsync_dir, tmp_path_for, write_text_atomic
from dspark_obs.schema import MAX_RUN_DIR_BYTES, run_dir_name

SEGMENT_PREFIX = "seg-"
SEGMENT_SUFFIX = ".parquet"
GEN_DIR = ".gen"
LOCK_DIR = ".locks"
# quote() always encodes "+", so no run can own this directory name.
PLACEHOLDER_DIR = "run_id=+schema"
PLACEHOLDER_FILE = "seg-schema.parquet"  # matched by the readers' glob
CATALOG_SQL = "catalog.sql"
CATALOG_DB = "catalog.duckdb"
QUARANTINE_DIR = ".quarantine"

# Parquet settings for segments, chosen for write speed (the ingest hot path) at a fair size:
# snappy; one row group per segment up to 1M rows; statistics on the key columns only (they
# drive DuckDB's pruning, the rest cost write time); dictionary pages for strings and
# low-cardinality scalars; BYTE_STREAM_SPLIT for numeric list elements (tokens, confidence,
# survival), which is about as small as a dictionary there and twice as fast to write.
ROW_GROUP_ROWS = 1 << 20
COMPRESSION = "snappy"
STATS_COLUMNS = ("run_id", "dp_rank", "forward_ct", "rid", "ts")
_PLAIN_COLUMNS = frozenset({"forward_ct", "ts", "bonus_token", "prefix_len", "seed"})


class StoreError(RuntimeError):
    """A store operation was refused or failed; the message says what and why."""


class StoreWarning(UserWarning):
    """Something in the store needs attention (a damaged file was set aside or skipped)."""


def partition_name(run_id: str) -> str:
    """The directory name for one run: ``run_id=<percent-encoded run_id>``."""
    name = run_dir_name(run_id)
    if len(name.encode()) > MAX_RUN_DIR_BYTES:
        raise StoreError(
            f"run_id {run_id[:40]!r}... is too long for the store "
            f"({len(name.encode())} bytes encoded; at most {MAX_RUN_DIR_BYTES})"
        )
    return name


def table_dir(root: Path, table: str) -> Path:
    return root / table


def partition_dir(root: Path, table: str, run_id: str) -> Path:
    """The run's directory as readers and writers address it (a symlink to a generation)."""
    return root / table / partition_name(run_id)


def lock_path(root: Path, table: str, run_id: str) -> Path:
    return root / table / LOCK_DIR / f"{partition_name(run_id)}.lock"


def gen_dir(root: Path, table: str) -> Path:
    return root / table / GEN_DIR


def new_generation_name(pname: str) -> str:
    """``<partition name>.<ns clock>-<random>``: unique, and sorts by creation time."""
    return f"{pname}.{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"


def generation_pattern(pname: str) -> re.Pattern[str]:
    return re.compile(re.escape(pname) + r"\.\d{20}-[0-9a-f]{8}")


def current_generation(link: Path) -> str:
    """The generation directory name a run's symlink points at."""
    return os.path.basename(os.readlink(link))


def point_link(link: Path, target: str) -> None:
    """Create or atomically repoint the symlink ``link`` -> ``target`` (relative), durably.

    The new link is made inside ``.gen`` first: DuckDB's ``*`` matches hidden names, so a
    temp link beside the runs would be globbed by readers.
    """
    tmp = link.parent / GEN_DIR / tmp_path_for(link).name
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(link.parent)


def clean_generations(table_dir: Path, pname: str) -> None:
    """Under the partition lock: drop what crashed writers and compactions left behind.

    Readers reach segments only through the run's symlink, so a generation the symlink does
    not point at (never published, or replaced by a compaction) is garbage; so are this
    partition's temp symlinks (made in ``.gen``). Files in it the store did not write (a
    user's backup, notes) are moved to the quarantine folder first, never deleted.
    """
    tmp_link = re.compile(re.escape(f".{pname}.") + r"\d+-[0-9a-f]{8}" + re.escape(TMP_SUFFIX))
    gens = table_dir / GEN_DIR
    link = table_dir / pname
    current = current_generation(link) if link.is_symlink() else None
    pattern = generation_pattern(pname)
    removed = False
    for name in os.listdir(gens):
        if tmp_link.fullmatch(name):
            (gens / name).unlink(missing_ok=True)
            removed = True
        elif pattern.fullmatch(name) and name != current:
            for entry in os.listdir(gens / name):
                if not (_OUR_SEGMENT.fullmatch(entry) or entry.endswith(TMP_SUFFIX)):
                    quarantine(table_dir.parent, gens / name / entry, "not written by the store")
            shutil.rmtree(gens / name, ignore_errors=True)
            removed = True
    if removed:
        fsync_dir(gens)


_OUR_SEGMENT = re.compile(
    re.escape(SEGMENT_PREFIX) + r"\d{20}-\d+-[0-9a-f]{8}" + re.escape(SEGMENT_SUFFIX)
)


def inspect_segment(path: Path, schema: pa.Schema, deep: bool = False) -> str | None:
    """Why a segment cannot be read as part of its table (None: it can).

    Readable means: a complete Parquet file (footer intact) whose every column is a column
    of the table with the table's type, and which has every required (key) column. Older
    segments may lack columns added to the schema since; those read as null. ``deep``: also
    read every page (what ``store-check`` does; footers alone are what readers check).
    """
    try:
        if path.is_dir():
            return "a directory where a segment file belongs"
        size = path.stat().st_size
        if size == 0:
            return "empty file (0 bytes)"
        file_schema = pq.read_schema(path)
    except FileNotFoundError:
        return None  # vanished (a compaction swapped it out): not damage
    except (OSError, pa.ArrowException) as exc:
        return f"not a readable Parquet file ({str(exc).splitlines()[0][:120]})"
    want = {f.name: f for f in schema}
    for f in file_schema:
        if f.name == "run_id" and f.name not in want:
            continue
        if f.name not in want:
            return f"column {f.name!r} is not in the table"
        if f.type != want[f.name].type:
            return f"column {f.name!r} is {f.type}, the table has {want[f.name].type}"
    missing = [
        f.name
        for f in schema
        if not f.nullable and f.name != "run_id" and f.name not in file_schema.names
    ]
    if missing:
        return f"missing required column(s) {missing}"
    if deep:
        try:
            pq.read_table(path)
        except FileNotFoundError:
            return None
        except (OSError, pa.ArrowException) as exc:
            return f"unreadable data ({str(exc).splitlines()[0][:120]})"
    return None


def quarantine(root: Path, path: Path, reason: str) -> Path:
    """Move ``path`` (file or directory) under ``root/.quarantine/<stamp>/``, keeping its path
    relative to the store, and leave a note of why beside it. Nothing is deleted."""
    try:
        rel = path.relative_to(root)
    except ValueError:
        rel = Path(path.name)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{uuid.uuid4().hex[:6]}"
    dest = root / QUARANTINE_DIR / stamp / rel
    ensure_dir(dest.parent)
    os.replace(path, dest)
    fsync_dir(dest.parent)
    fsync_dir(path.parent)
    write_text_atomic(dest.with_name(dest.name + ".why.txt"), f"{path}\n{reason}\n", durable=True)
    return dest


def partition_runs(root: Path, table: str) -> list[str]:
    """run_ids that have a partition in ``table`` (decoded from the directory names)."""
    try:
        names = os.listdir(root / table)
    except FileNotFoundError:
        return []
    return sorted(
        unquote(n[len("run_id=") :])
        for n in names
        if n.startswith("run_id=") and n != PLACEHOLDER_DIR
    )


def segment_glob(root: Path, table: str) -> str:
    """The glob readers use: every segment of every run (plus the schema placeholder)."""
    return str(root.resolve() / table / "run_id=*" / f"{SEGMENT_PREFIX}*{SEGMENT_SUFFIX}")


def placeholder_path(root: Path, table: str) -> Path:
    return root / table / PLACEHOLDER_DIR / PLACEHOLDER_FILE


def segment_files(part_dir: Path) -> list[Path]:
    """Committed segments of one partition, oldest first (names sort by creation time)."""
    try:
        names = os.listdir(part_dir)
    except FileNotFoundError:
        return []
    return [
        part_dir / n
        for n in sorted(names)
        if n.startswith(SEGMENT_PREFIX) and n.endswith(SEGMENT_SUFFIX)
    ]


def new_segment_name() -> str:
    """A unique, time-ordered segment name (ns clock, pid, random suffix)."""
    stamp = f"{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return f"{SEGMENT_PREFIX}{stamp}{SEGMENT_SUFFIX}"


def ensure_dir(path: Path) -> None:
    """Create ``path`` (and parents) durably: each new entry's parent is fsynced."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        fsync_dir(d.parent)


def write_parquet_atomic(
    table: pa.Table, dest: Path, metadata: dict[bytes, bytes] | None = None
) -> None:
    """Write ``table`` to ``dest`` so that ``dest`` is either absent or complete and durable.

    Temp file (ignored by readers) -> fsync -> rename -> fsync of the directory.
    """
    tmp = tmp_path_for(dest)
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    stats = [c for c in STATS_COLUMNS if c in table.column_names]
    dictionary, split = _encodings(table.schema)
    try:
        with open(tmp, "wb") as f:
            pq.write_table(
                table,
                f,
                compression=COMPRESSION,
                row_group_size=ROW_GROUP_ROWS,
                write_statistics=stats or False,
                use_dictionary=dictionary,
                use_byte_stream_split=split or False,
            )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dest.parent)


class SegmentWriter:
    """Stream tables into one new segment (compaction): temp name, row groups of up to
    ``ROW_GROUP_ROWS``, then the same fsync / rename / fsync as :func:`write_parquet_atomic`."""

    def __init__(self, dest: Path, schema: pa.Schema, metadata: dict[bytes, bytes]) -> None:
        self.dest = dest
        self.tmp = tmp_path_for(dest)
        self.schema = schema.with_metadata({**(schema.metadata or {}), **metadata})
        dictionary, split = _encodings(schema)
        self._file = open(self.tmp, "wb")  # noqa: SIM115 - closed in commit/abort
        self._writer = pq.ParquetWriter(
            self._file,
            self.schema,
            compression=COMPRESSION,
            write_statistics=[c for c in STATS_COLUMNS if c in schema.names] or False,
            use_dictionary=dictionary,
            use_byte_stream_split=split or False,
        )
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        self._pending.append(table)
        self._pending_rows += table.num_rows
        if self._pending_rows >= ROW_GROUP_ROWS:
            self._drain()

    def _drain(self) -> None:
        if self._pending_rows:
            data = pa.concat_tables(self._pending).replace_schema_metadata(self.schema.metadata)
            self._writer.write_table(data, row_group_size=ROW_GROUP_ROWS)
            self.rows += data.num_rows
        self._pending, self._pending_rows = [], 0

    def commit(self) -> None:
        try:
            self._drain()
            self._writer.close()
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.tmp, self.dest)
        except BaseException:
            self.abort()
            raise
        fsync_dir(self.dest.parent)

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # the temp file is discarded anyway
            self._writer.close()
        self._file.close()
        self.tmp.unlink(missing_ok=True)


def _encodings(schema: pa.Schema) -> tuple[list[str], list[str]]:
    """(columns with dictionary pages, list leaves with BYTE_STREAM_SPLIT) for a schema."""
    dictionary, split = [], []
    for f in schema:
        t = f.type
        if pa.types.is_list(t):
            v = t.value_type
            if pa.types.is_floating(v) or pa.types.is_integer(v):
                split.append(f"{f.name}.list.element")
        elif pa.types.is_floating(t) and t.bit_width == 64:
            continue  # timings: mostly distinct
        elif not pa.types.is_struct(t) and f.name not in _PLAIN_COLUMNS:
            dictionary.append(f.name)
    return dictionary, split


def remove_stale_tmp(directory: Path, *, only_dead: bool = False) -> int:
    """Delete temp files crashed writers left behind in ``directory``.

    Under a partition's lock every temp file there is stale; elsewhere (the store root) pass
    ``only_dead`` to keep those of writers that are still alive.
    """
    n = 0
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    for name in names:
        if not (name.startswith(".") and name.endswith(TMP_SUFFIX)):
            continue
        if only_dead and _writer_alive(name):
            continue
        (directory / name).unlink(missing_ok=True)
        n += 1
    return n


def _writer_alive(tmp_name: str) -> bool:
    stamp = tmp_name[: -len(TMP_SUFFIX)].rsplit(".", 1)[-1]
    try:
        pid = int(stamp.split("-", 1)[0])
    except ValueError:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
