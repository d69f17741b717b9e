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
* a line whose step was already stored without it (late) becomes an amendment of that row
  (the ``req_step_amends`` table, written through the store like every record; the
  ``req_steps`` view merges it). To key it like the row, every request-step released
  without a line is remembered (its rank, stored forward_ct, gamma and window) until no line
  can come for it any more: its rank ran ``FLUSHED_AFTER`` forward_cts past it and the file
  was read after that. A line that matches no such row (its row was lost in a gap, or
  stored with a line already) cannot amend anything: it is counted as an orphan.

Keys are ``(rid, server forward_ct)``: rids are unique per request and a request lives on
one DP rank, so a line needs no rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dspark_obs.analytics.estimator import parse_estimator_lines
from dspark_obs.analytics.estimator_recorder import sglang_skip_mask
from dspark_obs.schema import PG_TYPE, REQ_STEP_AMENDS, REQ_STEPS

__all__ = ["EstimatorMerge", "JsonlTail", "LateLines"]

_FIELDS = (
    ("trimmed_tokens", pa.list_(pa.int32())),
    ("q_lp", pa.list_(pa.float32())),
    ("pg", pa.list_(PG_TYPE)),
)
FCT = "_server_fct"  # held rows carry their server forward_ct (stored = server + offset)
FLUSHED_AFTER = 17
"""The recorder flushes every 16 decode steps and at every prefill, one step after settling
(CUDA): 17 forward_cts past a step, that step's line, if any, is in the file."""
MAX_UNLINED = 100_000
"""At most this many request-steps released without a line are remembered (the oldest go
first; normally a few steps' worth per rank are, see :meth:`EstimatorMerge.late`)."""


_UNLINED_COLUMNS = ("dp_rank", "forward_ct", "gamma", "verify_len")


