"""Mixed traffic: requests from several workloads with Poisson-like arrivals, and JSONL I/O.

Arrivals are in decode-step units: gaps between consecutive requests are exponential with
mean ``1 / rate`` steps, and ``arrival_step`` is the floor of the running sum (the first
request arrives at step 0). ``rate=None`` makes every request arrive at step 0.

Workload file (``save_traffic`` / ``load_traffic``, replayed by ``dspark-obs run
--workload-file``): one JSON object per line, UTF-8, blank lines ignored::

    {"rid": "00000-math-t07-012", "arrival_step": 0, "max_new_tokens": 256,
     "temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": 123,
     "prompt": {"id": ..., "workload": "math", "messages": [...], "reference": ..., "meta": {}}}

Only ``prompt`` is required when writing a file by hand; it may also be a plain string (one
user message, workload ``custom``). Missing fields take the defaults of :class:`TrafficRequest`.
``top_k = -1`` means no top-k (SGLang's convention); ``temperature = 0`` means greedy.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_obs._atomic import write_text_atomic
from dspark_obs._jsonfile import MAX_DEPTH, too_deep
from dspark_obs.workloads.base import SPLITS, WORKLOADS, Prompt, derive_seed, stable_hash
from dspark_obs.workloads.catalog import load_prompts

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_RATE",
    "TrafficRequest",
    "WorkloadFileError",
    "load_traffic",
    "mixed_traffic",
    "save_traffic",
]

DEFAULT_MAX_NEW_TOKENS: dict[str, int] = {"math": 256, "chat": 256, "poetry": 128}
FALLBACK_MAX_NEW_TOKENS = 256  # for custom workload labels in hand-written files
DEFAULT_RATE = 0.1  # requests per decode step
_FIELDS = ("rid", "arrival_step", "max_new_tokens", "temperature", "top_p", "top_k", "seed")


class WorkloadFileError(ValueError):
    """A workload file line is not a valid request (``lineno`` is 1-based)."""

    def __init__(self, path: str | os.PathLike[str], lineno: int, message: str) -> None:
        super().__init__(f"{path}:{lineno}: {message}")
        self.path = str(path)
        self.lineno = lineno


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]


@dataclass(slots=True)
class TrafficRequest:
    """One request of a traffic trace: a prompt, when it arrives and how to sample it."""

    prompt: Prompt
    arrival_step: int = 0
    max_new_tokens: int = FALLBACK_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    rid: str = ""  # unique within a trace; "" -> filled from the position when saved/loaded

    def validate(self) -> None:
        """Raise ValueError if a field is out of range."""
        if not _is_int(self.arrival_step) or self.arrival_step < 0:
            raise ValueError(f"arrival_step must be an int >= 0, got {self.arrival_step!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or an int >= 1, got {self.top_k!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.rid, str):
            raise ValueError(f"rid must be a string, got {self.rid!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (one workload-file line)."""
        out: dict[str, Any] = {name: getattr(self, name) for name in _FIELDS}
        out["temperature"] = float(self.temperature)
        out["top_p"] = float(self.top_p)
        out["prompt"] = self.prompt.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: object) -> TrafficRequest:
        """Parse one workload-file object; raise ValueError on anything malformed."""
        if not isinstance(data, dict):
            raise ValueError("a request must be a JSON object")
        unknown = set(data) - {*_FIELDS, "prompt"}
        if unknown:
            raise ValueError(f"unknown keys: {sorted(unknown)}")
        if "prompt" not in data:
            raise ValueError("missing 'prompt'")
        raw = data["prompt"]
        if isinstance(raw, str):
            if not raw.strip():
                raise ValueError("prompt must not be empty")
            prompt = Prompt(
                id=f"custom-{stable_hash(raw):016x}",
                workload="custom",
                messages=[{"role": "user", "content": raw}],
            )
        else:
            try:
                prompt = Prompt.from_dict(raw)
            except ValueError as exc:
                raise ValueError(f"prompt: {exc}") from None
        default_tokens = DEFAULT_MAX_NEW_TOKENS.get(prompt.workload, FALLBACK_MAX_NEW_TOKENS)
        request = cls(
            prompt=prompt,
            arrival_step=data.get("arrival_step", 0),
            max_new_tokens=data.get("max_new_tokens", default_tokens),
            temperature=data.get("temperature", 0.0),
            top_p=data.get("top_p", 1.0),
            top_k=data.get("top_k", -1),
            seed=data.get("seed", 0),
            rid=data.get("rid", ""),
        )
        request.validate()
        return request


