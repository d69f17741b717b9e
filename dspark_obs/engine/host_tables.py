"""Which host a cost table was profiled on, and the cache of tables profiled on this one.

Why: a CPU cost table predicts the machine it was timed on. On an AMD EPYC the shipped table
(profiled on an Intel Xeon) makes compact 1.06x no-spec at batch 1, a table profiled there
1.31x (README, "The CPU goals on another host"). So ``dspark-obs profile`` writes a ``host``
block into every table, and ``profile --for-this-host`` keeps its table in the user cache
under a name that fingerprints the host and the runtime it timed, where a CPU run looks
before it falls back to the shipped table (``session.resolve_cost_table``).

A table without a ``host`` block (older tables, SGLang's) comes from an unknown host.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from dspark_obs.cost_table import CostTable, CostTableError
from dspark_obs.engine.draft_vocab import default_draft_vocab
from dspark_obs.engine.types import resolved_backend
from dspark_obs.engine.weights import default_cache_dir

HOST_KEY = "host"
"""The key of a table's host block (kept by :class:`CostTable` as an unknown key)."""

ENV_TABLES = "DSPARK_OBS_COST_TABLES"
"""Overrides the per-host table directory (default ``$DSPARK_OBS_CACHE/cost_tables``)."""

PROFILE_SECONDS_NOTE = "78 s for the batched runtime on a 2-core AMD EPYC"
"""What the suggested profile took where it was measured (README), for the warning."""


@dataclass(frozen=True)
class Host:
    """What a step time depends on besides the model: the machine, torch's threads there,
    and the runtime and draft vocabulary the steps ran with.

    ``torch`` (its version) is recorded for the reader, but not matched: an upgrade alone
    does not make a user profile again.
    """

    cpu: str
    logical_cores: int
    torch_threads: int
    device: str
    backend: str  # resolved: "batched" or "reference"
    draft_vocab: int  # 0: the whole vocabulary
    gpu: str | None = None
    torch: str = ""

    def matched(self) -> dict[str, Any]:
        """The fields that must be equal for a table to be this host's."""
        out = asdict(self)
        del out["torch"]
        return out

    def same_as(self, other: Host) -> bool:
        return self.matched() == other.matched()

    def fingerprint(self) -> str:
        """A short stable digest of :meth:`matched`: the cached table's file name carries it."""
        text = json.dumps(self.matched(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def to_block(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_block(cls, block: Any, source: str) -> Host:
        """Parse a table's host block; :class:`CostTableError` naming ``source`` if malformed."""
        if not isinstance(block, Mapping):
            raise CostTableError(f"cost table {source}: 'host' must be an object, got {block!r}")
        types = {"logical_cores": int, "torch_threads": int, "draft_vocab": int}
        required = {f.name for f in fields(cls)} - {"gpu", "torch"}
        missing = sorted(required - set(block))
        if missing:
            raise CostTableError(f"cost table {source}: 'host' lacks {', '.join(missing)}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in block:
                continue
            value = block[f.name]
            want = types.get(f.name, str)
            ok = (value is None and f.name == "gpu") or (
                isinstance(value, want) and not isinstance(value, bool)
            )
            if not ok:
                raise CostTableError(
                    f"cost table {source}: host.{f.name} must be {want.__name__}, got {value!r}"
                )
            values[f.name] = value
        return cls(**values)

    def describe(self) -> str:
        """One phrase for a person: machine, threads, runtime, draft vocabulary."""
        where = self.gpu or self.cpu
        vocab = f"draft vocab {self.draft_vocab}" if self.draft_vocab else "whole draft vocab"
        return (
            f"{where} ({self.logical_cores} cores, {self.torch_threads} torch threads; "
            f"{self.backend} runtime, {vocab})"
        )


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform``), e.g. ``AMD EPYC``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def this_host(device: str, backend: str, draft_vocab: int) -> Host:
    """The host this process runs on, for steps on ``device`` with this runtime and vocabulary."""
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    return Host(
        cpu=cpu_model(),
        logical_cores=os.cpu_count() or 0,
        torch_threads=torch.get_num_threads(),
        device="cuda" if device.startswith("cuda") else device,
        backend=resolved_backend(backend),
        draft_vocab=int(draft_vocab),
        gpu=torch.cuda.get_device_name(device) if cuda else None,
        torch=torch.__version__,
    )


def table_host(table: CostTable, source: str | os.PathLike[str]) -> Host | None:
    """The host a table says it was profiled on; None when it does not say (unknown host)."""
    block = table.extra.get(HOST_KEY)
    return None if block is None else Host.from_block(block, str(source))


def host_table_dir() -> Path:
    """``$DSPARK_OBS_COST_TABLES``, else ``cost_tables`` in the dspark-obs cache directory."""
    env = os.environ.get(ENV_TABLES)
    return Path(env).expanduser() if env else default_cache_dir() / "cost_tables"


def host_table_stem(name: str, host: Host) -> str:
    """``<name>-<fingerprint>``: one file per shipped table it replaces and per host."""
    return f"{name}-{host.fingerprint()}"


def cached_host_table(name: str, host: Host) -> tuple[Path, CostTable] | None:
    """This host's cached table standing in for the shipped ``name``, or None if none exists.

    A file that is there but malformed, or whose host block is not this host's, is an error
    naming the file: the user profiled this host on purpose, so it is never skipped silently.
    """
    path = host_table_dir() / f"{host_table_stem(name, host)}.json"
    if not path.exists():
        return None
    fix = f"delete it or profile again: {profile_command(host)}"
    try:
        table = CostTable.load(path)
        recorded = table_host(table, path)
    except CostTableError as exc:
        raise CostTableError(f"{exc} (this host's cached table; {fix})") from exc
    if recorded is None or not recorded.same_as(host):
        said = "no host" if recorded is None else recorded.describe()
        raise CostTableError(
            f"cost table {path}: this host's cached table says it was profiled on {said}, "
            f"not on this host, {host.describe()}; {fix}"
        )
    return path, table


def profile_command(host: Host) -> str:
    """The command that profiles ``host``'s table into the cache (what the warning suggests)."""
    parts = ["dspark-obs", "profile", "--device", host.device, "--for-this-host"]
    parts += ["--batch-sizes", "1,2,4,8", "--new-tokens", "16"]
    if host.backend != "batched":
        parts += ["--backend", host.backend]
    if host.draft_vocab != default_draft_vocab(host.device):
        parts += ["--draft-vocab", str(host.draft_vocab)]
    return " ".join(parts)
