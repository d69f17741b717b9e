"""Which DP rank a reply is, which of its records are new, and what was lost: from the data.

Facts from SGLang 0.5.23's code that these rules rest on:

* ``forward_ct`` is the scheduler's per-process counter, advanced by every batch (prefill
  batches too, which write no step record), so consecutive records may skip values and a
  gap *between two records of one read* loses nothing. Records leave the ring only at its
  head (``deque(maxlen=200_000)``) or by ``dspark_clear_info_records``; a restarted
  process starts a fresh ring with forward_ct from 0.
* ``internal_states`` is filled by ``FanOutCommunicator`` in reply *arrival* order and a
  state carries no rank id. It does carry that scheduler's own ``startup_time`` durations,
  set once per scheduler process: distinct per rank in practice, so it is the rank's
  fingerprint. Where two ranks' fingerprints are equal (or absent), the rank whose stored
  high-water record is still in the reply, byte for byte, is the same rank; only what
  neither tells apart falls back to the reply position (a risk only then, documented in the
  README).

Per rank, one read of its ring (oldest ``first``, newest ``last``) against the stored
high-water mark ``hwm`` (a server forward_ct of the current epoch) and its record's hash:

* ``last < hwm``: forward_ct went back: a new process (new epoch);
* ``first <= hwm``: the record at ``hwm`` must still be there with the same bytes (else a new
  process ran past the old mark: new epoch); what follows it is new;
* ``first > hwm``: the record at ``hwm`` left the ring: it overflowed or was cleared
  (``--clear``), and forward_ct ``hwm+1 .. first-1`` is a lost range; but a ring that shrank
  without a clear is a fresh one: a new process (new epoch). (A new process whose ring holds
  only forward_cts above the old mark has itself overflowed: its loss is the same range.)

A new epoch gets ``offset = stored_max + 1`` (stored forward_ct = server forward_ct + offset),
so its keys never meet the old epoch's: nothing overwritten, nothing skipped. Lost ranges are
exact forward_ct ranges (they may include prefill forward_cts, which had no record).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

__all__ = ["Gap", "RankState", "ReadPlan", "assign_ranks", "fct_of", "plan_read", "record_hash"]


class _Fct(msgspec.Struct):
    forward_ct: int


_FCT = msgspec.json.Decoder(_Fct)


def fct_of(raw: msgspec.Raw | bytes) -> int | None:
    """A record's forward_ct, or None when the record is not an object with an int one."""
    try:
        return _FCT.decode(raw).forward_ct
    except msgspec.DecodeError:
        return None


def record_hash(raw: msgspec.Raw | bytes) -> str:
    return hashlib.blake2b(bytes(raw), digest_size=12).hexdigest()


@dataclass
class RankState:
    """One DP rank as the collector knows it (persisted in the collector's state file)."""

    fingerprint: str | None = None  # the scheduler's startup_time, canonical JSON
    epoch: int = 0
    offset: int = 0  # stored forward_ct = server forward_ct + offset
    hwm: int = -1  # highest server forward_ct stored in this epoch
    hwm_hash: str | None = None  # hash of that record's bytes
    stored_max: int = -1  # highest stored (offset) forward_ct over all epochs
    last_len: int = 0  # ring length at the last read
    last_newest: int = -1  # newest server forward_ct at the last read
    capacity: int | None = None  # ring size learned from the data (full and advancing)


@dataclass(frozen=True)
class Gap:
    """forward_ct ``lo..hi`` (server numbering, ``offset`` of its epoch) never stored."""

    dp_rank: int
    lo: int
    hi: int
    offset: int
    why: str

    @property
    def size(self) -> int:
        return self.hi - self.lo + 1

    def __str__(self) -> str:
        return f"dp{self.dp_rank}: forward_ct {self.lo}..{self.hi} lost ({self.why})"


@dataclass
class ReadPlan:
    """What to do with one read of one rank: store ``records[start:]``."""

    start: int = 0
    restart: str | None = None  # why a new epoch begins before storing, if it does
    gaps: list[Gap] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _first_valid(records: Sequence[msgspec.Raw], indices: range) -> tuple[int, int] | None:
    for i in indices:
        f = fct_of(records[i])
        if f is not None:
            return i, f
    return None


