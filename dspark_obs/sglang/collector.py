"""``dspark-obs collect``: attach to a running SGLang DSpark server and record what it emits.

Each poll reads GET /server_info, takes every DP rank's ``dspark_info_record`` and hands the
steps and request-steps it has not stored yet to the one producer interface (FanOut: the
store and the telemetry sinks), tails the block-accept estimator JSONL and merges its fields
(``trimmed_tokens``, ``q_lp``, ``pg``) into the request-steps they belong to, and scrapes
SGLang's own /metrics to reconcile (``sglang:spec_verify_calls_total`` against the stored
request-steps). The first poll writes the ``runs`` row: the server's mode, gamma, model and
drafter (a cap-accept companion's row names the run it shadows).

Why each rule:

* The ring buffer comes back whole on every call. ``dedupe`` (default) keeps a high-water
  mark per DP rank and binary-searches the (forward_ct-ordered) buffer for the first new
  record, so a full 200,000-record buffer costs one scan, not a decode. ``clear`` posts
  ``dspark_clear_info_records`` after an acknowledged write, so the buffer stays small;
  SGLang offers no atomic read-and-clear, so steps that land between the read and the clear
  are lost: the collector reports how many the next read says are missing.
* A restarted server counts forward_ct from 0 again (and reports a new ``startup_time``):
  each new epoch gets an offset, stored forward_ct = server forward_ct + offset, so the new
  steps never collide with the old keys (the store would drop them as duplicates). Epochs
  and high-water marks persist in ``<store>/.collector/<run>.json`` after every write, so a
  restarted collector resumes without re-reading into a collision.
* Down, timeouts, truncated or malformed JSON: the poll is reported and retried with
  exponential backoff; nothing of a failed poll is written, so nothing is half-stored, and
  the store's keys make any re-read idempotent.
* Overflow: if the server kept more records than the buffer holds between two polls, the
  oldest new record is past the high-water mark while the buffer is full: reported.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from dspark_obs.analytics.estimator import parse_estimator_lines
from dspark_obs.fanout import FanOut, RecordSink
from dspark_obs.schema import PG_TYPE, REQ_STEPS
from dspark_obs.sglang.ingest import run_row
from dspark_obs.sglang.records import (
    MAX_RECORDS,
    DumpError,
    RankDump,
    ServerInfo,
    decode_server_info,
    records_to_tables,
)

__all__ = ["CollectError", "Collector", "CollectorOptions", "PollReport", "ServerCollector"]


class CollectError(RuntimeError):
    """A poll failed (server down, timeout, bad body); retried by :meth:`Collector.run`."""


@dataclass(frozen=True)
class CollectorOptions:
    """How one server is collected (``run_id``: the run its records are stored under)."""

    url: str
    run_id: str
    companion_of: str | None = None
    estimator_path: Path | None = None
    clear: bool = False
    timeout_s: float = 30.0
    scrape_metrics: bool = True
    workloads: Mapping[str, str] | None = None
    temperature: float | None = None
    workload: str | None = None
    state_dir: Path | None = None
    hold_s: float = 5.0  # how long a request-step waits for its estimator line
    ring_size: int = MAX_RECORDS  # the server's ring buffer size (SGLang: 200,000)


@dataclass
class _Rank:
    """Per DP rank: the current epoch's server startup time, offset and high-water mark."""

    startup_time: float | None = None
    offset: int = 0
    hwm: int = -1  # highest server forward_ct stored in this epoch
    stored_max: int = -1  # highest stored (offset) forward_ct over all epochs


@dataclass
class PollReport:
    """What one poll did."""

    steps: int = 0
    req_steps: int = 0
    duplicates: int = 0
    rejected: int = 0
    restarts: int = 0
    overflow: int = 0  # polls that found the ring buffer had overflowed
    estimator_lines: int = 0
    estimator_errors: int = 0
    held: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class CollectorTotals:
    polls: int = 0
    failed_polls: int = 0
    steps: int = 0
    req_steps: int = 0
    rejected: int = 0
    restarts: int = 0
    overflows: int = 0
    estimator_lines: int = 0
    estimator_errors: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


class _Fct(msgspec.Struct):
    forward_ct: int


_FCT = msgspec.json.Decoder(_Fct)


def _fct(raw: msgspec.Raw) -> int:
    return _FCT.decode(raw).forward_ct


def first_after(records: Sequence[msgspec.Raw], hwm: int) -> int:
    """Index of the first record with forward_ct > hwm (records are in forward_ct order)."""
    lo, hi = 0, len(records)
    while lo < hi:
        mid = (lo + hi) // 2
        if _fct(records[mid]) <= hwm:
            lo = mid + 1
        else:
            hi = mid
    return lo


