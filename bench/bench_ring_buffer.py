"""Parse and store one full SGLang ring buffer, as GET /server_info returns it.

200,000 DecodeStepRecords (SGLang's INFO_DUMP_MAX_RECORDS) at batch 64 with the ``reqs``
component: 12.8 million ReqDetails with draft tokens, confidence and survival (about 4 GB of
JSON). Measured: the collector's path (msgspec scan keeping each record as a raw slice, Arrow's
JSON reader per chunk, chunks in parallel, validated store writes) over the whole buffer, wall
and CPU time (CPU is the quiet-machine proxy while other work loads the cores); and, side by
side on a slice of it, the same path against ``json.loads`` + row-wise conversion to dicts +
the same store writes (the whole buffer that way would need tens of GB of Python objects);
and the parsers tried, parse only, CPU-s on the slice: Arrow's reader (the one used), DuckDB's
read_json (it casts "12", 1.5, true into integers SGLang's types refuse), msgspec typed
structs, msgspec typed decoding into columns.

    python bench/bench_ring_buffer.py                     # the full buffer, 3 reps (goal <= 15 s)
    python bench/bench_ring_buffer.py --records 20000     # a quicker look
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from dspark_obs.fanout import FanOut
from dspark_obs.schema import REQ_STEPS, SGLANG_REQ_INT_FIELDS
from dspark_obs.sglang.records import decode_server_info, records_to_tables
from dspark_obs.store import Store

GAMMA = 5


def record_tails(n_templates: int, batch: int, seed: int) -> list[bytes]:
    """JSON of distinct step records after their forward_ct (``,"bs":...}``)."""
    rng = np.random.default_rng(seed)
    tails = []
    for t in range(n_templates):
        reqs = []
        for i in range(batch):
            conf = np.round(rng.uniform(0.05, 0.99, GAMMA), 4)
            window = int(rng.integers(1, GAMMA + 2))
            correct = int(rng.integers(0, window))
            reqs.append(
                {
                    "req_pool_index": i,
                    "prefix_len": int(rng.integers(16, 4096)),
                    "verify_len": window,
                    "acc_len": correct + 1,
                    "correct_drafts": correct,
                    "cap_trim": 0,
                    "bonus_token": int(rng.integers(0, 151_000)),
                    "draft_tokens": rng.integers(0, 151_000, GAMMA).tolist(),
                    "rid": f"{t % 97:02d}{i:02d}{int(rng.integers(0, 2**62)):028x}",
                    "confidence": conf.tolist(),
                    "survival": np.round(np.cumprod(conf), 4).tolist(),
                }
            )
        rec = {
            "bs": batch,
            "mode": "compact",
            "budget": int(rng.integers(batch, batch * 6)),
            "lag_steps": 2,
            "num_running_reqs": batch,
            "num_verify_tokens": sum(r["verify_len"] for r in reqs),
            "verify_tokens_local": sum(r["verify_len"] for r in reqs),
            "predicted_step_ms": round(float(rng.uniform(8, 20)), 4),
            "predicted_theta": round(float(rng.uniform(0, 1)), 4),
            "step_cpu_ms": round(float(rng.uniform(8, 20)), 4),
            "reqs": reqs,
        }
        tails.append(b"," + json.dumps(rec, separators=(",", ":")).encode()[1:])
    return tails


def server_info_body(records: int, batch: int, seed: int = 0) -> bytes:
    """A /server_info body holding one DP rank's full ring buffer."""
    tails = record_tails(min(records, 500), batch, seed)
    head = json.dumps(
        {
            "mode": "compact",
            "gamma": GAMMA,
            "verify_num_draft_tokens": GAMMA + 1,
            "components": ["core", "reqs", "step_cpu_time"],
        }
    )[:-1]
    parts = [
        b'{"model_path":"bench","startup_time":{"load_weight":1.0,"scheduler_e2e":2.0},'
        b'"internal_states":[{"dspark_info_record":',
        head.encode(),
        b',"records":[',
    ]
    parts.append(b",".join(b'{"forward_ct":%d' % i + tails[i % len(tails)] for i in range(records)))
    parts.append(b']}}],"version":"0.5.23"}')
    return b"".join(parts)


PHASES: dict[str, float] = {}