def _per_workload(
    value: Any, name: str, default: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    if isinstance(value, Mapping):
        unknown = set(value) - set(WORKLOADS)
        if unknown:
            raise ValueError(f"{name}: unknown workloads {sorted(unknown)}")
        base = dict(default or {})
        if default is None and set(value) != set(WORKLOADS):
            missing = sorted(set(WORKLOADS) - set(value))
            raise ValueError(f"{name}: no value for workloads {missing}")
        base.update(value)
        return base
    if value is None:
        if default is None:
            raise ValueError(f"{name} is required")
        return dict(default)
    return dict.fromkeys(WORKLOADS, value)


def _counts(n: int, shares: Mapping[str, float]) -> dict[str, int]:
    """Split ``n`` by ``shares`` with largest remainders (ties: WORKLOADS order)."""
    total = float(sum(shares.values()))
    exact = {w: n * shares[w] / total for w in shares}
    counts = {w: math.floor(x) for w, x in exact.items()}
    order = sorted(shares, key=lambda w: (-(exact[w] - counts[w]), WORKLOADS.index(w)))
    for w in order[: n - sum(counts.values())]:
        counts[w] += 1
    return counts


def mixed_traffic(
    n: int,
    shares: Mapping[str, float] | None = None,
    seed: int = 0,
    split: str = "eval",
    *,
    rate: float | None = DEFAULT_RATE,
    max_new_tokens: int | Mapping[str, int] | None = None,
    temperature: float | Mapping[str, float] = 0.0,
    top_p: float = 1.0,
    top_k: int = -1,
) -> list[TrafficRequest]:
    """``n`` requests mixed by ``shares`` (default equal), ordered by arrival step.

    Per-workload counts use largest remainders, so they sum to ``n`` exactly. Prompts
    are ``load_prompts(workload, split, count, seed)``; the interleaving, the arrival gaps
    and each request's sampling seed derive from ``seed``. ``max_new_tokens`` and
    ``temperature`` take one value or a per-workload mapping (defaults:
    :data:`DEFAULT_MAX_NEW_TOKENS`, greedy). ``rate`` is requests per decode step.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    shares = dict.fromkeys(WORKLOADS, 1.0) if shares is None else dict(shares)
    unknown = set(shares) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown workloads in shares: {sorted(unknown)}; expected {WORKLOADS}")
    if any(not _is_real(v) or v < 0 for v in shares.values()) or sum(shares.values()) <= 0:
        raise ValueError(f"shares must be non-negative numbers with a positive sum: {shares}")
    if rate is not None and (not _is_real(rate) or rate <= 0):
        raise ValueError(f"rate must be a positive number or None, got {rate!r}")
    tokens = _per_workload(max_new_tokens, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    temps = _per_workload(temperature, "temperature", dict.fromkeys(WORKLOADS, 0.0))

    prompts: list[Prompt] = []
    for workload, count in _counts(n, shares).items():
        prompts.extend(load_prompts(workload, split, count, seed) if count else [])
    rng = random.Random(derive_seed("mixed_traffic", split, seed))
    rng.shuffle(prompts)

    out: list[TrafficRequest] = []
    clock = 0.0
    for i, prompt in enumerate(prompts):
        if i and rate is not None:
            clock += rng.expovariate(rate)
        request = TrafficRequest(
            prompt=prompt,
            arrival_step=int(clock),
            max_new_tokens=tokens[prompt.workload],
            temperature=float(temps[prompt.workload]),
            top_p=top_p,
            top_k=top_k,
            seed=derive_seed("request", seed, i) % 2**31,
            rid=f"{i:05d}-{prompt.id}",
        )
        request.validate()
        out.append(request)
    return out


def save_traffic(path: str | os.PathLike[str], requests: Iterable[TrafficRequest]) -> Path:
    """Write ``requests`` as a workload file (JSONL), atomically; return the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    rids: set[str] = set()
    for i, request in enumerate(requests):
        request.validate()
        row = request.to_dict()
        row["rid"] = row["rid"] or f"{i:05d}-{request.prompt.id}"
        if row["rid"] in rids:
            raise ValueError(f"duplicate rid {row['rid']!r} (request {i})")
        rids.add(row["rid"])
        lines.append(json.dumps(row, ensure_ascii=False) + "\n")
    return write_text_atomic(target, "".join(lines))


def load_traffic(path: str | os.PathLike[str]) -> list[TrafficRequest]:
    """Read a workload file, ordered by arrival step (stable for ties).

    A bad line raises :class:`WorkloadFileError` naming its 1-based line number.
    """
    out: list[TrafficRequest] = []
    rids: dict[str, int] = {}
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise WorkloadFileError(path, lineno, "not valid UTF-8") from None
            if not line.strip():
                continue
            if too_deep(line, MAX_DEPTH):  # judged on the text: the parser never recurses
                raise WorkloadFileError(path, lineno, f"JSON nested deeper than {MAX_DEPTH} levels")
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadFileError(path, lineno, f"invalid JSON: {exc.msg}") from None
            except (ValueError, RecursionError) as exc:  # e.g. an int of 5,000 digits
                raise WorkloadFileError(path, lineno, f"invalid JSON: {exc}") from None
            try:
                request = TrafficRequest.from_dict(data)
            except ValueError as exc:
                raise WorkloadFileError(path, lineno, str(exc)) from None
            request.rid = request.rid or f"{len(out):05d}-{request.prompt.id}"
            if request.rid in rids:
                first = rids[request.rid]
                raise WorkloadFileError(
                    path, lineno, f"duplicate rid {request.rid!r} (first on line {first})"
                )
            rids[request.rid] = lineno
            out.append(request)
    out.sort(key=lambda r: r.arrival_step)
    return out
