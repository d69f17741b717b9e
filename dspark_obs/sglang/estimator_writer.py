"""SGLang 0.5.23's block-accept estimator JSONL (``SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH``),
written from req-step rows: the one encoder of that format. The engine server writes its file
with :class:`EstimatorWriter`; test generators render their lines with :func:`estimator_line`
and :func:`eos_line`. The one decoder is ``dspark_obs.analytics.estimator_jsonl``.

A line per request per verify step, of pure-temperature rows only (SGLang's recorder skips
greedy, top-k and top-p rows: :func:`~dspark_obs.analytics.estimator_recorder.
sglang_skips_estimator`), ``trimmed_tokens`` / ``q_lp`` on a censored block, ``pg`` when a
later step resolves earlier censored blocks, and ``{"rid", "eos_end": [...]}`` when a request
ends on EOS with blocks still unresolved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from dspark_obs.analytics.estimator_recorder import sglang_skips_estimator

__all__ = ["FLUSH_STEPS", "EstimatorWriter", "eos_line", "estimator_line", "recorded"]

FLUSH_STEPS = 16
"""Steps between flushes of the file (a finished request's lines are flushed at once)."""

_ENCODE = msgspec.json.Encoder()


def estimator_line(row: Mapping[str, Any]) -> dict[str, Any]:
    """The line of one req-step row (store names: ``forward_ct``, ``verify_len``...)."""
    line: dict[str, Any] = {
        "rid": row["rid"],
        "fct": int(row["forward_ct"]),
        "w": int(row["verify_len"]) - 1,
        "cl": int(row["correct_drafts"]),
        "ct": int(row["cap_trim"]),
    }
    if row.get("trimmed_tokens"):
        line["trimmed_tokens"] = [int(t) for t in row["trimmed_tokens"]]
        line["q_lp"] = [float(x) for x in row["q_lp"]]
    if row.get("pg"):
        line["pg"] = [
            [
                int(e["src_fct"]),
                int(e["k"]),
                float(e["target_logprob"]),
                int(e["draft_token"]),
                int(e["realized_token"]),
            ]
            for e in row["pg"]
        ]
    return line


def eos_line(rid: str, unresolved: Sequence[int]) -> dict[str, Any]:
    """SGLang's marker of a request that ended on EOS with censored blocks unresolved."""
    return {"rid": rid, "eos_end": sorted(int(f) for f in unresolved)}


def recorded(row: Mapping[str, Any]) -> bool:
    """Whether SGLang's recorder writes this row (absent settings: greedy, no top-k/top-p)."""
    top_k, top_p = row.get("top_k"), row.get("top_p")
    return not sglang_skips_estimator(
        row.get("temperature") or 0.0,
        -1 if top_k is None else int(top_k),
        1.0 if top_p is None else float(top_p),
    )


class EstimatorWriter:
    """Appends a server's estimator lines to one file, tracking each request's censored blocks
    still unresolved (for its ``eos_end`` marker). ``path`` None: writes nothing."""

    def __init__(self, path: Path | None) -> None:
        self._fh = open(path, "ab") if path is not None else None  # noqa: SIM115
        self._open: dict[str, dict[int, int]] = {}  # rid -> {src_fct: drafts left to resolve}
        self._steps = 0

    def rows(self, rows: Sequence[Mapping[str, Any]], steps: int) -> None:
        """The req-step rows of ``steps`` decode steps; flushes every :data:`FLUSH_STEPS`."""
        if self._fh is None:
            return
        for r in rows:
            if not recorded(r):
                self._open.pop(r["rid"], None)
                continue
            line = estimator_line(r)
            self._track(self._open.setdefault(r["rid"], {}), line)
            self._fh.write(_ENCODE.encode(line) + b"\n")
        self._steps += steps
        if self._steps >= FLUSH_STEPS:
            self.flush()

    @staticmethod
    def _track(pending: dict[int, int], line: Mapping[str, Any]) -> None:
        if "trimmed_tokens" in line:
            pending[line["fct"]] = len(line["trimmed_tokens"])
        for src, _k, _lp, draft, realized in line.get("pg", ()):
            left = pending.get(src)
            if left is None:
                continue
            if realized != draft or left <= 1:  # resolution stops at the first mismatch
                pending.pop(src)
            else:
                pending[src] = left - 1

    def eos(self, rid: str) -> None:
        """A request ended on EOS: name its unresolved blocks (SGLang's eos_end marker)."""
        pending = self._open.get(rid)
        if self._fh is not None and pending:
            self._fh.write(_ENCODE.encode(eos_line(rid, pending)) + b"\n")

    def forget(self, rid: str) -> None:
        self._open.pop(rid, None)

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            self._steps = 0

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