def first_after(records: Sequence[msgspec.Raw], hwm: int) -> int:
    """Index of the first record with forward_ct > hwm (records in forward_ct order); a
    record without a readable forward_ct is never trusted: a linear scan skips it."""
    lo, hi = 0, len(records)
    while lo < hi:
        mid = (lo + hi) // 2
        f = fct_of(records[mid])
        if f is None:
            return next(
                (i for i, r in enumerate(records) if (g := fct_of(r)) is not None and g > hwm),
                len(records),
            )
        if f <= hwm:
            lo = mid + 1
        else:
            hi = mid
    return lo


def plan_read(
    st: RankState,
    records: Sequence[msgspec.Raw],
    dp_rank: int,
    *,
    cleared: bool,
    ring_hint: int,
) -> ReadPlan:
    """Which records of this read are new, whether a new epoch starts, what was lost."""
    plan = ReadPlan()
    n = len(records)
    head = _first_valid(records, range(n))
    tail = _first_valid(records, range(n - 1, -1, -1))
    if head is None or tail is None:
        plan.start = n
        return plan
    first, last = head[1], tail[1]
    capacity = st.capacity
    if (
        capacity is None
        and not cleared
        and st.hwm >= 0
        and n == st.last_len
        and last > st.last_newest
    ):
        capacity = n  # the ring did not grow while it advanced: it is full at n
    full = n >= ring_hint or (capacity is not None and n >= capacity)
    if st.hwm >= 0:
        if last < st.hwm:
            plan.restart = f"forward_ct went back ({last} < {st.hwm}): server restarted"
        elif first <= st.hwm:
            i = first_after(records, st.hwm - 1)
            if st.hwm_hash is None:  # a mark lowered below held rows: nothing to compare
                plan.start = first_after(records, st.hwm)
            elif i < n and fct_of(records[i]) == st.hwm and record_hash(records[i]) == st.hwm_hash:
                plan.start = i + 1
            else:
                plan.restart = (
                    f"the record at forward_ct {st.hwm} changed: a new server "
                    "process ran past the old mark"
                )
        elif not cleared and n < st.last_len:
            plan.restart = (
                f"the ring shrank from {st.last_len} to {n} records without a "
                f"clear and holds only forward_ct {first}..{last}, newer than the "
                f"stored {st.hwm}: a new server process"
            )
        else:
            plan.start = 0
            if first > st.hwm + 1:
                why = (
                    "between the last read and its clear"
                    if cleared
                    else "the ring buffer overflowed between polls; poll more often or use --clear"
                )
                plan.gaps.append(Gap(dp_rank, st.hwm + 1, first - 1, st.offset, why))
    if plan.restart is not None or st.hwm < 0:
        plan.start = 0
        if first > 1 and full:
            plan.gaps.append(
                Gap(dp_rank, 1, first - 1, -1, "before the first read: the ring was already full")
            )
        elif first > 1 and st.hwm < 0 and plan.restart is None:
            plan.notes.append(
                f"dp{dp_rank}: the first record is forward_ct {first} "
                "(earlier forward_cts were prefill steps, or fell out of a ring "
                f"smaller than --ring-size {ring_hint})"
            )
    st.capacity = capacity
    return plan


def assign_ranks(
    fingerprints: Sequence[str | None],
    replies: Sequence[Sequence[msgspec.Raw] | None],
    known: dict[int, RankState],
) -> list[int]:
    """Stable rank ids for the replies of one read (see the module docstring for the rule)."""
    out: list[int | None] = [None] * len(replies)
    free = dict(known)
    counts: dict[str | None, int] = {}
    for fp in fingerprints:
        counts[fp] = counts.get(fp, 0) + 1
    for i, fp in enumerate(fingerprints):  # 1. a unique scheduler fingerprint seen before
        if fp is None or counts[fp] > 1:
            continue
        match = [r for r, st in free.items() if st.fingerprint == fp]
        if len(match) == 1:
            out[i] = match[0]
            del free[match[0]]
    for i, recs in enumerate(replies):  # 2. the stored high-water record is still there
        if out[i] is not None or not recs:
            continue
        for r, st in sorted(free.items()):
            if st.hwm < 0 or st.hwm_hash is None:
                continue
            j = first_after(recs, st.hwm - 1)
            if j < len(recs) and fct_of(recs[j]) == st.hwm and record_hash(recs[j]) == st.hwm_hash:
                out[i] = r
                del free[r]
                break
    next_new = max(known, default=-1) + 1
    remaining = sorted(free)
    for i in range(len(out)):  # 3. position: what is left, in order
        if out[i] is None:
            if remaining:
                out[i] = remaining.pop(0)
            else:
                out[i] = next_new
                next_new += 1
    return [int(r) for r in out if r is not None]
