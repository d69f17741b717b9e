"""SGLang's STS calibration JSON: one reader and writer for the engine, the CLI and analytics.

``{"temperatures", "dataset", "num_samples", "ece_before", "ece_after"}``: SGLang 0.5.23
requires only non-empty, all-positive temperatures and ignores unknown keys. Two readers share
one check of the temperatures: :func:`load_temperatures` takes what a server would (the
drafter serving a file), :meth:`StsCalibration.load` checks every field (a fitted record).
Both are bounded (size and nesting capped before parsing, :mod:`dspark_obs._jsonfile`) and
name the file and the problem in every error. A file format, not analytics or engine code.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dspark_obs._jsonfile import read_json_file

__all__ = ["MAX_GAMMA", "StsCalibration", "StsFileError", "load_temperatures"]

MAX_GAMMA = 64
"""Most positions accepted from an STS file or shard (SGLang deploys gamma 5..7)."""


class StsFileError(ValueError):
    """An STS JSON or shard that cannot be used; the message names the file and the problem."""


@dataclass
class StsCalibration:
    """SGLang's STS JSON, field for field."""

    temperatures: list[float]
    dataset: str = ""
    num_samples: int = 0
    ece_before: list[float] = field(default_factory=list)
    ece_after: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        problem = _temperature_problem(self.temperatures)
        if problem:
            raise StsFileError(f"<StsCalibration>: {problem}")

    @property
    def gamma(self) -> int:
        return len(self.temperatures)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object; an ECE list holding NaN is left out (SGLang's loader wants floats)."""
        out: dict[str, Any] = {
            "temperatures": [float(t) for t in self.temperatures],
            "dataset": str(self.dataset),
            "num_samples": int(self.num_samples),
        }
        for name in ("ece_before", "ece_after"):
            values = [float(v) for v in getattr(self, name)]
            if all(math.isfinite(v) for v in values):
                out[name] = values
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def from_json(
        cls, text: str, source: str = "<string>", gamma: int | None = None
    ) -> StsCalibration:
        """Parse and validate; every error names ``source`` and what is wrong."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise StsFileError(f"{source}: not valid JSON ({exc})") from None
        return cls.from_dict(data, source=source, gamma=gamma)

    @classmethod
    def from_dict(
        cls, data: Any, source: str = "<dict>", gamma: int | None = None
    ) -> StsCalibration:
        temps = _temperatures(data, source)
        n = len(temps)
        if gamma is not None and n != gamma:
            raise StsFileError(f"{source}: has {n} temperatures but gamma is {gamma}")
        dataset = data.get("dataset", "")
        if not isinstance(dataset, str):
            raise StsFileError(f"{source}: 'dataset' must be a string, got {_short(dataset)}")
        num = data.get("num_samples", 0)
        if isinstance(num, bool) or not isinstance(num, int) or num < 0:
            raise StsFileError(
                f"{source}: 'num_samples' must be a non-negative integer, got {_short(num)}"
            )
        lists = {}
        for name in ("ece_before", "ece_after"):
            v = data.get(name, [])
            if not isinstance(v, list) or any(
                isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x <= 1 for x in v
            ):
                raise StsFileError(f"{source}: '{name}' must be a list of ECE values in [0, 1]")
            if v and len(v) != n:
                raise StsFileError(
                    f"{source}: '{name}' has {len(v)} values but there are {n} temperatures"
                )
            lists[name] = [float(x) for x in v]
        return cls(temps, dataset, num, lists["ece_before"], lists["ece_after"])

    @classmethod
    def load(cls, path: str | os.PathLike[str], gamma: int | None = None) -> StsCalibration:
        """Read and validate a file; any bytes give an :class:`StsFileError` naming it."""
        return cls.from_dict(read_json_file(path, StsFileError), source=str(path), gamma=gamma)


def load_temperatures(path: str | os.PathLike[str]) -> list[float]:
    """Only the temperatures of an STS file, judged as SGLang's server judges a file it serves
    (non-empty, all finite and > 0; other keys ignored, so an ECE list that does not match
    them is no reason to refuse them). Same bounded reading as :meth:`StsCalibration.load`."""
    return _temperatures(read_json_file(path, StsFileError), str(path))


def _temperatures(data: Any, source: str) -> list[float]:
    if not isinstance(data, Mapping):
        raise StsFileError(f"{source}: expected a JSON object, got {type(data).__name__}")
    if "temperatures" not in data:
        raise StsFileError(f"{source}: missing required key 'temperatures'")
    temps = data["temperatures"]
    problem = _temperature_problem(temps)
    if problem:
        raise StsFileError(f"{source}: {problem}")
    if len(temps) > MAX_GAMMA:
        raise StsFileError(f"{source}: {len(temps)} temperatures; at most {MAX_GAMMA} positions")
    return [float(t) for t in temps]


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else f"{text[:40]}... ({type(v).__name__})"


def _temperature_problem(temps: Any) -> str | None:
    if not isinstance(temps, list | tuple) or len(temps) == 0:
        return "'temperatures' must be a non-empty list"
    for i, t in enumerate(temps):
        if isinstance(t, bool) or not isinstance(t, int | float | np.floating | np.integer):
            return f"temperatures[{i}] = {_short(t)} is not a number"
        if not 0 < t <= 1e30:  # compared exactly (a 400-digit int does not overflow); NaN fails
            return f"temperatures[{i}] = {_short(t)} must be finite and > 0"
    return None
