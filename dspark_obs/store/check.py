"""Find damaged or foreign files in a store, and set them aside (``dspark-obs store-check``).

Damaged: a segment the store's acceptance rule refuses (``store/segments.py``: not a
complete Parquet file of its table (zero bytes, truncated, another table's or program's
columns, a key column missing), a symlink, a file outside the store), a run symlink to a
missing generation, a catalog.duckdb that does not open or lacks a view, a catalog.sql that
names other paths. Foreign: anything in a table's directory that the store did not write
(``backup.parquet``, notes, a stray directory), a run directory copied in as a plain
directory, and a run symlink that leads outside the store (the link is set aside, never
what it leads to).

:func:`repair` moves every damaged or foreign file to ``root/.quarantine/<stamp>/`` (its path
inside the store kept, a ``.why.txt`` note beside it), under the run's writer lock, adopts a
plain run directory as a generation, and rebuilds the catalog files. It never deletes.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from dspark_obs._atomic import write_text_atomic
from dspark_obs.schema import TABLES
from dspark_obs.store import layout, segments, views
from dspark_obs.store.catalog_files import catalog_db_ok, write_catalog_db

_LEGACY_PLACEHOLDER = "_schema.parquet"


@dataclass(frozen=True)
class Finding:
    """One damaged or foreign entry: where, what kind, why; ``run`` is its (table, run_id)."""

    path: Path
    kind: str  # "damaged" | "foreign" | "catalog"
    reason: str
    run: tuple[str, str] | None = None

    def __str__(self) -> str:
        return f"{self.kind}: {self.path}: {self.reason}"


@dataclass(frozen=True)
class Repair:
    """What :func:`repair` did with one finding: moved to ``dest``, or why not (``note``)."""

    finding: Finding
    dest: Path | None
    note: str


def check_store(root: str | os.PathLike[str]) -> list[Finding]:
    """Every damaged or foreign entry of the store at ``root`` (read-only: moves nothing)."""
    root = Path(root)
    if not root.is_dir():
        raise layout.StoreError(f"no store at {root}")
    found = list(_catalog_findings(root))
    for table in TABLES:
        tdir = root / table
        if tdir.is_dir():
            found += _table_findings(root, table, tdir)
    return found


def repair(root: str | os.PathLike[str], findings: list[Finding]) -> list[Repair]:
    """Quarantine each finding (never delete), then rebuild catalog.sql and catalog.duckdb."""
    root = Path(root)
    done = []
    # A plain run directory is adopted after its damaged files are set aside (paths change).
    for f in sorted(findings, key=lambda f: f.reason == _PLAIN_RUN_DIR):
        if f.kind == "catalog":
            continue
        with _run_lock(root, f.run) as held:
            if not held:
                done.append(
                    Repair(
                        f,
                        None,
                        "a writer holds this run; run store-check again when it has finished",
                    )
                )
                continue
            if f.reason == _PLAIN_RUN_DIR:
                done.append(Repair(f, _adopt(f.path), "adopted as the run's generation"))
                continue
            if not os.path.lexists(f.path):
                done.append(Repair(f, None, "already gone"))
                continue
            done.append(Repair(f, layout.quarantine(root, f.path, f.reason), "quarantined"))
    write_text_atomic(root / layout.CATALOG_SQL, views.catalog_sql(root), durable=True)
    write_catalog_db(root, root / layout.CATALOG_DB)
    done += [Repair(f, None, "rebuilt") for f in findings if f.kind == "catalog"]
    return done


# ---------------------------------------------------------------------- scanning

_PLAIN_RUN_DIR = "a plain directory where the run's generation symlink belongs (copied in?)"
_RUN_LINK_OUTSIDE = "the run's symlink leads outside the store's generations (set aside: the link)"


def _inside_gen(link: Path) -> bool:
    """A run symlink resolves to a directory directly inside its table's ``.gen``."""
    real = Path(os.path.realpath(link))
    return real.parent == Path(os.path.realpath(link.parent / layout.GEN_DIR))