def _load(path: Path) -> Any:
    """A records module from a file (``git show REV:dspark_obs/sglang/records.py > f.py``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("baseline_records", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # msgspec resolves its annotations there
    spec.loader.exec_module(mod)
    return mod


def cpu_seconds() -> float:
    """CPU time of this process (every thread) and its children: on a loaded machine the
    proxy for what the work costs on a quiet one."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def ours(body: bytes, root: Path, to_tables: Any = records_to_tables) -> tuple[float, int]:
    """The collector's path: scan, Arrow per chunk, validated store writes (``to_tables``: a
    baseline's records_to_tables, for a side-by-side run)."""
    t0 = time.perf_counter()
    info = decode_server_info(body)
    PHASES["scan"] = time.perf_counter() - t0
    PHASES["parse"] = PHASES["store"] = 0.0
    fan = FanOut([Store(root)])
    rows = 0
    for dp, dump in enumerate(info.dumps):
        chunks = to_tables(
            dump.records, run_id="bench", dp_rank=dp, gamma=dump.gamma, mode=dump.mode
        )
        while True:
            t1 = time.perf_counter()
            tab = next(chunks, None)
            t2 = time.perf_counter()
            PHASES["parse"] += t2 - t1
            if tab is None:
                break
            fan.emit("steps", tab.steps)
            rows += fan.emit("req_steps", tab.req_steps).num_rows + tab.steps.num_rows
            PHASES["store"] += time.perf_counter() - t2
    fan.close()
    return time.perf_counter() - t0, rows


_DUCK_TYPES = {
    "int64": "BIGINT",
    "int32": "INTEGER",
    "float": "FLOAT",
    "double": "DOUBLE",
    "string": "VARCHAR",
}


def _duck_type(t: pa.DataType) -> str:
    if pa.types.is_list(t):
        return _duck_type(t.value_type) + "[]"
    if pa.types.is_struct(t):
        return "STRUCT(" + ", ".join(f"{f.name} {_duck_type(f.type)}" for f in t) + ")"
    return _DUCK_TYPES[str(t)]


class _ColReq(msgspec.Struct, gc=False):
    """A ReqDetail whose ints msgspec checks and whose lists stay raw slices."""

    req_pool_index: int
    prefix_len: int
    verify_len: int
    acc_len: int
    correct_drafts: int
    cap_trim: int
    bonus_token: int
    draft_tokens: msgspec.Raw
    rid: str | None = None
    confidence: msgspec.Raw = msgspec.Raw(b"null")
    survival: msgspec.Raw = msgspec.Raw(b"null")


class _ColRec(msgspec.Struct, gc=False):
    forward_ct: int
    reqs: list[_ColReq] = []


def msgspec_columns(recs: list) -> dict[str, np.ndarray]:
    """msgspec typed decoding into columns: each ReqDetail a :class:`_ColReq`, then one column
    per field and each list field decoded in bulk (one ``list[list[float]]`` decode per field)
    into a flat numpy array."""
    steps = msgspec.json.decode(b"[" + b",".join(recs) + b"]", type=list[_ColRec])
    reqs = [q for rec in steps for q in rec.reqs]
    cols = {
        f: np.fromiter(map(attrgetter(f), reqs), np.int64, len(reqs)) for f in SGLANG_REQ_INT_FIELDS
    }
    for f, item, dtype in (
        ("draft_tokens", int, np.int32),
        ("confidence", float, np.float32),
        ("survival", float, np.float32),
    ):
        lists = msgspec.json.decode(
            b"[" + b",".join(map(attrgetter(f), reqs)) + b"]", type=list[list[item] | None]
        )
        cols[f + "_len"] = np.fromiter(map(len, lists), np.int64, len(lists))
        cols[f] = np.fromiter(itertools.chain.from_iterable(lists), dtype)
    return cols


