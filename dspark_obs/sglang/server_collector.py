"""One SGLang server collected into one run: :class:`ServerCollector` (``poll()`` once,
durable when it returns), its options, reports and totals. The rules are in
:mod:`dspark_obs.sglang.collector`'s docstring; :class:`~dspark_obs.sglang.collector.Collector`
polls many of these.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa

from dspark_obs.fanout import FanOut
from dspark_obs.sglang.estimator_merge import EstimatorMerge
from dspark_obs.sglang.fetch import CollectError, fetch
from dspark_obs.sglang.ingest import run_row
from dspark_obs.sglang.ranks import (
    Gap,
    RankState,
    assign_ranks,
    fct_of,
    plan_read,
    record_hash,
)
from dspark_obs.sglang.records import (
    MAX_RECORDS,
    DumpError,
    RankDump,
    ServerInfo,
    decode_server_info,
    fingerprint,
    records_to_tables,
)

__all__ = [
    "CollectorOptions",
    "CollectorTotals",
    "PollCounts",
    "PollReport",
    "ServerCollector",
    "state_name",
]


@dataclass(frozen=True)
class CollectorOptions:
    """How one server is collected (``run_id``: the run its records are stored under)."""

    url: str
    run_id: str
    companion_of: str | None = None
    estimator_path: Path | None = None
    clear: bool = False
    timeout_s: float = 30.0  # the whole poll, every request and byte of it
    scrape_metrics: bool = True
    workloads: Mapping[str, str] | None = None
    temperature: float | None = None
    workload: str | None = None
    state_dir: Path | None = None
    hold_s: float = 60.0  # at most this long a request-step waits for its estimator line
    ring_size: int = MAX_RECORDS  # a hint: the server's ring size (SGLang: 200,000)
    labels: Mapping[str, str] = field(default_factory=dict)  # fleet labels (--targets)


@dataclass
class PollCounts:
    """What polls add up (rows are rows newly stored): a report holds one poll's, the
    totals every poll's, so no count is kept in two places."""

    steps: int = 0
    req_steps: int = 0
    rejected: int = 0
    bad_records: int = 0
    restarts: int = 0
    estimator_lines: int = 0
    estimator_errors: int = 0
    late_lines: int = 0

    def add(self, other: PollCounts) -> None:
        for f in fields(PollCounts):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class PollReport(PollCounts):
    """What one poll did."""

    gaps: list[Gap] = field(default_factory=list)
    held: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def overflow(self) -> int:
        return len(self.gaps)


@dataclass
class CollectorTotals(PollCounts):
    """Every poll's counts, and what only the whole collection has."""

    polls: int = 0
    failed_polls: int = 0
    lost_ranges: int = 0
    lost_forward_cts: int = 0
    restart_notes: list[str] = field(default_factory=list)
    last_error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def overflows(self) -> int:
        return self.lost_ranges

    @property
    def useful(self) -> bool:
        return self.polls > 0


