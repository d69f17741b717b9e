"""Reading a small JSON file from outside (cost tables, STS calibrations) without surprises.

Why: ``json.loads`` on arbitrary bytes can raise ``UnicodeDecodeError``, ``RecursionError``
(deeply nested arrays), or build a multi-gigabyte object; callers want one clear message
naming the file instead. The size cap bounds memory before anything is parsed, and the
nesting check runs on the raw text, so a 100k-deep ``[[[...`` never reaches the parser.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_JSON_BYTES", "read_json_file", "too_deep"]

MAX_JSON_BYTES = 16 * 2**20
"""Largest JSON file read (16 MiB): cost tables and STS files are a few KiB."""

MAX_DEPTH = 32
"""Deepest nesting of arrays / objects accepted (the real formats nest two levels)."""


def _refuse_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name} is not allowed")


def too_deep(text: str, limit: int) -> bool:
    """Whether arrays / objects nest deeper than ``limit``, judged on the raw text (strings
    skipped), so that no parser recursion is ever reached."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def read_json_file(path: str | os.PathLike[str], error: type[Exception]) -> Any:
    """Parsed JSON of ``path``; any problem raises ``error("<path>: <what is wrong>")``.

    NaN / Infinity literals are refused, as are files over :data:`MAX_JSON_BYTES` and nesting
    deeper than :data:`MAX_DEPTH`.
    """
    source = str(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise error(f"{source}: cannot read file ({exc.strerror or exc})") from None
    if len(raw) > MAX_JSON_BYTES:
        raise error(f"{source}: larger than {MAX_JSON_BYTES // 2**20} MiB; not a JSON table")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{source}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    if too_deep(text, MAX_DEPTH):
        raise error(f"{source}: JSON nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, too many int digits
        raise error(f"{source}: not valid JSON ({exc})") from None