@dataclass(frozen=True)
class LateLines:
    """Lines whose request-step was stored without them: ``amends`` (req_step_amends rows,
    to be written; then :meth:`EstimatorMerge.settle` their ``keys``) and ``orphans``, lines
    that match no stored row (counted and dropped)."""

    amends: pa.Table
    keys: list[tuple[str, int]]
    orphans: int


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
        clock: Callable[[], float],
    ) -> None:
        self.tail = JsonlTail(path)
        self.run_id = run_id
        self.hold_s = hold_s
        self.clock = clock
        self.lines: dict[tuple[str, int], dict[str, Any]] = {}  # (rid, server fct) -> fields
        self.watermark = -1  # the highest forward_ct the file has reached
        self.held: list[tuple[float, pa.Table]] = []
        # (rid, server fct) -> (dp_rank, stored forward_ct, gamma, verify_len) of a row
        # stored without its line: what a late line needs to amend it
        self.unlined: dict[tuple[str, int], tuple[int, int, int, int]] = {}

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        return {
            "estimator": [[r, f, _jsonable(v)] for (r, f), v in self.lines.items()],
            "estimator_watermark": self.watermark,
            "estimator_offset": self.tail.offset,
            "estimator_head": self.tail.head,
            "estimator_unlined": [[r, f, *v] for (r, f), v in self.unlined.items()],
        }

    def load(self, data: Mapping[str, Any]) -> None:
        self.lines = {(str(r), int(f)): v for r, f, v in data.get("estimator", [])}
        self.watermark = int(data.get("estimator_watermark", -1))
        self.tail.offset = int(data.get("estimator_offset", 0))
        self.tail.head = str(data.get("estimator_head", ""))
        self.unlined = {
            (str(r), int(f)): (int(dp), int(fct), int(g), int(v))
            for r, f, dp, fct, g, v in data.get("estimator_unlined", [])
        }

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

    def late(self, stored_hwm: int, newest: Mapping[int, int]) -> LateLines:
        """Lines of request-steps already stored without them, as amendments; orphans are
        lines below ``stored_hwm`` (server forward_ct, below every held row) that match no
        such row. Afterwards rows are forgotten once no line can come for them: their rank's
        ``newest`` server forward_ct is ``FLUSHED_AFTER`` past them (this poll read the file
        after that snapshot)."""
        keys = [k for k in self.lines if k in self.unlined]
        empty = [k for k in keys if all(v is None for v in self.lines[k].values())]
        self._forget(empty)  # a line with no estimator field (an uncensored row) changes nothing
        keys = [k for k in keys if k in self.lines]
        held = [min(t.column(FCT).to_pylist()) for _, t in self.held if t.num_rows]
        below = min(held, default=None)
        orphans = [
            k
            for k in self.lines
            if k not in self.unlined and k[1] <= stored_hwm and (below is None or k[1] < below)
        ]
        for k in orphans:
            del self.lines[k]
        rows = []
        for k in keys:
            dp, fct, gamma, verify_len = self.unlined[k]
            rows.append(
                {
                    "run_id": self.run_id,
                    "dp_rank": dp,
                    "forward_ct": fct,
                    "rid": k[0],
                    "gamma": gamma,
                    "verify_len": verify_len,
                    **self.lines[k],
                }
            )
        amends = pa.Table.from_pylist(rows, schema=REQ_STEP_AMENDS)
        late = LateLines(amends, keys, len(orphans))
        done = [
            k
            for k, (dp, *_) in self.unlined.items()
            if k not in self.lines and k[1] <= newest.get(dp, -1) - FLUSHED_AFTER
        ]
        for k in done:
            del self.unlined[k]
        return late

    def settle(self, keys: list[tuple[str, int]]) -> None:
        """The amendments of ``keys`` are stored: forget their lines and rows."""
        self._forget(keys)

    def _forget(self, keys: list[tuple[str, int]]) -> None:
        for k in keys:
            self.lines.pop(k, None)
            self.unlined.pop(k, None)

    def new_epoch(self) -> None:
        """A restarted server starts its file (and forward_ct) over: no line of the old
        epoch can come any more."""
        self.watermark = -1
        self.unlined.clear()

    def _merge(self, tab: pa.Table) -> pa.Table:
        rids = tab.column("rid").to_pylist()
        fcts = tab.column(FCT).to_pylist()
        tab = tab.drop_columns([FCT])
        found = [self.lines.pop((r, f), None) for r, f in zip(rids, fcts, strict=True)]
        self._remember_unlined(tab, rids, fcts, found)
        if not any(found):
            return tab
        for name, typ in _FIELDS:
            values = [None if f is None else f[name] for f in found]
            i = tab.schema.get_field_index(name)
            tab = tab.set_column(i, REQ_STEPS.field(name), pa.array(values, type=typ))
        return tab


    def _remember_unlined(
        self, tab: pa.Table, rids: list[str], fcts: list[int], found: list[Any]
    ) -> None:
        """Rows stored without a line that SGLang's recorder may still write one for."""
        missing = np.array([f is None for f in found], dtype=bool)
        if not missing.any():
            return
        sampling = [
            pc.fill_null(tab.column(c).cast(pa.float64()), float("nan")).to_numpy(
                zero_copy_only=False
            )
            for c in ("temperature", "top_k", "top_p")
        ]
        missing &= ~sglang_skip_mask(*sampling)  # greedy / top-k / top-p rows get no line
        missing &= np.asarray(fcts) >= self.watermark  # the file passed the others: no line
        rows = np.flatnonzero(missing)[-MAX_UNLINED:]
        if not rows.size:
            return
        take = pa.array(rows)
        cols = [tab.column(c).take(take).to_pylist() for c in _UNLINED_COLUMNS]
        for i, dp, fct, gamma, verify in zip(rows.tolist(), *cols, strict=True):
            if verify is not None:
                self.unlined[(rids[i], fcts[i])] = (dp, fct, gamma, verify)
        while len(self.unlined) > MAX_UNLINED:
            del self.unlined[next(iter(self.unlined))]


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
