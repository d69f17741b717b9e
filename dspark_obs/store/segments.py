"""Which files count as a table's rows: the one acceptance rule every reader applies.

A file under ``<table>/run_id=*/`` named ``seg-*.parquet`` is one of the table's segments
only if all of these hold (:func:`problem` says which one fails):

* it is a regular file, not a symlink (the store writes none), whose resolved path lies
  inside the store (a run directory symlinked elsewhere does not count either);
* it is a complete Parquet file whose columns are columns of the table with the table's
  types, and which has every key (required) column; older segments may lack optional
  columns added since (they read as null);
* with ``deep``: every page reads (what ``store-check`` checks; footers are what readers
  check, and a reader that then fails on the pages marks the file with :meth:`Judge.reject`).

A valid 0-row file is simply empty. Readers never merge, count or read a file that fails:
``Store.query`` / ``export`` / ``info``, compaction and re-ingest (the writer moves it to the
quarantine folder), ``serve --follow`` and ``store-check`` all go through this module, and
every answer says what it left out (:class:`Skipped`: the file, why, and the rows its footer
declares when it has a readable footer).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dspark_obs.schema import TABLES
from dspark_obs.store import layout

__all__ = ["SOURCES_KEY", "Judge", "Listing", "Skipped", "problem", "sources", "summary"]

# Footer metadata of a compacted segment: the producers' segments it holds, in order, as
# [[segment name, rows], ...] (serve --follow counts rows per original segment with it).
SOURCES_KEY = b"dspark_obs.sources"


@dataclass(frozen=True)
class Skipped:
    """A file a reader left out: its path, why, and its rows when its footer says (else None)."""

    path: str
    reason: str
    rows: int | None

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "reason": self.reason, "rows": self.rows}


@dataclass(frozen=True)
class Listing:
    """One table's accepted segments (paths through the runs' symlinks) and what was left out."""

    files: tuple[str, ...]
    skipped: tuple[Skipped, ...]


def problem(root: Path, path: Path, table: str, deep: bool = False) -> str | None:
    """Why ``path`` is not one of ``table``'s segments in the store at ``root`` (None: it is)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None  # vanished (a compaction swapped it out): not damage
    except OSError as exc:
        return f"cannot be examined ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return "a symlink where a segment belongs (the store writes none; it may lead outside)"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    try:
        inside = Path(os.path.realpath(path)).is_relative_to(Path(os.path.realpath(root)))
    except OSError:
        inside = False
    if not inside:
        return "outside the store (its run directory leads elsewhere)"
    return layout.inspect_segment(path, TABLES[table], deep=deep)


def footer_rows(root: Path, path: Path) -> int | None:
    """The row count a segment's footer declares, None when there is no readable footer (or
    the file is a link or lies outside the store: what it leads to is never opened)."""
    try:
        real = Path(os.path.realpath(path))
        if os.path.islink(path) or not real.is_relative_to(Path(os.path.realpath(root))):
            return None
        return pq.read_metadata(path).num_rows
    except (OSError, pa.ArrowException):
        return None


def sources(path: Path) -> list[tuple[str, int]]:
    """The producers' segments a segment holds, in order: [(its own name, rows)] for one a
    producer wrote, the footer's list for one made by compaction."""
    md = pq.read_metadata(path)
    rows = md.num_rows
    raw = (md.metadata or {}).get(SOURCES_KEY)
    if raw is not None:
        try:
            listed = [(str(n), int(r)) for n, r in json.loads(raw)]
        except (ValueError, TypeError):
            listed = []
        if listed and sum(r for _, r in listed) == rows:
            return listed
    return [(path.name, rows)]


class Judge:
    """The rule with a memory: a verdict is kept until the file changes (inode, size, mtime),
    so a reader that lists the store on every query or poll examines each file once."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._verdicts: dict[str, tuple[tuple[int, int, int], str | None]] = {}

    def verdict(self, path: Path, table: str) -> str | None:
        """:func:`problem` for ``path`` (cached per file version)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return "vanished"
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._verdicts.get(str(path))
        if cached is not None and cached[0] == key:
            return cached[1]
        reason = problem(self.root, path, table)
        self._verdicts[str(path)] = (key, reason)
        return reason

    def reject(self, path: Path, reason: str) -> None:
        """Mark a file whose pages failed to read (until it changes)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        self._verdicts[str(path)] = ((st.st_ino, st.st_size, st.st_mtime_ns), reason)

    def known(self) -> Iterable[tuple[str, str | None]]:
        """(path, verdict) of every file judged so far."""
        return ((p, v[1]) for p, v in list(self._verdicts.items()))

    def listing(self, table: str) -> Listing:
        """Every accepted segment of ``table`` (with its schema placeholder) and every file
        that matched the readers' name pattern but was left out."""
        tdir = Path(os.path.realpath(self.root)) / table
        try:
            runs = sorted(n for n in os.listdir(tdir) if n.startswith("run_id="))
        except FileNotFoundError:
            return Listing((), ())
        files: list[str] = []
        skipped: list[Skipped] = []
        for run in runs:
            run_files, run_skipped = self._run_listing(tdir / run, table)
            files += run_files
            skipped += run_skipped
        return Listing(tuple(files), tuple(skipped))

    def _run_listing(self, run_dir: Path, table: str) -> tuple[list[str], list[Skipped]]:
        """One run's segments as one consistent generation: a compaction that swaps the run's
        link (and deletes the old generation) while it is listed makes the listing start
        again, so a reader never sees a run with part or none of its rows."""
        for _ in range(_LISTING_ATTEMPTS):
            target = _link_target(run_dir)
            files: list[str] = []
            skipped: list[Skipped] = []
            vanished = False
            for path in layout.segment_files(run_dir):
                reason = self.verdict(path, table)
                if reason is None:
                    files.append(str(path))
                elif reason == "vanished":
                    vanished = True
                else:
                    skipped.append(Skipped(str(path), reason, footer_rows(self.root, path)))
            if not vanished and _link_target(run_dir) == target:
                return files, skipped
        return files, skipped  # still changing: the query's own retry covers what moves


_LISTING_ATTEMPTS = 100


def _link_target(run_dir: Path) -> str | None:
    """Where a run's link leads now (None: not a link, or gone)."""
    try:
        return os.readlink(run_dir)
    except OSError:
        return None


def summary(skipped: Iterable[Skipped]) -> str:
    """One line: how many files were left out and how many rows they declare."""
    items = list(skipped)
    known = sum(s.rows for s in items if s.rows is not None)
    unknown = sum(s.rows is None for s in items)
    parts = [f"{known:,} rows"] if known or not unknown else []
    if unknown:
        parts.append(f"{unknown} file(s) of unknown size")
    size = " + ".join(parts)
    names = "; ".join(f"{s.path}: {s.reason}" for s in items[:5])
    more = f"; ... {len(items) - 5} more" if len(items) > 5 else ""
    return (
        f"left out {len(items)} damaged or foreign store file(s) ({size}): {names}{more}; "
        "`dspark-obs store-check --repair` moves them to the quarantine folder"
    )
