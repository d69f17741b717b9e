"""scripts/install-test-deps.sh, the one install step of `make test` and CI: it says what it
could not install and which tests will skip, and --strict (CI) fails on it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install-test-deps.sh"
BASICS = ("bash", "id", "sort", "tr", "ls", "head", "mkdir", "dirname", "cat")


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The script with a PATH holding only shell basics: no prometheus, chromium, apt-get."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in BASICS:
        if not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(shutil.which(tool))
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    (wheels / "sglang-0.5.23-py3-none-any.whl").write_bytes(b"")  # present: no download
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "DSPARK_OBS_CACHE": str(tmp_path / "cache")}
    return subprocess.run([str(bin_dir / "bash"), str(SCRIPT), *args], capture_output=True,
                          text=True, env=env, timeout=60)  # fmt: skip


def test_missing_programs_are_named_with_the_tests_they_skip(tmp_path: Path) -> None:
    res = _run(tmp_path)
    assert res.returncode == 0, res.stderr  # make test goes on and runs what it can
    out = res.stdout
    for program, package in (
        ("prometheus", "prometheus"),
        ("promtool", "prometheus"),
        ("chromium", "chromium"),
        ("chromedriver", "chromium-driver"),
    ):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"MISSING  {program} "))
        assert f"Debian package {package}" in line and "skips test_" in line
    assert "ok       sglang wheel" in out
    assert "could not install" in out or "cannot install" in out


def test_strict_fails_when_anything_is_missing(tmp_path: Path) -> None:
    res = _run(tmp_path, "--strict")
    assert res.returncode == 1 and "missing test dependencies" in res.stderr


def test_make_test_and_ci_call_the_same_script() -> None:
    make = (ROOT / "Makefile").read_text()
    test_rule = make[make.index("\ntest:") :].split("\n\n")[0]
    assert "scripts/install-test-deps.sh" in test_rule
    assert "scripts/install-test-deps.sh --strict" in (ROOT / ".ci" / "run").read_text()
    assert os.access(SCRIPT, os.X_OK)
