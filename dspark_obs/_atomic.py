"""Writing a file whole or not at all: a temporary file beside it, then one rename.

Why: cost tables, traffic files, the store's catalog and caches are read by other processes
(a server loading a table, a dashboard, a rerun) and a crash mid-write must not leave them
half a file. The temporary file lives in the target's directory, so the rename never crosses
filesystems; its name (``.<name>.<pid>-<random>.tmp``) is hidden from globs and tells a later
process whether its writer is still alive (the store's clean-up reads the pid).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

__all__ = ["TMP_SUFFIX", "fsync_dir", "tmp_path_for", "write_text_atomic"]

TMP_SUFFIX = ".tmp"


def tmp_path_for(dest: Path) -> Path:
    """``.<name>.<pid>-<random>.tmp`` beside ``dest``."""
    return dest.with_name(f".{dest.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")


def fsync_dir(path: Path) -> None:
    """Make a directory entry change (create, rename) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(
    path: str | os.PathLike[str], text: str, mode: int | None = None, durable: bool = False
) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; ``mode``: its permission bits (None:
    what ``open`` gives, 0666 less the umask); ``durable``: fsync the file and its directory
    before returning (the store's files). A failure removes the temporary file and leaves
    ``path`` as it was."""
    target = Path(path)
    tmp = tmp_path_for(target)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)  # O_CREAT's mode is filtered by the umask
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(target.parent)
    return target
