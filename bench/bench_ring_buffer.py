"""Parse and store one full SGLang ring buffer, as GET /server_info returns it.

200,000 DecodeStepRecords (SGLang's INFO_DUMP_MAX_RECORDS) at batch 64 with the ``reqs``
component: 12.8 million ReqDetails with draft tokens, confidence and survival (about 4 GB of
JSON). Measured: the collector's path (msgspec scan keeping each record as a raw slice, Arrow's
JSON reader per chunk, chunks in parallel, validated store writes) over the whole buffer, wall
and CPU time (CPU is the quiet-machine proxy while other work loads the cores); and, side by
side on a slice of it, the same path against ``json.loads`` + row-wise conversion to dicts +
the same store writes (the whole buffer that way would need tens of GB of Python objects).

    python bench/bench_ring_buffer.py                     # the full buffer (goal <= 15 s)
    python bench/bench_ring_buffer.py --records 20000     # a quicker look
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from dspark_obs.fanout import FanOut
from dspark_obs.schema import REQ_STEPS
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
        b'{"model_path":"bench","startup_time":1.0,"internal_states":[{"dspark_info_record":',
        head.encode(),
        b',"records":[',
    ]
    parts.append(b",".join(b'{"forward_ct":%d' % i + tails[i % len(tails)] for i in range(records)))
    parts.append(b']}}],"version":"0.5.23"}')
    return b"".join(parts)


PHASES: dict[str, float] = {}


def cpu_seconds() -> float:
    """CPU time of this process (every thread) and its children: on a loaded machine the
    proxy for what the work costs on a quiet one."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def ours(body: bytes, root: Path) -> tuple[float, int]:
    """The collector's path: scan, Arrow per chunk, validated store writes."""
    t0 = time.perf_counter()
    info = decode_server_info(body)
    PHASES["scan"] = time.perf_counter() - t0
    PHASES["parse"] = PHASES["store"] = 0.0
    fan = FanOut([Store(root)])
    rows = 0
    for dp, dump in enumerate(info.dumps):
        chunks = records_to_tables(
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


def parse_alternatives(body: bytes, reps: int) -> str:
    """CPU time to parse one slice (medians of ``reps``): Arrow's JSON reader single-threaded
    (what records_to_tables runs, a chunk per core) and with its own threads, DuckDB's
    read_json, msgspec typed structs. CPU, not wall: on a shared machine wall time is mostly
    waiting for a core."""
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
        del small
        gc.collect()

        t0 = time.perf_counter()
        body = server_info_body(args.records, args.batch)
        print(
            f"built a {len(body) / 1e9:.2f} GB /server_info body in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        cpu0 = cpu_seconds()
        seconds, rows = ours(body, tmp / "full")
        cpu = cpu_seconds() - cpu0
        print(
            f"full buffer: {args.records:,} records, {rows:,} rows parsed and stored in "
            f"{seconds:.1f} s wall, {cpu:.1f} s CPU ({cpu / (os.cpu_count() or 1):.1f} s if "
            f"spread over {os.cpu_count()} idle cores) = {rows / seconds:,.0f} rows/s (goal "
            "<= 15 s); load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
        )
        print(
            f"  phases: {phases()} (scan: msgspec over the body; parse: Arrow JSON per "
            "chunk; store: validation + Parquet segments)"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
