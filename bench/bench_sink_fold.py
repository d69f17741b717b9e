"""Where the sinks spend their CPU: each table's telemetry fold, the estimator pass, and the
store's write, per record hand-over size.

A tiny random model (64-token vocabulary) runs compact with a trimming cost table at each
``--batch``, handing its records over every ``--flush-every`` steps (each value in turn; the
one-second trigger off). Its record batches are then, on this thread:

* folded into a Prometheus sink (shared with an OTel sink over in-memory exporters): thread
  CPU per table, with the block-accept estimator pass over the finished requests
  (``finalize``) apart, at the start of a run and in its steady state;
* emitted through a FanOut into a fresh store: validation plus the store's write, which the
  engine's record worker pays per hand-over whatever its size.

Most of it is Python holding the interpreter lock, so in the engine's process every
millisecond of it is one the decode thread may wait for (README, "Records and sinks off the
decode thread"). Medians of ``--reps``.

    python bench/bench_sink_fold.py --batch 1,16,64 --flush-every 32,256 --reps 3 \
        --out runtime/bench/sink_fold_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dspark_obs.analytics.estimator_live import REFIT_EVERY, RunTail
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.types import EngineConfig
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.sinks import OtelSink, PrometheusSink
from dspark_obs.sinks.serve import TABLE_ORDER
from dspark_obs.store import Store
from dspark_obs.testing.tiny_models import tiny_models, trimming_table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run from anywhere: a sibling bench
from bench_sink_overhead import TINY, requests_for  # noqa: E402 - the same tiny model and requests

TABLES = TABLE_ORDER  # the runs row first: labels need it


def records(bs: int, new_tokens: int, flush_every: int) -> tuple[MemorySink, int]:
    """One compact run's record batches at batch ``bs`` (2 requests per slot): the tiny model
    and requests of ``bench_sink_overhead.py --tiny``."""
    models = tiny_models(**TINY)
    config = EngineConfig(mode="compact", gamma=5, max_batch=bs, cost_table=trimming_table(),
                          flush_every=flush_every, flush_seconds=1e9)  # fmt: skip
    engine = Engine(models.target, models.drafter, config, models.stop_ids)
    reqs = requests_for(models, 2 * bs, new_tokens, tiny=True)
    mem = MemorySink()
    fan = FanOut([mem])
    fan.emit("runs", [engine.run_row("b", model="tiny", drafter="tiny", workload="mixed",
                                     temperature=0.0, seed=0)])  # fmt: skip
    result = engine.run(reqs, fan.emit, "b")
    fan.close()
    return mem, result.steps


def fold_once(mem: MemorySink, steady: bool = False) -> dict[str, float]:
    """Thread CPU seconds per table, and the estimator pass (``finalize``), of one fold.

    ``steady``: as if the run had already finished 1,025 requests, past the tail-model refits
    at 1, 2, 4, ... 512 requests that split the first passes of a run into many estimator
    calls (``analytics.estimator_live.refits_at``): one call covers the whole pass then."""
    prom = PrometheusSink(background=False)
    if steady:  # seeds the aggregator's private per-run tail state
        prom.aggregator._tails["b"] = RunTail(finished=REFIT_EVERY * 2 + 1)
    spans = TracerProvider()
    spans.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    OtelSink(aggregator=prom.aggregator, tracer_provider=spans,
             meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]))  # fmt: skip
    prom.aggregator.finalize_interval_s = float("inf")  # one estimator pass, at the end
    spent: Counter[str] = Counter()
    batches: list[tuple[str, pa.Table]] = [(t, b) for t in TABLES for b in mem.batches[t]]
    for table, batch in sorted(batches, key=lambda tb: tb[0] != "runs"):
        t0 = time.thread_time()
        prom.write(table, batch)
        spent[table] += time.thread_time() - t0
    t0 = time.thread_time()
    prom.flush()
    spent["finalize"] = time.thread_time() - t0
    assert not prom.errors, prom.errors
    return dict(spent)


def store_once(mem: MemorySink) -> float:
    """Thread CPU seconds of validating and storing every batch but the runs row."""
    with tempfile.TemporaryDirectory() as tmp:
        fan = FanOut([Store(Path(tmp) / "store")])
        fan.emit("runs", mem.batches["runs"][0])  # creates the store: not per hand-over
        t0 = time.thread_time()
        for table in TABLES[1:]:
            for batch in mem.batches[table]:
                fan.emit(table, batch)
        spent = time.thread_time() - t0
        fan.close()
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", default="1,16,64", help="comma list of batch sizes")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--flush-every", default="32,256", help="comma list: steps per hand-over")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="JSON path (a .md goes beside it)")
    args = ap.parse_args()
    rows = []
    for bs in (int(b) for b in args.batch.split(",")):
        for every in (int(f) for f in args.flush_every.split(",")):
            mem, steps = records(bs, args.new_tokens, every)
            reps = [fold_once(mem) for _ in range(args.reps)]
            med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
            store = statistics.median(store_once(mem) for _ in range(args.reps))
            steady = statistics.median(fold_once(mem, True)["finalize"] for _ in range(args.reps))
            finished = sum(b.num_rows for b in mem.batches["requests"])
            rows.append({
                "batch": bs, "flush_every": every, "steps": steps, "requests": finished,
                "handovers": len(mem.batches["steps"]),
                "req_steps_rows": sum(b.num_rows for b in mem.batches["req_steps"]),
                "seconds": med,
                "fold_us_per_step": 1e6 * (sum(med.values()) - med["finalize"]) / steps,
                "estimator_ms_per_request": 1e3 * med["finalize"] / finished,
                "steady_estimator_ms_per_request": 1e3 * steady / finished,
                "store_us_per_step": 1e6 * store / steps,
            })  # fmt: skip
            last = rows[-1]
            print(f"batch {bs}, every {every}: fold {last['fold_us_per_step']:.0f} us/step, "
                  f"estimator {last['estimator_ms_per_request']:.2f} ms/request, validate + "
                  f"store {last['store_us_per_step']:.0f} us/step", file=sys.stderr)  # fmt: skip
    command = "python " + shlex.join(sys.argv)
    lines = [
        f"Sink CPU, tiny model, compact, {args.new_tokens} new tokens, "
        f"{platform.processor() or platform.machine()}, thread CPU, medians of {args.reps}",
        "",
        "| batch | steps per hand-over | hand-overs | finished requests | telemetry fold us/step "
        "| steps / req_steps / requests fold ms | estimator pass ms | estimator ms/request "
        "| estimator ms/request, steady state | validate + store us/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["seconds"]
        lines.append(
            f"| {r['batch']} | {r['flush_every']} | {r['handovers']} | {r['requests']} "
            f"| {r['fold_us_per_step']:.0f} | {1e3 * s['steps']:.1f} / {1e3 * s['req_steps']:.1f}"
            f" / {1e3 * s['requests']:.1f} | {1e3 * s['finalize']:.1f} "
            f"| {r['estimator_ms_per_request']:.2f} | {r['steady_estimator_ms_per_request']:.2f} "
            f"| {r['store_us_per_step']:.0f} |"
        )
    lines += ["", f"`{command}`"]
    print("\n".join(lines))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": command, "rows": rows}, indent=1))
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
