"""SGLang's block-accept estimator JSONL, read from any bytes without a traceback.

Every line is judged on its own: invalid UTF-8, invalid or too deeply nested JSON, huge
integers, wrong types, values out of range are each reported as a :class:`JsonlError` with
the 1-based line number and the field, and the valid lines are kept. Memory stays bounded
whatever the file holds: a line longer than :data:`MAX_LINE_BYTES` is skipped without being
held whole, block sizes (``w`` and ``gamma``) above :data:`MAX_GAMMA` are refused (so no
per-position array is sized by a number from the file), and at most :data:`MAX_ERRORS` errors
are listed (the last entry counts the rest).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import pandas as pd

from dspark_obs._jsonfile import too_deep

__all__ = [
    "MAX_GAMMA",
    "EstimatorFileError",
    "JsonlError",
    "parse_estimator_lines",
    "read_estimator_jsonl",
]

MAX_GAMMA = 64
"""Largest block size accepted from a file (SGLang deploys 5..7)."""

MAX_LINE_BYTES = 1 << 20
"""Longest line parsed (1 MiB); a real record is a few hundred bytes."""

MAX_ERRORS = 10_000
"""Errors listed one by one; beyond it one summary entry counts the rest."""

MAX_ID = 2**62
"""Largest forward count / token id / cap_trim accepted (fits int64 with room)."""

MAX_DEPTH = 8
"""Deepest JSON nesting accepted on a line (records nest three levels)."""


class EstimatorFileError(ValueError):
    """The estimator file itself cannot be read (missing, a directory, unreadable)."""


@dataclass(frozen=True)
class JsonlError:
    """One rejected line of an estimator JSONL file."""

    line: int
    reason: str
    text: str = ""

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else f"{text[:40]}... ({type(v).__name__})"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -MAX_ID <= v <= MAX_ID


def _is_num(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    return isinstance(v, float) or -MAX_ID <= v <= MAX_ID


def _check_record(obj: dict[str, Any]) -> str | None:
    """Structural problems of one step record (types, lengths); None when fine."""
    missing = [k for k in ("rid", "fct", "w", "cl", "ct") if k not in obj]
    if missing:
        return f"missing key(s) {missing}"
    if not isinstance(obj["rid"], str):
        return f"'rid' must be a string, got {_short(obj['rid'])}"
    for k in ("fct", "w", "cl", "ct"):
        if not _is_int(obj[k]):
            return f"'{k}' must be an integer, got {_short(obj[k])}"
    if obj["fct"] < 0:
        return f"'fct' must be >= 0, got {obj['fct']}"
    if not 0 <= obj["w"] <= MAX_GAMMA:
        return f"'w' must be in 0..{MAX_GAMMA} (the block size cap), got {obj['w']}"
    if not 0 <= obj["cl"] <= obj["w"]:
        return f"need 0 <= cl <= w, got cl={obj['cl']} w={obj['w']}"
    if obj["ct"] < 0:
        return f"'ct' must be >= 0, got {obj['ct']}"
    has_t, has_q = "trimmed_tokens" in obj, "q_lp" in obj
    if has_t != has_q:
        return "'trimmed_tokens' and 'q_lp' must come together"
    if has_t:
        t, q = obj["trimmed_tokens"], obj["q_lp"]
        if not isinstance(t, list) or not all(_is_int(x) and x >= 0 for x in t):
            return "'trimmed_tokens' must be a list of token ids (integers >= 0)"
        if not isinstance(q, list) or not all(_is_num(x) for x in q):
            return "'q_lp' must be a list of numbers"
        if len(t) > MAX_GAMMA:
            return f"'trimmed_tokens' has {len(t)} entries, above the block size cap {MAX_GAMMA}"
        if len(t) != len(q) or not t:
            return (
                f"'trimmed_tokens' ({len(t)}) and 'q_lp' ({len(q)}) "
                "must have one equal, non-zero length"
            )
        if not all(math.isfinite(x) for x in q):
            return "'q_lp' values must be finite log-probabilities (a drafted token has q > 0)"
        if obj["cl"] != obj["w"]:
            return (
                "'trimmed_tokens' present but the window was not fully accepted "
                f"(cl={obj['cl']} < w={obj['w']})"
            )
    if "pg" in obj:
        pg = obj["pg"]
        if not isinstance(pg, list):
            return "'pg' must be a list"
        if len(pg) > MAX_GAMMA * MAX_GAMMA:
            return f"'pg' has {len(pg)} entries; more than any step can resolve"
        for j, e in enumerate(pg):
            ok = (
                isinstance(e, list)
                and len(e) == 5
                and _is_int(e[0])
                and _is_int(e[1])
                and _is_num(e[2])
                and _is_int(e[3])
                and _is_int(e[4])
            )
            if not ok:
                return (
                    f"pg[{j}] must be [src_fct, k, target_logprob, draft_token, realized_token], "
                    f"got {_short(e)}"
                )
            if math.isnan(e[2]) or e[2] == math.inf:
                return f"pg[{j}] target_logprob must be a log-probability, got {e[2]!r}"
    return None


def parse_estimator_lines(
    lines: Iterable[str | JsonlError],
    gamma: int | None = None,
    run_id: str = "sglang",
    workloads: Mapping[str, str] | None = None,
) -> tuple[pd.DataFrame, list[JsonlError]]:
    """The parser behind :func:`read_estimator_jsonl`, for any iterable of lines."""
    errors = _Errors()
    records: list[tuple[int, dict[str, Any]]] = []
    markers: list[tuple[int, str, list[int]]] = []
    seen: dict[tuple[str, int], int] = {}
    for lineno, raw in enumerate(lines, start=1):
        if isinstance(raw, JsonlError):  # the byte reader already refused this line
            errors.append(raw)
            continue
        text = raw.strip()
        if not text:
            continue
        short = text if len(text) <= 200 else text[:197] + "..."
        if len(text) > MAX_LINE_BYTES:
            errors.append(JsonlError(lineno, f"line longer than {MAX_LINE_BYTES} bytes", short))
            continue
        if too_deep(text, MAX_DEPTH):
            errors.append(JsonlError(lineno, f"JSON nested deeper than {MAX_DEPTH}", short))
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            errors.append(
                JsonlError(lineno, f"not valid JSON ({exc.msg} at column {exc.colno})", short)
            )
            continue
        except (ValueError, RecursionError) as exc:  # e.g. an integer of 5000 digits
            errors.append(JsonlError(lineno, f"not valid JSON ({exc})", short))
            continue
        if not isinstance(obj, dict):
            errors.append(
                JsonlError(lineno, f"expected a JSON object, got {type(obj).__name__}", short)
            )
            continue
        if "eos_end" in obj:
            fcts = obj["eos_end"]
            if not isinstance(obj.get("rid"), str):
                errors.append(JsonlError(lineno, "eos_end record needs a string 'rid'", short))
            elif not isinstance(fcts, list) or not all(_is_int(x) for x in fcts):
                errors.append(
                    JsonlError(lineno, "'eos_end' must be a list of integer forward counts", short)
                )
            else:
                markers.append((lineno, obj["rid"], fcts))
            continue
        problem = _check_record(obj)
        if problem:
            errors.append(JsonlError(lineno, problem, short))
            continue
        key = (obj["rid"], obj["fct"])
        if key in seen:
            errors.append(
                JsonlError(
                    lineno,
                    f"duplicate record for rid={_short(key[0])} fct={key[1]} "
                    f"(first on line {seen[key]})",
                    short,
                )
            )
            continue
        seen[key] = lineno
        records.append((lineno, obj))

    # gamma: given, or implied by censored records (w + number of trimmed drafts)
    implied = [o["w"] + len(o["trimmed_tokens"]) for _, o in records if "trimmed_tokens" in o]
    if gamma is not None and not (_is_int(gamma) and 1 <= gamma <= MAX_GAMMA):
        raise ValueError(f"gamma must be an integer in 1..{MAX_GAMMA}, got {gamma!r}")
    if gamma is None:
        if implied:
            values, counts = np.unique(implied, return_counts=True)
            gamma = int(values[counts == counts.max()].max())  # most common; ties: larger
        else:
            gamma = max((o["w"] for _, o in records), default=0)
        gamma = min(gamma, MAX_GAMMA)
    kept: list[tuple[int, dict[str, Any]]] = []
    for lineno, o in records:
        short = json.dumps(o)[:200]
        if o["w"] > gamma:
            errors.append(JsonlError(lineno, f"w={o['w']} exceeds gamma={gamma}", short))
        elif o["cl"] + o["ct"] > gamma:
            errors.append(
                JsonlError(lineno, f"cl + ct = {o['cl'] + o['ct']} exceeds gamma={gamma}", short)
            )
        elif "trimmed_tokens" in o and len(o["trimmed_tokens"]) != gamma - o["w"]:
            errors.append(
                JsonlError(
                    lineno,
                    f"{len(o['trimmed_tokens'])} trimmed tokens, "
                    f"expected gamma - w = {gamma - o['w']}",
                    short,
                )
            )
        elif "trimmed_tokens" not in o and o["cl"] == o["w"] < gamma:
            errors.append(
                JsonlError(
                    lineno, "censored record (cl == w < gamma) lacks trimmed_tokens/q_lp", short
                )
            )
        elif any(not 1 <= e[1] <= gamma for e in o.get("pg", [])):
            errors.append(JsonlError(lineno, f"pg offset k outside 1..gamma={gamma}", short))
        else:
            kept.append((lineno, o))

    index = {(o["rid"], o["fct"]): i for i, (_, o) in enumerate(kept)}
    eos = np.zeros(len(kept), dtype=bool)
    for lineno, rid, fcts in markers:
        for f in fcts:
            i = index.get((rid, f))
            if i is None:
                errors.append(
                    JsonlError(
                        lineno,
                        f"eos_end names fct={f} of rid={_short(rid)}, which has no kept record",
                    )
                )
            else:
                eos[i] = True
    wl = workloads or {}
    frame = pd.DataFrame(
        {
            "run_id": [run_id] * len(kept),
            "dp_rank": np.zeros(len(kept), dtype=np.int64),
            "rid": [o["rid"] for _, o in kept],
            "forward_ct": np.array([o["fct"] for _, o in kept], dtype=np.int64),
            "gamma": np.full(len(kept), gamma, dtype=np.int64),
            "verify_len": np.array([o["w"] + 1 for _, o in kept], dtype=np.int64),
            "correct_drafts": np.array([o["cl"] for _, o in kept], dtype=np.int64),
            "cap_trim": np.array([o["ct"] for _, o in kept], dtype=np.int64),
            "workload": [wl.get(o["rid"], "unknown") for _, o in kept],
            "trimmed_tokens": [o.get("trimmed_tokens") for _, o in kept],
            "q_lp": [o.get("q_lp") for _, o in kept],
            "pg": [
                [
                    dict(
                        zip(
                            ("src_fct", "k", "target_logprob", "draft_token", "realized_token"),
                            e,
                            strict=True,
                        )
                    )
                    for e in o["pg"]
                ]
                if "pg" in o
                else None
                for _, o in kept
            ],
            "eos_end": eos,
            "line": np.array([ln for ln, _ in kept], dtype=np.int64),
        }
    )
    return frame, errors.in_order()


def read_estimator_jsonl(
    path: str | os.PathLike[str],
    gamma: int | None = None,
    run_id: str = "sglang",
    workloads: Mapping[str, str] | None = None,
) -> tuple[pd.DataFrame, list[JsonlError]]:
    """Parse SGLang's SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH file into req_steps-like rows.

    Returns (frame, errors): bad lines (invalid JSON, missing keys, wrong types, w/cl out of
    range, inconsistent lengths, duplicates) are reported with their 1-based line number and
    skipped; the rest are kept. Frame columns: run_id, dp_rank, rid, forward_ct, gamma,
    verify_len (= w + 1), correct_drafts (= cl), cap_trim (= ct), workload (from
    ``workloads`` {rid: name}, else "unknown"), trimmed_tokens, q_lp, pg (list of dicts with
    the schema's PG field names), eos_end (block listed by an eos_end marker), line.
    ``gamma`` (the file does not state it) is inferred from censored records when not given.
    """
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below; bytes: decoding is per line
    except OSError as exc:
        raise EstimatorFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    with fh:
        try:
            return parse_estimator_lines(
                _lines(fh), gamma=gamma, run_id=run_id, workloads=workloads
            )
        except OSError as exc:  # e.g. a directory, or an I/O error half-way
            raise EstimatorFileError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _lines(fh: BinaryIO) -> Iterator[str | JsonlError]:
    """Decoded lines; a line that is not UTF-8 or too long becomes its JsonlError instead."""
    lineno = 0
    while True:
        raw = fh.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):  # skip the rest without holding it
                raw = fh.readline(MAX_LINE_BYTES)
            yield JsonlError(lineno, f"line longer than {MAX_LINE_BYTES} bytes (skipped)")
            continue
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield JsonlError(lineno, f"not UTF-8 (byte {exc.start}: {exc.reason})")


class _Errors(list):
    """A list of JsonlError that stops growing at MAX_ERRORS and counts the rest."""

    dropped = 0
    last_line = 0

    def append(self, err: JsonlError) -> None:  # type: ignore[override]
        if len(self) < MAX_ERRORS:
            super().append(err)
        else:
            self.dropped += 1
            self.last_line = max(self.last_line, err.line)

    def in_order(self) -> list[JsonlError]:
        out = sorted(self, key=lambda e: e.line)
        if self.dropped:
            out.append(JsonlError(self.last_line, f"... and {self.dropped} more bad lines"))
        return out