def parse_alternatives(body: bytes, reps: int) -> str:
    """CPU time to parse one slice (medians of ``reps``): Arrow's JSON reader single-threaded
    (what records_to_tables runs, a chunk per core) and with its own threads, DuckDB's
    read_json, msgspec typed structs, and msgspec typed decoding into columns. CPU, not wall:
    on a shared machine wall time is mostly waiting for a core."""
    import io

    import duckdb
    import msgspec
    import pyarrow.json as pa_json

    from dspark_obs.sglang.records import _PARSE, _READ, _RECORD_SCHEMA, DecodeStepRecord

    recs = decode_server_info(body).dumps[0].records
    text = b"\n".join(recs)
    columns = {f.name: _duck_type(f.type) for f in _RECORD_SCHEMA}
    con = duckdb.connect()
    typed = msgspec.json.Decoder(list[DecodeStepRecord])
    threaded = pa_json.ReadOptions(block_size=_READ.block_size, use_threads=True)
    parsers = {
        "Arrow, 1 thread": lambda: pa_json.read_json(
            pa.BufferReader(text), read_options=_READ, parse_options=_PARSE
        ),
        "Arrow, its own threads": lambda: pa_json.read_json(
            pa.BufferReader(text), read_options=threaded, parse_options=_PARSE
        ),
        'DuckDB read_json (casts "12", 1.5, true into BIGINT: SGLang refuses them)': lambda: (
            con.read_json(
                io.BytesIO(text),
                format="newline_delimited",
                columns=columns,
                maximum_object_size=1 << 30,
            ).to_arrow_table()
        ),
        "msgspec typed structs (one Python object per row)": lambda: typed.decode(
            b"[" + b",".join(recs) + b"]"
        ),
        "msgspec into columns (int fields typed, lists decoded in bulk)": lambda: msgspec_columns(
            recs
        ),
    }
    cpu: dict[str, list[float]] = {name: [] for name in parsers}
    for _ in range(reps):
        for name, parse in parsers.items():
            c0 = cpu_seconds()
            parse()
            cpu[name].append(cpu_seconds() - c0)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    return f"parse only, {len(recs):,} records, CPU seconds: " + "; ".join(
        f"{name} {sec:.2f}" for name, sec in med.items()
    )


def parse_path_side_by_side(body: bytes, base: Any, reps: int) -> str:
    """CPU of records_to_tables alone (one worker), this one and the baseline's, alternated."""
    recs = decode_server_info(body).dumps[0].records
    cpu: dict[str, list[float]] = {"this": [], "baseline": []}
    tables = {"this": records_to_tables, "baseline": base.records_to_tables}
    for rep in range(reps):
        for name in ("this", "baseline") if rep % 2 == 0 else ("baseline", "this"):
            c0 = cpu_seconds()
            for _ in tables[name](
                recs, run_id="b", dp_rank=0, gamma=GAMMA, mode="compact", workers=1
            ):
                pass
            cpu[name].append(cpu_seconds() - c0)
    this, old = statistics.median(cpu["this"]), statistics.median(cpu["baseline"])
    return (
        f"parse path alone (records_to_tables, 1 worker), {len(recs):,} records, CPU-s medians "
        f"of {reps}: this {this:.2f}, baseline {old:.2f} (baseline / this {old / this:.2f}x)"
    )


def phases() -> str:
    return ", ".join(f"{k} {v:.1f} s" for k, v in PHASES.items())


