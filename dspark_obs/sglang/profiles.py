"""Launch profiles: the SGLang command lines and environments of a compact DSpark server and
its cap-accept companion, ready for the collector.

SGLang 0.5.23 picks the verify mode from ``SGLANG_RAGGED_VERIFY_MODE``, not a flag, so the
companion is a second server with the same model, flags and workload and only that variable
changed. Both turn on the step dump with request details (``SGLANG_DSPARK_DEBUG_DUMP``), the
compact one writes the block-accept estimator JSONL and, until an STS table is fitted, STS
calibration shards (SGLang refuses to collect shards under non-identity temperatures); both use
the same SPS table, STS temperatures and relay lag. ``runtime/sglang/*.json`` holds ready-made
profiles in the same shape (:meth:`LaunchProfile.to_dict`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LaunchError", "LaunchProfile", "check_can_launch", "launch", "server_profiles"]

DUMP_COMPONENTS = "core,step_cpu_time,reqs"


class LaunchError(RuntimeError):
    """SGLang cannot be launched here (no sglang, no GPU, bad profile)."""


@dataclass(frozen=True)
class LaunchProfile:
    """One server: its role, URL, argv and the environment variables it adds."""

    role: str  # "compact" | "cap-accept"
    url: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """The profile as one shell line (environment assignments, then the command)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} {shlex.join(self.argv)}".strip()

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "url": self.url, "argv": self.argv, "env": self.env}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchProfile:
        try:
            return cls(
                str(data["role"]),
                str(data["url"]),
                [str(a) for a in data["argv"]],
                {str(k): str(v) for k, v in (data.get("env") or {}).items()},
            )
        except (KeyError, TypeError) as exc:
            raise LaunchError(f"bad launch profile (needs role, url, argv): {exc}") from None


def server_profiles(
    target: str,
    drafter: str,
    *,
    gamma: int = 5,
    host: str = "127.0.0.1",
    port: int = 30000,
    companion_port: int = 30001,
    sps_table: str | None = None,
    sts: str | None = None,
    lag: int = 2,
    out_dir: str = "sglang-out",
    python: str = "python",
    extra_args: tuple[str, ...] = (),
) -> list[LaunchProfile]:
    """The compact server and its cap-accept companion for ``target`` + DSpark ``drafter``.

    Without ``sps_table`` SGLang's planner verifies every draft, so compact does not trim:
    profile a table first (``python -m sglang.benchmark.dspark_sps_profiler all``).
    """
    if gamma < 1:
        raise LaunchError(f"gamma must be >= 1, got {gamma}")
    if port == companion_port:
        raise LaunchError("the companion needs its own port")
    out = out_dir.rstrip("/")
    profiles = []
    for role, p in (("compact", port), ("cap-accept", companion_port)):
        argv = [
            python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            target,
            "--speculative-algorithm",
            "DSPARK",
            "--speculative-draft-model-path",
            drafter,
            "--speculative-dspark-block-size",
            str(gamma),
            "--host",
            host,
            "--port",
            str(p),
            "--enable-metrics",
        ]
        if sps_table:
            argv += ["--speculative-dspark-sps-table-path", sps_table]
        if sts:
            argv += ["--speculative-dspark-confidence-sts-path", sts]
        argv += list(extra_args)
        tag = role.replace("-", "_")
        env = {
            "SGLANG_RAGGED_VERIFY_MODE": role,
            "SGLANG_DSPARK_DEBUG_DUMP": DUMP_COMPONENTS,
            "SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS": str(lag),
            "SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH": f"{out}/estimator_{tag}.jsonl",
        }
        if role == "compact" and not sts:
            # SGLang refuses STS collection under a fitted STS ("requires identity
            # temperatures", dspark_planner.py): shards are collected only before fitting.
            env["SGLANG_DSPARK_STS_COLLECT_PATH"] = f"{out}/sts_{tag}"
        profiles.append(LaunchProfile(role, f"http://{host}:{p}", argv, env))
    return profiles


def check_can_launch() -> None:
    """Refuse clearly when SGLang cannot run here: it needs the sglang package and a GPU."""
    if importlib.util.find_spec("sglang") is None:
        raise LaunchError(
            "sglang is not installed here (pip install 'sglang==0.5.23' on a CUDA host); "
            "use --print to show the command lines instead"
        )
    if (
        shutil.which("nvidia-smi") is None
        or subprocess.run(["nvidia-smi", "-L"], capture_output=True, check=False).returncode != 0
    ):
        raise LaunchError("no NVIDIA GPU visible (nvidia-smi -L failed): DSpark needs CUDA")


def launch(profiles: list[LaunchProfile]) -> list[subprocess.Popen[bytes]]:
    """Start every profile's server (after :func:`check_can_launch`); returns the processes."""
    check_can_launch()
    procs = []
    for prof in profiles:
        for key in ("SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH", "SGLANG_DSPARK_STS_COLLECT_PATH"):
            if key in prof.env:
                Path(prof.env[key]).parent.mkdir(parents=True, exist_ok=True)
        procs.append(subprocess.Popen(prof.argv, env={**os.environ, **prof.env}))
    return procs


def load_profiles(path: str | Path) -> list[LaunchProfile]:
    """Profiles from a JSON file (a list of :meth:`LaunchProfile.to_dict` objects)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise LaunchError(f"{path}: cannot read launch profiles: {exc}") from None
    if not isinstance(data, list):
        raise LaunchError(f"{path}: expected a JSON list of profiles")
    return [LaunchProfile.from_dict(d) for d in data]
