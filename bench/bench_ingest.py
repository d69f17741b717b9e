"""Ingest rate of req-step rows: validate + Store.write (Arrow batches) vs row-by-row INSERT.

    python bench/bench_ingest.py [--rows 1000000] [--batch-rows 100000] [--repeats 3]

Rows are realistic ReqDetail rows (gamma=5 by default: draft_tokens, confidence and survival
lists, a window per request chosen 1..gamma+1, accepted prefix, cap_trim, workload labels).
The timed path is what a producer's batch goes through: ``validation.validate`` (included), then
``Store.write`` (dedupe against stored keys, Parquet segment, fsync, atomic rename, directory
fsync). Building the Arrow batches is not timed: producers hand the fan-out columnar batches.

Three store paths are timed side by side, interleaved, in one run: ``write only`` (batches
validated beforehand, untimed: the cost of the store alone), ``fanout`` (validate, then
Store.write of the validated table, which Store.write recognizes and does not check again:
the FanOut -> Store path) and ``store validates`` (Store.write of a table that did not come
from validate, so Store.write validates it itself). Their ratios are what validation costs.
``--baseline-schema OLD.py`` adds a fourth path, ``baseline``: an older schema.py's validate
(e.g. ``git show <commit>:dspark_obs/schema.py > /tmp/old_schema.py``), then the store: the
before / after ratio of a change to the rules, measured in the same run.

Baseline: the naive way, one ``INSERT INTO req_steps VALUES (?, ...)`` per row into a DuckDB
table, all inside one transaction (so it is not dominated by a commit per row), on fewer
rows (``--baseline-rows``); its rate is rows / seconds. Each figure is the median of
``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import duckdb
import numpy as np
import pyarrow as pa

from dspark_obs import validation
from dspark_obs.store import Store
from dspark_obs.store.views import duckdb_types

VOCAB = 49152  # SmolLM2 vocabulary size
WORKLOADS = np.array(["math", "chat", "poetry"], dtype=object)


def req_step_batch(
    n: int,
    *,
    gamma: int = 5,
    bs: int = 32,
    start_step: int = 0,
    run_id: str = "bench",
    seed: int = 0,
) -> pa.Table:
    """``n`` req-step rows: ``bs`` requests per decode step, steps from ``start_step``."""
    rng = np.random.default_rng(seed + start_step)
    i = np.arange(n)
    fct = start_step + i // bs
    slot = i % bs
    # Confidence falls with position like a real drafter's; survival is its running product.
    base = rng.beta(9, 2, size=(n, 1)) * np.linspace(1.0, 0.8, gamma)
    conf = np.round(np.clip(base + rng.normal(0, 0.03, size=(n, gamma)), 0, 1), 4)
    surv = np.round(np.cumprod(conf, axis=1), 4)
    verify = rng.integers(1, gamma + 2, size=n)
    correct_full = (rng.random((n, gamma)) < conf).cumprod(axis=1).sum(axis=1)
    correct = np.minimum(correct_full, verify - 1)
    cap_trim = correct_full - correct
    is_last = rng.random(n) < 0.005
    acc = correct + 1
    acc[is_last] = np.maximum(1, acc[is_last] - rng.integers(0, 2, size=int(is_last.sum())))
    offsets = pa.array(np.arange(0, (n + 1) * gamma, gamma, dtype=np.int32))

    def lists(values: np.ndarray, typ: pa.DataType) -> pa.Array:
        return pa.ListArray.from_arrays(offsets, pa.array(values.ravel(), type=typ))

    generation = fct // 300  # a slot serves a new request every 300 steps
    rid = np.char.add("req-", (generation * bs + slot).astype(str)).astype(object)
    cols = {
        "run_id": pa.array(np.full(n, run_id, dtype=object), pa.string()),
        "dp_rank": pa.array(np.zeros(n, dtype=np.int32)),
        "forward_ct": pa.array(fct.astype(np.int64)),
        "rid": pa.array(rid, pa.string()),
        "gamma": pa.array(np.full(n, gamma, dtype=np.int32)),
        "req_pool_index": pa.array(slot.astype(np.int64)),
        "prefix_len": pa.array((64 + (fct % 300) * 3).astype(np.int64)),
        "verify_len": pa.array(verify.astype(np.int64)),
        "acc_len": pa.array(acc.astype(np.int64)),
        "correct_drafts": pa.array(correct.astype(np.int64)),
        "cap_trim": pa.array(cap_trim.astype(np.int64)),
        "bonus_token": pa.array(rng.integers(0, VOCAB, size=n).astype(np.int64)),
        "draft_tokens": lists(rng.integers(0, VOCAB, size=(n, gamma)).astype(np.int32), pa.int32()),
        "confidence": lists(conf.astype(np.float32), pa.float32()),
        "survival": lists(surv.astype(np.float32), pa.float32()),
        "workload": pa.array(WORKLOADS[slot % 3], pa.string()),
        "temperature": pa.array(np.full(n, 0.7, dtype=np.float32)),
        "top_p": pa.array(np.full(n, 0.95, dtype=np.float32)),
        "top_k": pa.array(np.full(n, -1, dtype=np.int32)),
        "is_last": pa.array(is_last),
        "ts": pa.array(1_790_000_000_000_000 + fct * 25_000, pa.timestamp("us", tz="UTC")),
    }
    return validation.to_table("req_steps", pa.table(cols))[0]


@dataclass
class Timing:
    """One repetition: wall seconds, CPU seconds of this process, CPU seconds in validate."""

    wall: float
    cpu: float
    validate: float


PATHS = ("write only", "fanout", "store validates")


def load_schema(path: str) -> ModuleType:
    """Import another version of dspark_obs/schema.py under its own name."""
    spec = importlib.util.spec_from_file_location("baseline_schema", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_schema"] = module
    spec.loader.exec_module(module)
    return module


def bench_store(
    batches: list[pa.Table], workdir: Path, path: str = "fanout", baseline: ModuleType | None = None
) -> Timing:
    """Durably store every batch into a fresh store (one-time init included), by ``path``."""
    root = workdir / "store"
    shutil.rmtree(root, ignore_errors=True)
    if path == "write only":
        batches = [validation.validate("req_steps", b)[0] for b in batches]  # untimed
    in_validate = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    with Store(root) as store:
        for batch in batches:
            if path in ("fanout", "baseline"):
                old = baseline if path == "baseline" and baseline is not None else None
                v0 = time.process_time()  # CPU: steadier than wall on a shared machine
                if old is None:
                    batch, errors = validation.check("req_steps", batch)  # as FanOut.emit
                else:
                    batch, errors = old.validate("req_steps", batch)
                in_validate += time.process_time() - v0
                if errors:
                    raise SystemExit(f"benchmark data failed validation: {errors[0]}")
                if old is not None:  # the old store did not validate again
                    batch = validation.ValidatedBatch("req_steps", batch, validation._MINT)
            ack = store.write("req_steps", batch)
            if ack.rejected:
                raise SystemExit(f"benchmark data failed validation: {ack.rejected[0]}")
    timing = Timing(time.perf_counter() - t0, time.process_time() - c0, in_validate)
    got = Store(root).query("SELECT count(*) AS n FROM req_steps").column("n")[0].as_py()
    if got != sum(b.num_rows for b in batches):
        raise SystemExit(f"store holds {got} rows, expected {sum(b.num_rows for b in batches)}")
    return timing


def bench_naive(rows: list[tuple], workdir: Path) -> float:
    """Seconds to INSERT the rows one by one into a DuckDB table (one transaction)."""
    path = workdir / "naive.duckdb"
    path.unlink(missing_ok=True)
    con = duckdb.connect(str(path))
    cols = duckdb_types("req_steps")
    con.execute("CREATE TABLE req_steps (" + ", ".join(f'"{c}" {t}' for c, t in cols) + ")")
    sql = f"INSERT INTO req_steps VALUES ({', '.join('?' for _ in cols)})"
    t0 = time.perf_counter()
    con.execute("BEGIN")
    for row in rows:
        con.execute(sql, row)
    con.execute("COMMIT")
    secs = time.perf_counter() - t0
    con.close()
    return secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="req-step rows per repetition")
    ap.add_argument("--batch-rows", type=int, default=100_000, help="rows per Store.write")
    ap.add_argument("--baseline-rows", type=int, default=5_000, help="rows for the naive baseline")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--baseline-schema", default=None, help="an older schema.py to compare")
    args = ap.parse_args()
    baseline = load_schema(args.baseline_schema) if args.baseline_schema else None
    paths = (*PATHS, "baseline") if baseline is not None else PATHS

    steps_per_batch = max(1, args.batch_rows // 32)
    batches, made = [], 0
    while made < args.rows:
        n = min(args.batch_rows, args.rows - made)
        start = len(batches) * steps_per_batch
        batches.append(req_step_batch(n, gamma=args.gamma, start_step=start))
        made += n
    sample = req_step_batch(args.baseline_rows, gamma=args.gamma, run_id="naive")
    naive_rows = [tuple(r.values()) for r in sample.to_pylist()]

    with tempfile.TemporaryDirectory(prefix="dspark-bench-") as tmp:
        work = Path(tmp)
        timed: dict[str, list[Timing]] = {p: [] for p in paths}
        for _ in range(args.repeats):  # interleaved: machine noise hits every path alike
            for p in paths:
                timed[p].append(bench_store(batches, work, p, baseline))
        naive = [bench_naive(naive_rows, work) for _ in range(args.repeats)]
    runs = timed["fanout"]
    wall = statistics.median(r.wall for r in runs)
    cpu = statistics.median(r.cpu for r in runs)
    val = statistics.median(r.validate for r in runs)
    store_rate = args.rows / wall
    naive_rate = args.baseline_rows / statistics.median(naive)
    print(f"req_steps rows: {args.rows:,} in batches of {args.batch_rows:,}; gamma={args.gamma}; "
          f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}")
    print(
        f"validate + Store.write (durable, validation included): {store_rate:,.0f} rows/s "
        f"[median of {args.repeats} walls: {', '.join(f'{r.wall:.3f}s' for r in runs)}; "
        f"of which validate {val:.3f} CPU-s; CPU {cpu:.3f}s = {args.rows / cpu:,.0f} rows/CPU-s]"
    )
    print(
        f"naive row-by-row INSERT (DuckDB, one transaction, {args.baseline_rows:,} rows): "
        f"{naive_rate:,.0f} rows/s [median of {args.repeats}: "
        f"{', '.join(f'{s:.3f}s' for s in naive)}]"
    )
    print(f"ratio: {store_rate / naive_rate:,.1f}x")
    rate = {p: args.rows / statistics.median(r.wall for r in timed[p]) for p in paths}
    for p in paths:
        cpu_p = statistics.median(r.cpu for r in timed[p])
        print(f"  {p:>16}: {rate[p]:,.0f} rows/s, {args.rows / cpu_p:,.0f} rows/CPU-s "
              f"[walls {', '.join(f'{r.wall:.3f}s' for r in timed[p])}]")
    print(f"validation's cost: fanout path at {rate['fanout'] / rate['write only']:.3f}x the "
          f"write-only rate; Store.write validating itself at "
          f"{rate['store validates'] / rate['write only']:.3f}x")
    if baseline is not None:
        old_v = statistics.median(r.validate for r in timed["baseline"])
        cpu_ratio = statistics.median(r.cpu for r in timed["baseline"]) / cpu
        print(f"after / before (fanout / baseline): {rate['fanout'] / rate['baseline']:.3f}x "
              f"the rate ({cpu_ratio:.3f}x by CPU time); validate {val:.3f} vs {old_v:.3f} CPU-s "
              f"per {args.rows:,} rows")


if __name__ == "__main__":
    main()