class ServerCollector:
    """Collects one server into one run: ``poll()`` once, durable when it returns."""

    def __init__(
        self, opts: CollectorOptions, fan: FanOut, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.opts = opts
        self.fan = fan
        self.clock = clock
        self.ranks: dict[int, RankState] = {}
        self.identity: str | None = None
        self.run_written = False
        self.totals = CollectorTotals()
        self.gaps: list[Gap] = []
        self.estimator = (
            None
            if opts.estimator_path is None
            else EstimatorMerge(opts.estimator_path, opts.run_id, hold_s=opts.hold_s, clock=clock)
        )
        self._reported: set[str] = set()  # bad records already named
        self._cleared = False
        self._gamma: int | None = None
        self._load_state()

    # ------------------------------------------------------------------ state file

    @property
    def _state_path(self) -> Path | None:
        d = self.opts.state_dir
        return None if d is None else d / f"{state_name(self.opts.run_id)}.json"

    def _load_state(self) -> None:
        path = self._state_path
        if path is None or not path.is_file():
            return
        try:
            data = json.loads(path.read_text())
            self.ranks = {int(k): RankState(**v) for k, v in data["ranks"].items()}
            self.identity = data.get("identity")
            self.run_written = bool(data.get("run_written"))
            self._cleared = bool(data.get("cleared"))
            if self.estimator is not None:
                self.estimator.load(data)
        except (ValueError, KeyError, TypeError) as exc:
            raise CollectError(f"{path}: unreadable collector state ({exc}); remove it") from None

    def _save_state(self) -> None:
        path = self._state_path
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        ranks = {k: asdict(v) for k, v in self.ranks.items()}
        held = {} if self.estimator is None else self.estimator.held_min_per_rank()
        for dp, low in held.items():  # held rows are not stored: a restarted collector
            if dp in ranks and low - 1 < ranks[dp]["hwm"]:  # reads them again from the ring
                ranks[dp]["hwm"] = low - 1
                ranks[dp]["hwm_hash"] = None
        data = {
            "ranks": ranks,
            "identity": self.identity,
            "run_written": self.run_written,
            "cleared": self._cleared,
            **({} if self.estimator is None else self.estimator.state()),
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    # ------------------------------------------------------------------ HTTP

    def _request(self, path: str, deadline: float, body: Any = None) -> bytes:
        """One request to the server, every byte of it before ``deadline`` (monotonic)."""
        url = self.opts.url.rstrip("/") + path
        return fetch(
            url, deadline=deadline, clock=self.clock, timeout_s=self.opts.timeout_s, body=body
        )

    # ------------------------------------------------------------------ poll

    def poll(self, final: bool = False, until: float | None = None) -> PollReport:
        """One round: read, store what is new (acknowledged), then clear if configured.

        The whole poll ends by ``timeout_s`` from now, or by ``until`` (monotonic) if sooner.
        """
        rep = PollReport()
        try:
            try:
                self._poll(rep, final, until)
            finally:  # a poll that fails after storing rows still counts them and their gaps
                self._account(rep)
        except CollectError as exc:
            exc.notes = tuple(rep.notes)  # what it found is still reported (a restart, gaps)
            raise
        self.totals.polls += 1
        return rep

    def _account(self, rep: PollReport) -> None:
        t = self.totals
        t.add(rep)
        t.lost_ranges += len(rep.gaps)
        t.lost_forward_cts += sum(g.size for g in rep.gaps)
        self.gaps += rep.gaps
        rep.notes += [str(g) for g in rep.gaps]

    def _poll(self, rep: PollReport, final: bool, until: float | None) -> None:
        deadline = self.clock() + self.opts.timeout_s
        if until is not None:
            deadline = min(deadline, until)
        body = self._request("/server_info", deadline)
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
        self._check_identity(info, rep)
        prints = [
            None if s.startup_time is None else fingerprint(s.startup_time)
            for s in info.internal_states
        ]
        rank_ids = assign_ranks(
            prints, [None if d is None else d.records for d in dumps], self.ranks
        )
        self._read_estimator(rep)
        if not self.run_written:
            self._write_run(info, rep)
        for dp_rank, dump, fp in zip(rank_ids, dumps, prints, strict=True):
            if dump is not None:
                self._ingest_rank(dp_rank, dump, fp, rep)
        self._release_held(rep, final)
        self._keep_late(rep)
        self._save_state()
        self._cleared = False
        if self.opts.clear and not final:
            self._clear(deadline, rep)
        if self.opts.scrape_metrics:
            self._scrape(deadline, rep)

    def _check_identity(self, info: ServerInfo, rep: PollReport) -> None:
        """A changed startup_time / version is a new server process: every rank restarts."""
        ident = info.identity
        if self.identity is not None and ident != self.identity and self.ranks:
            for dp, st in sorted(self.ranks.items()):
                self._new_epoch(dp, st, rep, "startup_time/version changed: server restarted")
        self.identity = ident

    def _clear(self, deadline: float, rep: PollReport) -> None:
        try:
            raw = self._request(
                "/set_internal_state",
                deadline,
                {"server_args": {"dspark_clear_info_records": True}},
            )
            reply = json.loads(raw or b"null")
        except (CollectError, ValueError) as exc:
            rep.notes.append(f"clear failed ({exc}); the next read de-duplicates instead")
            return
        # SGLang answers one bool per DP rank; engine-server answers {"updated": bool}
        ok = (
            reply.get("updated") is True
            if isinstance(reply, dict)
            else isinstance(reply, list) and bool(reply) and all(x is True for x in reply)
        )
        if ok:
            self._cleared = True
        else:
            rep.notes.append(
                f"clear refused by the server (answered {reply!r}); the next read "
                "de-duplicates instead"
            )

    def _write_run(self, info: ServerInfo, rep: PollReport) -> None:
        cfg = {
            "kind": "sglang-collect",
            "url": self.opts.url,
            "clear": self.opts.clear,
            "labels": dict(self.opts.labels),
            "estimator_path": None
            if self.opts.estimator_path is None
            else str(self.opts.estimator_path),
        }
        try:
            row = run_row(
                info,
                self.opts.run_id,
                companion_of=self.opts.companion_of,
                workload=self.opts.workload,
                temperature=self.opts.temperature,
                config=cfg,
            )
        except DumpError as exc:
            rep.notes.append(f"runs row not written yet: {exc}")
            return
        before = len(self.fan.errors)
        if self.fan.emit("runs", [row]).num_rows == 1:
            self.run_written = True
        else:
            why = "; ".join(str(e) for e in self.fan.errors[before : before + 3])
            rep.notes.append(f"runs row refused ({why}); retried next poll")

    def _ingest_rank(self, dp_rank: int, dump: RankDump, fp: str | None, rep: PollReport) -> None:
        st = self.ranks.setdefault(dp_rank, RankState())
        if st.fingerprint is None:
            st.fingerprint = fp
        if not isinstance(dump.gamma, int) or dump.gamma < 1:
            rep.notes.append(
                f"dp{dp_rank}: gamma={dump.gamma!r}: waiting for the server to "
                "report its block size (records stay in its ring)"
            )
            return
        self._gamma = int(dump.gamma)
        recs = dump.records
        plan = plan_read(st, recs, dp_rank, cleared=self._cleared, ring_hint=self.opts.ring_size)
        if plan.restart is not None or (
            fp is not None and st.fingerprint not in (None, fp) and st.hwm >= 0
        ):
            self._new_epoch(
                dp_rank, st, rep, plan.restart or "its scheduler startup_time changed: restarted"
            )
            plan = plan_read(st, recs, dp_rank, cleared=False, ring_hint=self.opts.ring_size)
        st.fingerprint = fp if fp is not None else st.fingerprint
        rep.notes += plan.notes
        rep.gaps += [
            g if g.offset >= 0 else Gap(g.dp_rank, g.lo, g.hi, st.offset, g.why) for g in plan.gaps
        ]
        st.last_len = len(recs)
        tail = next((f for r in reversed(recs) if (f := fct_of(r)) is not None), -1)
        st.last_newest = tail
        new = recs[plan.start :]
        if not new:
            return
        for tables in records_to_tables(
            new,
            run_id=self.opts.run_id,
            dp_rank=dp_rank,
            gamma=int(dump.gamma),
            mode=dump.mode or None,
            fct_offset=st.offset,
            workloads=self.opts.workloads,
        ):
            self._report_bad(dp_rank, plan.start, new, tables.errors, rep)
            self._write("steps", tables.steps, rep)
            self._hold_or_write(tables.req_steps, st.offset, rep)
        last = next(
            ((i, f) for i in range(len(new) - 1, -1, -1) if (f := fct_of(new[i])) is not None), None
        )
        if last is not None:
            st.hwm = last[1]
            st.hwm_hash = record_hash(new[last[0]])
            st.stored_max = max(st.stored_max, st.hwm + st.offset)
        self._save_state()

    def _report_bad(
        self,
        dp_rank: int,
        base: int,
        new: Sequence[msgspec.Raw],
        errors: list[str],
        rep: PollReport,
    ) -> None:
        for e in errors:
            key = f"{dp_rank}:{e}"
            if key in self._reported:
                continue
            self._reported.add(key)
            rep.bad_records += 1
            if rep.bad_records <= 5:
                rep.notes.append(f"dp{dp_rank}: left out a bad record: {e}")

    def _new_epoch(self, dp_rank: int, st: RankState, rep: PollReport, why: str) -> None:
        if st.hwm < 0 and st.stored_max < 0:
            return
        rep.restarts += 1
        note = (
            f"dp{dp_rank}: restart at stored forward_ct {st.stored_max + 1} "
            f"(epoch {st.epoch + 1}): {why}"
        )
        rep.notes.append(note)
        self.totals.restart_notes.append(note)
        self._release_held(rep, final=True)
        self._keep_late(rep)
        st.epoch += 1
        st.fingerprint = None  # the new process's scheduler fingerprint is taken next
        st.offset = st.stored_max + 1
        st.hwm, st.hwm_hash = -1, None
        st.last_len, st.last_newest, st.capacity = 0, -1, None
        if self.estimator is not None:
            self.estimator.new_epoch()

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
        if self.estimator is None:
            return
        n, errors = self.estimator.read(self._gamma)
        rep.estimator_lines += n
        rep.estimator_errors += len(errors)
        rep.notes += errors[:5]

    def _hold_or_write(self, req_steps: pa.Table, offset: int, rep: PollReport) -> None:
        if self.estimator is None or req_steps.num_rows == 0:
            self._write("req_steps", req_steps, rep)
        else:
            self.estimator.hold(req_steps, offset)

    def _release_held(self, rep: PollReport, final: bool) -> None:
        if self.estimator is None:
            return
        newest = {dp: st.last_newest for dp, st in self.ranks.items()}
        for tab in self.estimator.release(final, newest):
            self._write("req_steps", tab, rep)
        rep.held = self.estimator.held_rows

    def _keep_late(self, rep: PollReport) -> None:
        if self.estimator is None:
            return
        # the lowest mark: a line belongs to one (unknown) rank, and is late only once every
        # rank's stored steps have passed it
        hwm = min((st.hwm for st in self.ranks.values() if st.hwm >= 0), default=-1)
        newest = {dp: st.last_newest for dp, st in self.ranks.items()}
        late = self.estimator.late(hwm, newest)
        if late.amends.num_rows:
            # durable before the lines are forgotten: a kill -9 in between writes them again,
            # and the store drops the second copy of a key
            self._write("req_step_amends", late.amends, rep)
            self.estimator.settle(late.keys)
            rep.late_lines += late.amends.num_rows
            rep.notes.append(
                f"{late.amends.num_rows} estimator line(s) arrived after their step was "
                "stored: stored as amendments (req_step_amends), merged by the req_steps view"
            )
        if late.orphans:
            rep.notes.append(
                f"{late.orphans} estimator line(s) match no request-step stored without one "
                "(lost in a reported gap, or already merged): not stored"
            )

    # ------------------------------------------------------------------ /metrics

    def _scrape(self, deadline: float, rep: PollReport) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = self._request("/metrics", deadline).decode("utf-8", errors="replace")
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

    def reconcile(self) -> str | None:
        """SGLang's own count of verify steps against the request-steps stored."""
        calls = self.totals.metrics.get("sglang:spec_verify_calls_total")
        if calls is None:
            return None
        stored = self.totals.req_steps
        diff = int(round(calls)) - stored
        if diff == 0:
            return f"sglang:spec_verify_calls_total={calls:g} = stored request-steps: reconciled"
        t = self.totals
        if diff > 0:  # SGLang counted verify steps that are not stored
            why = (
                f"steps before the collector attached, in the {t.lost_ranges} lost ranges, or "
                f"left out ({t.bad_records} bad records, {t.rejected} rejected rows)"
            )
        else:  # stored request-steps of requests that have not finished
            why = "requests still running (the counter counts finished requests only)"
        return (
            f"sglang:spec_verify_calls_total={calls:g} vs {stored} stored request-steps: "
            f"{diff:+d}, from {why}"
        )

    def close(self) -> PollReport:
        """Write everything still held (estimator lines that never came)."""
        rep = PollReport()
        try:
            self._read_estimator(rep)
            self._release_held(rep, final=True)
            self._keep_late(rep)
            self._save_state()
        finally:
            self._account(rep)
        return rep


def state_name(run_id: str) -> str:
    """The collector-state file stem of a run (file-system safe)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
