"""Shared pieces of the workloads: the Prompt record, stable hashing and split assignment.

Splits are decided by a stable hash (sha256) of a *normalized* key, never by position or
by Python's salted ``hash``, so the same text lands in the same split on every machine.
Each workload picks its own key so that near copies share it (see the workload modules).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "EVAL_FRACTION",
    "SPLITS",
    "WORKLOADS",
    "Prompt",
    "derive_seed",
    "normalize_text",
    "split_of",
    "stable_hash",
]

WORKLOADS: tuple[str, ...] = ("math", "chat", "poetry")
SPLITS: tuple[str, ...] = ("train", "eval")
EVAL_FRACTION = 0.2  # share of split units (templates / prompts / poem blocks) held out

_ROLES = ("system", "user", "assistant")
_NON_ALNUM = re.compile(r"[^0-9a-z]+")


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text`` that is the same on every run and machine."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def derive_seed(*parts: object) -> int:
    """A non-negative 63-bit seed derived from ``parts`` (stable across runs)."""
    return stable_hash("\x1f".join(str(p) for p in parts)) & ((1 << 63) - 1)


def normalize_text(text: str) -> str:
    """Lower-case NFKC text with every run of non-alphanumerics collapsed to one space."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    return _NON_ALNUM.sub(" ", folded).strip()


def split_of(key: str, eval_fraction: float = EVAL_FRACTION) -> str:
    """``"eval"`` for about ``eval_fraction`` of keys, ``"train"`` for the rest."""
    bucket = stable_hash("dspark-obs/split\x1f" + key) % 10_000
    return "eval" if bucket < round(eval_fraction * 10_000) else "train"


def check_messages(messages: object) -> list[dict[str, str]]:
    """Validate chat messages; return a fresh list of ``{"role", "content"}`` dicts."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or set(msg) != {"role", "content"}:
            raise ValueError(f"messages[{i}] must be an object with exactly 'role' and 'content'")
        role, content = msg["role"], msg["content"]
        if role not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {_ROLES}, got {role!r}")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"messages[{i}].content must be a non-empty string")
        out.append({"role": role, "content": content})
    if out[-1]["role"] != "user":
        raise ValueError("the last message must have role 'user'")
    return out


@dataclass(slots=True)
class Prompt:
    """One prompt: chat messages for the engine's chat template, plus a reference answer.

    ``meta`` carries provenance (source package, template id, author...), JSON-serializable.
    """

    id: str
    workload: str
    messages: list[dict[str, str]]
    reference: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """Content of the last user message."""
        return self.messages[-1]["content"]

    def copy(self) -> Prompt:
        """An independent copy (callers may mutate it freely)."""
        return Prompt(
            self.id,
            self.workload,
            [dict(m) for m in self.messages],
            self.reference,
            dict(self.meta),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return {
            "id": self.id,
            "workload": self.workload,
            "messages": [dict(m) for m in self.messages],
            "reference": self.reference,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: object) -> Prompt:
        """Build from :meth:`to_dict` output; raise ValueError on anything malformed."""
        if not isinstance(data, dict):
            raise ValueError("prompt must be an object")
        unknown = set(data) - {"id", "workload", "messages", "reference", "meta"}
        if unknown:
            raise ValueError(f"unknown prompt keys: {sorted(unknown)}")
        pid, workload = data.get("id"), data.get("workload")
        if not isinstance(pid, str) or not pid:
            raise ValueError("prompt.id must be a non-empty string")
        if not isinstance(workload, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", workload):
            raise ValueError("prompt.workload must match [a-z][a-z0-9_]{0,31}")
        reference = data.get("reference")
        if reference is not None and not isinstance(reference, str):
            raise ValueError("prompt.reference must be a string or null")
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError("prompt.meta must be an object")
        messages = check_messages(data.get("messages"))
        return cls(pid, workload, messages, reference, dict(meta))
