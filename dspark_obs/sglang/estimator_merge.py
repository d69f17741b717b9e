"""Block-accept estimator lines meeting the request-steps they belong to, as the collector
tails SGLang's JSONL (``SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH``).

Rules, from the recorder's code (``dspark_block_accept_estimator.py``): one line per
pure-temperature request row per verify step, written in forward_ct order, buffered (flushed
every 16 steps and at prefill); greedy and truncated rows get no line; a restarted server
reopens the file with ``"w"``. So:

* a line waits (never dropped) until its step is read from the ring and stored with it;
* a request-step waits for its line until the file has passed its forward_ct, or its rank
  has run ``FLUSHED_AFTER`` forward_cts past it (the recorder has flushed since: any line it
  had is in the file), or ``hold_s`` (an idle server holds its last lines in its buffer);
* a line whose step was already stored without it (late) is appended to ``late_path`` and
  counted, not lost.

Keys are ``(rid, server forward_ct)``: rids are unique per request and a request lives on
one DP rank, so a line needs no rank.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from dspark_obs.analytics.estimator import parse_estimator_lines
from dspark_obs.schema import PG_TYPE, REQ_STEPS

__all__ = ["EstimatorMerge", "JsonlTail"]

_FIELDS = (
    ("trimmed_tokens", pa.list_(pa.int32())),
    ("q_lp", pa.list_(pa.float32())),
    ("pg", pa.list_(PG_TYPE)),
)
FCT = "_server_fct"  # held rows carry their server forward_ct (stored = server + offset)
FLUSHED_AFTER = 17
"""The recorder flushes every 16 decode steps and at every prefill, one step after settling
(CUDA): 17 forward_cts past a step, that step's line, if any, is in the file."""


class JsonlTail:
    """Complete lines appended to a file since the last read (a partial last line waits); a
    file truncated or rewritten from its start is read again from 0."""

    def __init__(self, path: Path, offset: int = 0, head: str = "") -> None:
        self.path = path
        self.offset = offset
        self.head = head  # the file's first bytes when it was last read

    def read(self) -> list[str]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        with open(self.path, "rb") as fh:
            head = fh.read(256).decode("utf-8", errors="replace")
            if size < self.offset or (self.head and not head.startswith(self.head[: len(head)])):
                self.offset = 0
            self.head = head
            fh.seek(self.offset)
            data = fh.read()
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        return data[: end + 1].decode("utf-8", errors="replace").splitlines()


