"""A store of synthetic runs for the dashboard's tests, screenshots and query benchmark.

Test and demo data, so it lives in the testing package, not beside the pages. The records are
the project's own synthetic DSpark world (dspark_obs.testing.synthetic): a compact run and its
cap-accept companion over math / chat / poetry requests with a real verification rule. They
are given what a real run also records (timestamps, TTFT-able request times, per-step
predicted and measured time from the shipped CPU cost table) and go through the real ingest
path (``FanOut`` -> ``Store.write``). ``tile`` copies one pair under new run ids to reach
millions of rows quickly.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dspark_obs.cost_table import CostTable
from dspark_obs.fanout import FanOut
from dspark_obs.store import Store
from dspark_obs.testing.synthetic import simulate_pair
from dspark_obs.validation import to_table

__all__ = ["synthetic_tables", "tile", "write_in_slices", "write_sample_store"]

COST_TABLE = Path(__file__).resolve().parents[2] / "runtime" / "cost_tables" / "smollm2_cpu.json"
T0 = 1_780_000_000.0  # a fixed epoch second: screenshots and tests are reproducible


def _cost_table() -> tuple[dict | None, CostTable | None]:
    if not COST_TABLE.exists():
        return None, None
    raw = json.loads(COST_TABLE.read_text())
    return raw, CostTable.from_dict(raw, source=str(COST_TABLE))


def synthetic_tables(
    n_requests: int = 24,
    max_new_tokens: int = 40,
    seed: int = 0,
    temperature: float = 1.0,
    prefix: str | None = None,
) -> dict[str, pd.DataFrame]:
    """The four tables of one compact run + its cap-accept companion, as frames."""
    sim = simulate_pair(
        n_requests=n_requests,
        max_new_tokens=max_new_tokens,
        seed=seed,
        temperature=temperature,
        shared_draws=True,
    )
    raw, table = _cost_table()
    rng = np.random.default_rng(seed)
    names = {f"sim{seed}-compact": f"{prefix}-compact", f"sim{seed}-cap": f"{prefix}-cap"}
    runs = sim.runs.assign(model="synthetic-markov", drafter="synthetic", lag_steps=2, dp_size=1)
    runs["config"] = json.dumps({"cost_table": raw} if raw else {})
    runs["started_at"] = pd.to_datetime([T0, T0 + 600], unit="s", utc=True)
    out: dict[str, list[pd.DataFrame]] = {
        "runs": [runs],
        "steps": [],
        "req_steps": [],
        "requests": [],
    }
    for offset, (rs, st, rq) in enumerate(
        (
            (sim.compact_req_steps, sim.compact_steps, sim.compact_requests),
            (sim.cap_req_steps, sim.cap_steps, sim.cap_requests),
        )
    ):
        start = T0 + 600 * offset
        st = st.copy()
        if table is not None:
            st["predicted_step_ms"] = [
                1e3 * table.step_seconds(int(b), int(k))
                for b, k in zip(st["bs"], st["budget"], strict=True)
            ]
            st["predicted_theta"] = st["predicted_step_ms"] * 0.3
        else:
            st["predicted_step_ms"] = 20.0 + 5.0 * st["bs"]
        st["step_cpu_ms"] = st["predicted_step_ms"] * rng.lognormal(0.0, 0.15, len(st))
        elapsed = np.cumsum(st["step_cpu_ms"].to_numpy() / 1e3)
        when = dict(zip(st["forward_ct"], start + elapsed, strict=True))
        st["ts"] = pd.to_datetime(st["forward_ct"].map(when), unit="s", utc=True)
        rs = rs.copy()
        rs["ts"] = pd.to_datetime(rs["forward_ct"].map(when), unit="s", utc=True)
        span = rs.groupby("rid")["forward_ct"].agg(["min", "max"])
        rq = rq.copy()
        first = rq["rid"].map(span["min"]).map(when)
        rq["first_token_time"] = first
        rq["arrival_time"] = first - rng.uniform(0.05, 0.4, len(rq))
        rq["finish_time"] = rq["rid"].map(span["max"]).map(when)
        for name, frame in (("steps", st), ("req_steps", rs), ("requests", rq)):
            out[name].append(frame)
    tables = {k: pd.concat(v, ignore_index=True) for k, v in out.items()}
    if prefix is not None:
        for name, frame in tables.items():
            frame["run_id"] = frame["run_id"].map(names)
            if name == "runs":
                frame["companion_of"] = frame["companion_of"].map(names)
    return tables


def _arrow(name: str, frame: pd.DataFrame) -> pa.Table:
    """Frame -> the table's Arrow schema through the schema's own converter (NaN -> null)."""
    rows = frame.astype(object).where(frame.notna(), None).to_dict("records")
    table, errors = to_table(name, rows)
    if errors:
        raise ValueError(f"synthetic {name} rows rejected: {errors[:3]}")
    return table


def _suffix(col: pa.ChunkedArray, suffix: str) -> pa.Array:
    return pc.binary_join_element_wise(col, pa.scalar(suffix), "")


def tile(
    tables: dict[str, pd.DataFrame], run_pairs: int, copies: int, prefix: str
) -> Iterator[dict[str, pa.Table]]:
    """Big runs from a small one: per run pair, ``copies`` copies of every request.

    Copy k of a request gets rid ``{rid}~{k}`` and its steps move ``k`` spans later (forward_ct
    and times shifted), so every key stays unique; runs are renamed ``{prefix}{i}-{run}``.
    Yields one pair's four tables at a time (memory stays one pair's worth).
    """
    base = {name: _arrow(name, frame) for name, frame in tables.items()}
    span = int(pc.max(base["steps"]["forward_ct"]).as_py()) + 1
    t_first = pc.min(base["requests"]["arrival_time"]).as_py()
    t_span = pc.max(base["requests"]["finish_time"]).as_py() - t_first + 1.0
    grown: dict[str, pa.Table] = {}
    for name in ("steps", "req_steps", "requests"):
        t, parts = base[name], []
        for k in range(copies):
            part = t
            if "rid" in t.column_names:
                i = part.schema.get_field_index("rid")
                part = part.set_column(i, "rid", _suffix(part["rid"], f"~{k}"))
            if "forward_ct" in t.column_names:
                i = part.schema.get_field_index("forward_ct")
                part = part.set_column(i, "forward_ct", pc.add(part["forward_ct"], k * span))
            for col in ("arrival_time", "first_token_time", "finish_time"):
                if col in t.column_names:
                    i = part.schema.get_field_index(col)
                    part = part.set_column(i, col, pc.add(part[col], k * t_span))
            if "ts" in t.column_names:
                i = part.schema.get_field_index("ts")
                shift = pa.scalar(int(k * t_span * 1e6), pa.duration("us"))
                part = part.set_column(i, "ts", pc.add(part["ts"], shift))
            parts.append(part)
        grown[name] = pa.concat_tables(parts).combine_chunks()
    grown["runs"] = base["runs"]
    for p in range(run_pairs):
        out = {}
        for name, t in grown.items():
            i = t.schema.get_field_index("run_id")
            t = t.set_column(
                i,
                "run_id",
                pc.binary_join_element_wise(pa.scalar(f"{prefix}{p:03d}-"), t["run_id"], ""),
            )
            if name == "runs":
                j = t.schema.get_field_index("companion_of")
                comp = pc.binary_join_element_wise(
                    pa.scalar(f"{prefix}{p:03d}-"), t["companion_of"], ""
                )
                t = t.set_column(j, "companion_of", comp)
            out[name] = t
        yield out


def write_sample_store(
    root: str | Path,
    n_requests: int = 24,
    max_new_tokens: int = 40,
    seed: int = 0,
    prefix: str = "demo",
) -> Store:
    """Write one synthetic compact run + companion into the store at ``root``."""
    store = Store(root)
    fan = FanOut([store])
    for name, frame in synthetic_tables(n_requests, max_new_tokens, seed, prefix=prefix).items():
        fan.emit(name, _arrow(name, frame))
    if fan.errors:
        raise ValueError(f"synthetic records rejected: {fan.errors[:3]}")
    store.close()
    return store


def write_in_slices(
    store: Store,
    tables: dict[str, pd.DataFrame],
    slices: int = 12,
    pause: float = 1.0,
    stop: threading.Event | None = None,
) -> int:
    """Write ``tables`` the way a live producer does: runs first, then steps and req-steps in
    ``slices`` forward_ct ranges ``pause`` seconds apart, each request once its last step is
    in. Returns the slices written (fewer when ``stop`` is set)."""
    store.write("runs", _arrow("runs", tables["runs"]))
    rs, reqs = tables["req_steps"], tables["requests"]
    last_step = rs.groupby(["run_id", "rid"])["forward_ct"].max()
    ends = np.array([last_step.get(k, -1) for k in zip(reqs["run_id"], reqs["rid"], strict=True)])
    edges = np.linspace(0, int(rs["forward_ct"].max()) + 1, slices + 1).astype(int)
    done = 0
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        for name in ("steps", "req_steps"):
            frame = tables[name]
            part = frame[(frame["forward_ct"] >= lo) & (frame["forward_ct"] < hi)]
            if len(part):
                store.write(name, _arrow(name, part))
        part = reqs[(ends >= lo) & (ends < hi)]
        if len(part):
            store.write("requests", _arrow("requests", part))
        done += 1
        if stop is not None and stop.wait(pause):
            break
        if stop is None:
            time.sleep(pause)
    return done
