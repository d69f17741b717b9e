"""dspark_obs._atomic: a file is written whole or not at all."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from dspark_obs._atomic import write_text_atomic


def test_writes_and_replaces_whole_files(tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    assert write_text_atomic(path, "first\n") == path
    write_text_atomic(path, "second\n", mode=0o644)
    assert path.read_text() == "second\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    path.write_text("old\n")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(path, "half a line \ud800 never encoded")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["traffic.jsonl"]


def test_durable_writes_name_their_temporary_by_pid_for_the_store_clean_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store removes a crashed writer's temporary only once its pid is gone: the name
    must carry it, for durable writes as for the others."""
    import os

    from dspark_obs import _atomic

    seen: list[str] = []
    real_replace = os.replace

    def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        seen.append(Path(src).name)
        real_replace(src, dst)

    monkeypatch.setattr(_atomic.os, "replace", spy)
    write_text_atomic(tmp_path / "catalog.sql", "SELECT 1;\n", durable=True)
    assert (tmp_path / "catalog.sql").read_text() == "SELECT 1;\n"
    (name,) = seen
    assert name.startswith(".catalog.sql.") and name.endswith(_atomic.TMP_SUFFIX)
    assert name[len(".catalog.sql.") :].split("-")[0] == str(os.getpid())