def _catalog_findings(root: Path) -> Iterator[Finding]:
    db = root / layout.CATALOG_DB
    if db.exists() and not catalog_db_ok(db):
        yield Finding(db, "catalog", "does not open as a DuckDB database with every view")
    sql = root / layout.CATALOG_SQL
    try:
        text = sql.read_text(encoding="utf-8")
    except FileNotFoundError:
        return
    except (OSError, UnicodeDecodeError) as exc:
        yield Finding(sql, "catalog", f"unreadable ({exc})")
        return
    if text != views.catalog_sql(root):
        yield Finding(sql, "catalog", "differs from this store's views (store moved?)")


def _table_findings(root: Path, table: str, tdir: Path) -> list[Finding]:
    found = []
    for name in sorted(os.listdir(tdir)):
        path = tdir / name
        if name == layout.LOCK_DIR:
            continue
        if name == layout.GEN_DIR:
            found += _gen_dir_findings(tdir / name)
        elif name == layout.PLACEHOLDER_DIR:
            found += _files_findings(
                root, table, path, None, {layout.PLACEHOLDER_FILE, _LEGACY_PLACEHOLDER}
            )
        elif name.startswith("run_id="):
            run = (table, unquote(name[len("run_id=") :]))
            if not path.is_symlink() and path.is_dir():
                found += _files_findings(root, table, path, run, set())
                found.append(Finding(path, "foreign", _PLAIN_RUN_DIR, run))
            elif not path.is_dir():
                found.append(Finding(path, "damaged", "the run's symlink points nowhere", run))
            elif not _inside_gen(path):
                found.append(Finding(path, "foreign", _RUN_LINK_OUTSIDE, run))
            else:
                found += _files_findings(root, table, path, run, set())
        elif not (name.startswith(".") and name.endswith(layout.TMP_SUFFIX)):
            found.append(Finding(path, "foreign", "not written by the store"))
    return found


def _gen_dir_findings(gens: Path) -> list[Finding]:
    """Entries of ``.gen`` that are neither generation directories nor temp links."""
    out = []
    for name in sorted(os.listdir(gens)):
        path = gens / name
        if name.startswith("run_id=") and path.is_dir() and not path.is_symlink():
            continue
        if name.startswith(".") and name.endswith(layout.TMP_SUFFIX):
            continue
        out.append(Finding(path, "foreign", "not written by the store"))
    return out


def _files_findings(
    root: Path, table: str, part: Path, run: tuple[str, str] | None, allowed: set[str]
) -> list[Finding]:
    out = []
    for name in sorted(os.listdir(part)):
        path = part / name
        if name in allowed:
            if name == layout.PLACEHOLDER_FILE:
                reason = segments.problem(root, path, table, deep=True)
                if reason is not None:
                    out.append(Finding(path, "damaged", reason, run))
            continue
        if name.startswith(".") and name.endswith(layout.TMP_SUFFIX):
            continue  # a live writer's file, or a crashed one's (the next writer removes it)
        if name.startswith(layout.SEGMENT_PREFIX) and name.endswith(layout.SEGMENT_SUFFIX):
            reason = segments.problem(root, path, table, deep=True)
            if reason is not None:
                out.append(Finding(path, "damaged", reason, run))
            continue
        out.append(Finding(path, "foreign", "not written by the store (readers ignore it)", run))
    return out


# ---------------------------------------------------------------------- repairing


class _run_lock:  # noqa: N801 - used as a context manager
    """Hold a run's writer lock (non-blocking) while its files are moved."""

    def __init__(self, root: Path, run: tuple[str, str] | None) -> None:
        self.root, self.run, self.fd = root, run, -1

    def __enter__(self) -> bool:
        if self.run is None:
            return True
        table, run_id = self.run
        lock = layout.lock_path(self.root, table, run_id)
        layout.ensure_dir(lock.parent)
        self.fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def _adopt(run_dir: Path) -> Path:
    """Turn a plain run directory into a generation and point the run's symlink at it."""
    gen = layout.new_generation_name(run_dir.name)
    gens = run_dir.parent / layout.GEN_DIR
    layout.ensure_dir(gens)
    os.replace(run_dir, gens / gen)
    layout.fsync_dir(gens)
    layout.point_link(run_dir, f"{layout.GEN_DIR}/{gen}")
    return gens / gen