class EstimatorMerge:
    """Lines read, request-steps held, and the merge of the two (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        run_id: str,
        *,
        hold_s: float,
        late_path: Path | None,
        clock: Callable[[], float],
    ) -> None:
        self.tail = JsonlTail(path)
        self.run_id = run_id
        self.hold_s = hold_s
        self.late_path = late_path
        self.clock = clock
        self.lines: dict[tuple[str, int], dict[str, Any]] = {}  # (rid, server fct) -> fields
        self.watermark = -1  # the highest forward_ct the file has reached
        self.held: list[tuple[float, pa.Table]] = []

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        return {
            "estimator": [[r, f, _jsonable(v)] for (r, f), v in self.lines.items()],
            "estimator_watermark": self.watermark,
            "estimator_offset": self.tail.offset,
            "estimator_head": self.tail.head,
        }

    def load(self, data: Mapping[str, Any]) -> None:
        self.lines = {(str(r), int(f)): v for r, f, v in data.get("estimator", [])}
        self.watermark = int(data.get("estimator_watermark", -1))
        self.tail.offset = int(data.get("estimator_offset", 0))
        self.tail.head = str(data.get("estimator_head", ""))

    def held_min_per_rank(self) -> dict[int, int]:
        """Lowest held server forward_ct per DP rank (not stored: to be read again)."""
        out: dict[int, int] = {}
        for _, tab in self.held:
            mins = tab.group_by("dp_rank").aggregate([(FCT, "min")])
            for dp, low in zip(
                mins["dp_rank"].to_pylist(), mins[f"{FCT}_min"].to_pylist(), strict=True
            ):
                out[dp] = min(out.get(dp, low), low)
        return out

    @property
    def held_rows(self) -> int:
        return sum(t.num_rows for _, t in self.held)

    # ------------------------------------------------------------------ flow

    def read(self, gamma: int | None) -> tuple[int, list[str]]:
        """New complete lines: (how many, problems of the bad ones)."""
        lines = self.tail.read()
        if not lines:
            return 0, []
        frame, errors = parse_estimator_lines(lines, gamma=gamma, run_id=self.run_id)
        for rid, fct, t, q, pg in zip(
            frame["rid"],
            frame["forward_ct"],
            frame["trimmed_tokens"],
            frame["q_lp"],
            frame["pg"],
            strict=True,
        ):
            self.lines[(str(rid), int(fct))] = {
                "trimmed_tokens": _none_if_nan(t),
                "q_lp": _none_if_nan(q),
                "pg": _none_if_nan(pg),
            }
            self.watermark = max(self.watermark, int(fct))
        return len(frame), [f"{self.tail.path}: line +{e.line}: {e.reason}" for e in errors]

    def hold(self, req_steps: pa.Table, offset: int) -> None:
        server_fct = pc.subtract(req_steps.column("forward_ct"), offset)
        self.held.append((self.clock(), req_steps.append_column(FCT, server_fct)))

    def release(self, final: bool, newest: Mapping[int, int] | None = None) -> list[pa.Table]:
        """Held request-steps ready to store (merged): their line is in, the file has passed
        them, their rank's ``newest`` server forward_ct is ``FLUSHED_AFTER`` past them, or
        they waited ``hold_s`` (all of them when ``final``)."""
        now = self.clock()
        keep, ready = [], []
        for since, tab in self.held:
            fct = tab.column(FCT)
            keys = zip(tab.column("rid").to_pylist(), fct.to_pylist(), strict=True)
            have = pa.array([k in self.lines for k in keys], pa.bool_())
            done = pc.or_(have, pc.less(fct, self.watermark))
            if newest:
                ranks = tab.column("dp_rank").to_pylist()
                lim = pa.array([newest.get(r, -1) - FLUSHED_AFTER for r in ranks], pa.int64())
                done = pc.or_(done, pc.less_equal(fct, lim))
            if final or now - since >= self.hold_s:
                done = pa.array([True] * tab.num_rows)
            out, wait = tab.filter(done), tab.filter(pc.invert(done))
            if out.num_rows:
                ready.append(self._merge(out))
            if wait.num_rows:
                keep.append((since, wait))
        self.held = keep
        return ready

    def keep_late(self, stored_hwm: int) -> int:
        """Lines of steps already stored without them (server forward_ct <= ``stored_hwm``,
        below every held row): appended to ``late_path``; returns how many."""
        held = [min(t.column(FCT).to_pylist()) for _, t in self.held if t.num_rows]
        below = min(held, default=None)
        late = [k for k in self.lines if k[1] <= stored_hwm and (below is None or k[1] < below)]
        if not late:
            return 0
        text = "".join(
            json.dumps(
                {"run_id": self.run_id, "rid": r, "fct": f, **_jsonable(self.lines.pop((r, f)))}
            )
            + "\n"
            for r, f in late
        )
        if self.late_path is not None:
            self.late_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.late_path, "a") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
        return len(late)

    def new_epoch(self) -> None:
        """A restarted server starts its file (and forward_ct) over."""
        self.watermark = -1

    def _merge(self, tab: pa.Table) -> pa.Table:
        rids = tab.column("rid").to_pylist()
        fcts = tab.column(FCT).to_pylist()
        tab = tab.drop_columns([FCT])
        found = [self.lines.pop((r, f), None) for r, f in zip(rids, fcts, strict=True)]
        if not any(found):
            return tab
        for name, typ in _FIELDS:
            values = [None if f is None else f[name] for f in found]
            i = tab.schema.get_field_index(name)
            tab = tab.set_column(i, REQ_STEPS.field(name), pa.array(values, type=typ))
        return tab


def _none_if_nan(v: Any) -> Any:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return list(v) if not isinstance(v, list) else v


def _jsonable(fields: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in fields.items():
        if v is None:
            out[k] = None
        elif k == "pg":
            out[k] = [dict(x) if isinstance(x, Mapping) else list(x) for x in v]
        else:
            out[k] = [float(x) if k == "q_lp" else int(x) for x in v]
    return out