def naive(body: bytes, root: Path) -> tuple[float, int]:
    """json.loads, then one dict per row, then the same store writes."""
    t0 = time.perf_counter()
    doc = json.loads(body)
    fan = FanOut([Store(root)])
    rows = 0
    for dp, state in enumerate(doc["internal_states"]):
        dump = state["dspark_info_record"]
        steps, reqs = [], []
        for rec in dump["records"]:
            step = {k: v for k, v in rec.items() if k != "reqs"}
            step.update(run_id="bench", dp_rank=dp, source="sglang")
            steps.append(step)
            for r in rec.get("reqs") or []:
                row = {f: r.get(f) for f in REQ_STEPS.names if f in r}
                row.update(
                    run_id="bench", dp_rank=dp, forward_ct=rec["forward_ct"], gamma=dump["gamma"]
                )
                reqs.append(row)
        rows += fan.emit("steps", steps).num_rows + fan.emit("req_steps", reqs).num_rows
    fan.close()
    return time.perf_counter() - t0, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000, help="step records in the buffer")
    ap.add_argument("--batch", type=int, default=64, help="requests per step")
    ap.add_argument(
        "--compare-records",
        type=int,
        default=2_000,
        help="the slice timed side by side with json.loads + row-wise conversion",
    )
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the side-by-side slice")
    ap.add_argument("--full-reps", type=int, default=3, help="repetitions of the full buffer")
    ap.add_argument(
        "--baseline-records",
        type=Path,
        help="an older dspark_obs/sglang/records.py, run side by side on the full buffer",
    )
    args = ap.parse_args()
    print("rerun: python bench/bench_ring_buffer.py " + " ".join(sys.argv[1:]), flush=True)
    print(
        "load average at start: {:.1f} {:.1f} {:.1f} on {} cores".format(
            *os.getloadavg(), os.cpu_count()
        ),
        flush=True,
    )

    tmp = Path(tempfile.mkdtemp(prefix="bench-ring-"))
    try:
        small = server_info_body(args.compare_records, args.batch)
        ratios, fast_rates, slow_rates = [], [], []
        for rep in range(args.reps):
            t_fast, n_fast = ours(small, tmp / f"fast{rep}")
            t_slow, n_slow = naive(small, tmp / f"slow{rep}")
            assert n_fast == n_slow, (n_fast, n_slow)
            ratios.append(t_slow / t_fast)
            fast_rates.append(n_fast / t_fast)
            slow_rates.append(n_slow / t_slow)
        print(
            f"slice of {args.compare_records:,} records ({n_fast:,} rows, "
            f"{len(small) / 1e6:.0f} MB): ours {statistics.median(fast_rates):,.0f} rows/s, "
            f"json.loads + row-wise {statistics.median(slow_rates):,.0f} rows/s, "
            f"ratio {statistics.median(ratios):.1f}x (median of {args.reps})",
            flush=True,
        )
        print(parse_alternatives(small, args.reps), flush=True)
        base = None if args.baseline_records is None else _load(args.baseline_records)
        if base is not None:
            print(parse_path_side_by_side(small, base, args.reps), flush=True)
        del small
        gc.collect()

        t0 = time.perf_counter()
        body = server_info_body(args.records, args.batch)
        print(
            f"built a {len(body) / 1e9:.2f} GB /server_info body in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        walls, cpus, ratios = [], [], []
        for rep in range(args.full_reps):
            order = ["this", "base"] if rep % 2 == 0 else ["base", "this"]  # alternate
            for which in order if base is not None else ["this"]:
                cpu0 = cpu_seconds()
                tables = records_to_tables if which == "this" else base.records_to_tables
                wall, n = ours(body, tmp / f"{which}{rep}", tables)
                cpu_used = cpu_seconds() - cpu0
                shutil.rmtree(tmp / f"{which}{rep}", ignore_errors=True)
                if which == "this":
                    seconds, rows, this_cpu = wall, n, cpu_used
                    walls.append(wall)
                    cpus.append(cpu_used)
                else:
                    b_seconds, b_rows, b_cpu = wall, n, cpu_used
                print(
                    f"  {'full buffer' if which == 'this' else 'baseline'} rep {rep + 1}: "
                    f"{wall:.1f} s wall, {cpu_used:.1f} CPU-s; phases: {phases()}; load "
                    "average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()),
                    flush=True,
                )
            if base is not None:
                assert b_rows == rows, (b_rows, rows)
                ratios.append((b_seconds / seconds, b_cpu / this_cpu))
        if ratios:
            print(
                f"baseline / this: wall {statistics.median(r[0] for r in ratios):.2f}x, "
                f"CPU {statistics.median(r[1] for r in ratios):.2f}x (medians of {len(ratios)})"
            )
        seconds, cpu = statistics.median(walls), statistics.median(cpus)
        print(
            f"full buffer: {args.records:,} records, {rows:,} rows parsed and stored in "
            f"{seconds:.1f} s wall, {cpu:.1f} s CPU (medians of {args.full_reps}; "
            f"{cpu / (os.cpu_count() or 1):.1f} s if spread over {os.cpu_count()} idle cores) "
            f"= {rows / seconds:,.0f} rows/s (goal <= 15 s)"
        )
        print(
            "  phases: scan: msgspec over the body; parse: waiting for Arrow JSON per chunk "
            "(chunks parsed in worker threads); store: validation + Parquet segments"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