class _JsonlTail:
    """Complete lines appended to a file since the last read (a partial last line waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.lineno = 0

    def read(self) -> list[str]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:  # truncated / replaced: start over
            self.offset = 0
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        return data[: end + 1].decode("utf-8", errors="replace").splitlines()


class ServerCollector:
    """Collects one server into one run: ``poll()`` once, durable when it returns."""

    def __init__(self, opts: CollectorOptions, fan: FanOut) -> None:
        self.opts = opts
        self.fan = fan
        self.ranks: dict[int, _Rank] = {}
        self.run_written = False
        self.totals = CollectorTotals()
        self._tail = _JsonlTail(opts.estimator_path) if opts.estimator_path else None
        self._est: dict[tuple[str, int], dict[str, Any]] = {}  # (rid, server fct) -> fields
        self._est_watermark = -1
        self._held: list[tuple[float, pa.Table]] = []
        self._gamma: int | None = None
        self._load_state()

    # ------------------------------------------------------------------ state file

    @property
    def _state_path(self) -> Path | None:
        d = self.opts.state_dir
        return None if d is None else d / f"{self.opts.run_id}.json"

    def _load_state(self) -> None:
        path = self._state_path
        if path is None or not path.is_file():
            return
        try:
            data = json.loads(path.read_text())
            self.ranks = {int(k): _Rank(**v) for k, v in data["ranks"].items()}
            self.run_written = bool(data.get("run_written"))
        except (ValueError, KeyError, TypeError) as exc:
            raise CollectError(f"{path}: unreadable collector state ({exc}); remove it") from None

    def _save_state(self) -> None:
        path = self._state_path
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        ranks = {k: asdict(v) for k, v in self.ranks.items()}
        for _, tab in self._held:  # held rows are not stored yet: a restarted collector
            mins = tab.group_by("dp_rank").aggregate([("_server_fct", "min")])  # reads them again
            for dp, low in zip(mins["dp_rank"].to_pylist(), mins["_server_fct_min"].to_pylist(),
                               strict=True):
                ranks[dp]["hwm"] = min(ranks[dp]["hwm"], low - 1)
        data = {"ranks": ranks, "run_written": self.run_written}
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    # ------------------------------------------------------------------ HTTP

    def _get(self, path: str) -> bytes:
        url = self.opts.url.rstrip("/") + path
        try:
            with urllib.request.urlopen(url, timeout=self.opts.timeout_s) as resp:
                return resp.read()
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise CollectError(f"GET {url}: {exc}") from None
        except Exception as exc:  # http.client.IncompleteRead and friends: a truncated body
            raise CollectError(f"GET {url}: {type(exc).__name__}: {exc}") from None

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        url = self.opts.url.rstrip("/") + path
        req = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.opts.timeout_s) as resp:
                return json.loads(resp.read() or b"null")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise CollectError(f"POST {url}: {exc}") from None

    # ------------------------------------------------------------------ poll

    def poll(self, final: bool = False) -> PollReport:
        """One round: read, store what is new (acknowledged), then clear if configured."""
        rep = PollReport()
        body = self._get("/server_info")
        try:
            info = decode_server_info(body)
        except DumpError as exc:
            raise CollectError(f"{self.opts.url}/server_info: {exc}") from None
        dumps = info.dumps
        if not any(d is not None for d in dumps):
            raise CollectError(
                f"{self.opts.url}: no dspark_info_record in /server_info (start the server with "
                "SGLANG_DSPARK_DEBUG_DUMP=core,step_cpu_time,reqs)"
            )
        for dp_rank, dump in enumerate(dumps):
            if dump is not None:
                self._check_epoch(dp_rank, dump, info.startup_time, rep)
        self._read_estimator(rep)
        if not self.run_written:
            self._write_run(info)
        for dp_rank, dump in enumerate(dumps):
            if dump is not None:
                self._ingest_rank(dp_rank, dump, rep)
        self._release_held(rep, final)
        self._save_state()
        if self.opts.clear:
            self._post("/set_internal_state", {"server_args": {"dspark_clear_info_records": True}})
        if self.opts.scrape_metrics:
            self._scrape(rep)
        t = self.totals
        t.polls += 1
        t.steps += rep.steps
        t.req_steps += rep.req_steps
        t.rejected += rep.rejected
        t.restarts += rep.restarts
        t.overflows += rep.overflow
        t.estimator_lines += rep.estimator_lines
        t.estimator_errors += rep.estimator_errors
        return rep

    def _write_run(self, info: ServerInfo) -> None:
        cfg = {"kind": "sglang-collect", "url": self.opts.url, "clear": self.opts.clear,
               "estimator_path": None if self.opts.estimator_path is None
               else str(self.opts.estimator_path)}
        try:
            row = run_row(info, self.opts.run_id, companion_of=self.opts.companion_of,
                          workload=self.opts.workload, temperature=self.opts.temperature,
                          config=cfg)
        except DumpError as exc:
            raise CollectError(f"{self.opts.url}: {exc}") from None
        self.fan.emit("runs", [row])
        self.run_written = True

    def _check_epoch(
        self, dp_rank: int, dump: RankDump, startup: float | None, rep: PollReport
    ) -> None:
        """A new server start (startup_time changed, or forward_ct went back): new epoch."""
        st = self.ranks.setdefault(dp_rank, _Rank())
        self._gamma = int(dump.gamma)
        if st.startup_time is None:
            st.startup_time = startup
            return
        if startup is not None:
            restarted = startup != st.startup_time
        else:
            restarted = bool(dump.records) and st.hwm >= 0 and _fct(dump.records[-1]) < st.hwm
        if restarted:
            self._new_epoch(st, startup, rep, dp_rank)

    def _ingest_rank(self, dp_rank: int, dump: RankDump, rep: PollReport) -> None:
        st = self.ranks[dp_rank]
        recs = dump.records
        if not recs:
            return
        first = _fct(recs[0])
        start = first_after(recs, st.hwm) if st.hwm >= 0 and first <= st.hwm else 0
        if st.hwm >= 0 and start == 0 and first > st.hwm + 1 and len(recs) >= self.opts.ring_size:
            rep.overflow += 1
            rep.notes.append(
                f"dp{dp_rank}: ring buffer overflowed: forward_ct {st.hwm + 1}..{first - 1} "
                "fell out before this poll (poll more often or use --clear)"
            )
        if self.opts.clear and st.hwm >= 0 and first > st.hwm + 1:
            rep.notes.append(
                f"dp{dp_rank}: forward_ct {st.hwm + 1}..{first - 1} absent (possibly landed "
                "between the last read and its clear, or were not decode steps)"
            )
        new = recs[start:]
        if not new:
            return
        for tables in records_to_tables(
            new, run_id=self.opts.run_id, dp_rank=dp_rank, gamma=int(dump.gamma),
            mode=dump.mode or None, fct_offset=st.offset, workloads=self.opts.workloads,
        ):
            self._write("steps", tables.steps, rep)
            self._hold_or_write(tables.req_steps, st.offset, rep)
        st.hwm = _fct(new[-1])
        st.stored_max = max(st.stored_max, st.hwm + st.offset)

    def _new_epoch(self, st: _Rank, startup: float | None, rep: PollReport, dp_rank: int) -> None:
        rep.restarts += 1
        rep.notes.append(
            f"dp{dp_rank}: server restarted (forward_ct restarts); new epoch at offset "
            f"{st.stored_max + 1}"
        )
        self._release_held(rep, final=True)
        st.startup_time = startup
        st.offset = st.stored_max + 1
        st.hwm = -1
        self._est_watermark = -1

    def _write(self, table: str, batch: pa.Table, rep: PollReport) -> None:
        before = len(self.fan.errors)
        kept = self.fan.emit(table, batch)
        rejected = len(self.fan.errors) - before
        rep.rejected += rejected
        for err in self.fan.errors[before : before + 5]:
            rep.notes.append(f"rejected {err}")
        if table == "steps":
            rep.steps += kept.num_rows
        elif table == "req_steps":
            rep.req_steps += kept.num_rows

    # ------------------------------------------------------------------ estimator merge

    def _read_estimator(self, rep: PollReport) -> None:
        if self._tail is None:
            return
        lines = self._tail.read()
        if not lines:
            return
        frame, errors = parse_estimator_lines(lines, gamma=self._gamma, run_id=self.opts.run_id)
        rep.estimator_lines += len(frame)
        rep.estimator_errors += len(errors)
        for e in errors[:5]:
            rep.notes.append(f"{self._tail.path}: line +{e.line}: {e.reason}")
        for rid, fct, t, q, pg in zip(
            frame["rid"], frame["forward_ct"], frame["trimmed_tokens"], frame["q_lp"],
            frame["pg"], strict=True,
        ):
            self._est[(str(rid), int(fct))] = {"trimmed_tokens": t, "q_lp": q, "pg": pg}
            self._est_watermark = max(self._est_watermark, int(fct))

    def _hold_or_write(self, req_steps: pa.Table, offset: int, rep: PollReport) -> None:
        if self._tail is None or req_steps.num_rows == 0:
            self._write("req_steps", req_steps, rep)
            return
        self._held.append((time.monotonic(), req_steps.append_column(
            "_server_fct", pc.subtract(req_steps.column("forward_ct"), offset))))

    def _release_held(self, rep: PollReport, final: bool) -> None:
        """Write held request-steps whose estimator lines are in (or waited long enough)."""
        if not self._held:
            return
        now = time.monotonic()
        keep: list[tuple[float, pa.Table]] = []
        for since, tab in self._held:
            server_fct = tab.column("_server_fct")
            done = pc.less(server_fct, self._est_watermark)
            if final or now - since >= self.opts.hold_s:
                done = pa.array([True] * tab.num_rows)
            ready, wait = tab.filter(done), tab.filter(pc.invert(done))
            if ready.num_rows:
                self._write("req_steps", self._merge(ready), rep)
            if wait.num_rows:
                keep.append((since, wait))
        self._held = keep
        rep.held = sum(t.num_rows for _, t in keep)
        if not keep:  # lines of steps already written can never be merged: forget them
            self._est = {k: v for k, v in self._est.items() if k[1] >= self._est_watermark}

    def _merge(self, tab: pa.Table) -> pa.Table:
        rids = tab.column("rid").to_pylist()
        fcts = tab.column("_server_fct").to_pylist()
        tab = tab.drop_columns(["_server_fct"])
        found = [self._est.pop((r, f), None) for r, f in zip(rids, fcts, strict=True)]
        if not any(found):
            return tab
        cols = {}
        for name, typ in (("trimmed_tokens", pa.list_(pa.int32())),
                          ("q_lp", pa.list_(pa.float32())), ("pg", pa.list_(PG_TYPE))):
            values = [None if f is None else _none_if_nan(f[name]) for f in found]
            cols[name] = pa.array(values, type=typ)
        for name, arr in cols.items():
            i = tab.schema.get_field_index(name)
            tab = tab.set_column(i, REQ_STEPS.field(name), arr)
        return tab

    # ------------------------------------------------------------------ /metrics

    def _scrape(self, rep: PollReport) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = self._get("/metrics").decode("utf-8", errors="replace")
            values: dict[str, float] = {}
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if s.name.endswith("_created"):
                        continue
                    if s.name.startswith("sglang:spec_") or s.name == "sglang:num_running_reqs":
                        values[s.name] = values.get(s.name, 0.0) + float(s.value)
            self.totals.metrics = values
        except (CollectError, ValueError) as exc:
            rep.notes.append(f"/metrics not scraped: {exc}")

    def close(self) -> PollReport:
        """Write everything still held (estimator lines that never came)."""
        rep = PollReport()
        self._read_estimator(rep)
        self._release_held(rep, final=True)
        self._save_state()
        self.totals.req_steps += rep.req_steps
        return rep


def _none_if_nan(v: Any) -> Any:
    if v is None or (isinstance(v, float) and v != v):
        return None
    return list(v) if not isinstance(v, list) else v


# ---------------------------------------------------------------- the polling loop


class Collector:
    """Polls one server (and its companion) until stopped, with backoff on failures."""

    def __init__(
        self,
        servers: Sequence[CollectorOptions],
        sinks: Sequence[RecordSink],
        *,
        interval_s: float = 1.0,
        max_backoff_s: float = 30.0,
        report: Callable[[str, str], None] | None = None,
    ) -> None:
        self.fan = FanOut(sinks)
        self.servers = [ServerCollector(o, self.fan) for o in servers]
        self.interval_s = interval_s
        self.max_backoff_s = max_backoff_s
        self.report = report or (lambda run, msg: None)
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def poll_once(self, final: bool = False) -> list[PollReport | None]:
        """One round over every server; a failed server is reported and skipped."""
        out: list[PollReport | None] = []
        for sc in self.servers:
            try:
                rep = sc.poll(final=final)
            except CollectError as exc:
                sc.totals.failed_polls += 1
                self.report(sc.opts.run_id, f"poll failed: {exc}")
                out.append(None)
                continue
            for note in rep.notes:
                self.report(sc.opts.run_id, note)
            out.append(rep)
        return out

    def run(self, duration_s: float | None = None) -> None:
        """Poll every ``interval_s`` until :meth:`stop` (or ``duration_s``); back off on errors."""
        deadline = None if duration_s is None else time.monotonic() + duration_s
        backoff = self.interval_s
        while not self._stop.is_set():
            reps = self.poll_once()
            ok = all(r is not None for r in reps)
            backoff = self.interval_s if ok else min(max(backoff * 2, 0.5), self.max_backoff_s)
            wait = backoff if deadline is None else min(backoff, deadline - time.monotonic())
            if deadline is not None and wait <= 0:
                break
            self._stop.wait(wait)

    def finish(self, attempts: int = 3) -> None:
        """A last poll (retried with backoff) and write whatever is held; then close."""
        delay = 0.2
        for _ in range(attempts):
            if all(r is not None for r in self.poll_once(final=True)):
                break
            time.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)
        for sc in self.servers:
            sc.close()
        self.fan.close()
