"""What the store and the live sinks cost the decode loop: the same engine, the same prompts,
with and without sinks, interleaved in one process.

SmolLM2-135M-Instruct with the shipped drafter (``--tiny``: a tiny random model, a smoke
run), compact mode, greedy, mixed eval prompts. Per batch size, one engine serves the same
queue of ``max(--requests, --queue-factor * batch)`` requests in every variant:

* ``none``:       a fan-out with no sinks (records are still built and validated: that cost
                  is the engine's, not the sinks');
* ``prometheus``: the Prometheus sink (/metrics on 127.0.0.1, scraped every
                  ``--scrape-interval`` s by a thread here);
* ``store``:      the DuckDB/Parquet store, durable on every write;
* ``all``:        store + Prometheus + OpenTelemetry (OTLP/HTTP to a loopback receiver that
                  drops everything, exporting every ``--export-interval`` s);
* ``store-inline`` (``--inline``): the store written by whoever calls ``emit`` (``FanOut``
                  without threads): the engine's record worker thread, no thread of its own;
* ``all-inline`` (``--inline``): store + Prometheus + OpenTelemetry, all three written on the
                  record worker's thread (no FanOut thread; the telemetry sinks still fold
                  on their own fold threads): the layout ``dspark-obs run`` used up to
                  2026-12-07;
* ``telemetry-process`` (``--inline``): the store on the record worker's thread,
                  Prometheus and OpenTelemetry in a :class:`SinkProcess` (a child interpreter
                  fed over a pipe, serving /metrics itself): the layout ``dspark-obs run``
                  used on 2026-12-07;
* ``all-process`` (``--inline``): the store, Prometheus and OpenTelemetry all in one
                  :class:`SinkProcess`, written from the record worker's thread: the layout
                  ``dspark-obs run`` uses. A child's CPU is not in the "process CPU" column.

Sinks get their own threads (``FanOut(threaded=True)``, queues of ``--queue-batches``)
unless the variant says inline; ``--variants`` picks a subset (``none`` always runs). One
untimed warm-up run per batch size precedes ``--reps`` repetitions; each repetition runs
every variant once, in an order that rotates, and divides each variant's tokens/s by the
``none`` run of the same repetition; the table reports the median ratio (and the median
tokens/s). Throughput is committed tokens / the engine run's own seconds; the fan-out's
close (draining what is still queued) is timed apart, and the backpressure counters
(producer blocked count and seconds, max queue depth) are reported per sink.

    OMP_NUM_THREADS=1 python bench/bench_sink_overhead.py --device cpu --batch 1 \
        --requests 2 --new-tokens 24 --inline --out runtime/bench/sink_overhead_cpu_b1.json
    python bench/bench_sink_overhead.py --device cuda --batch 1,16,64 --new-tokens 128 \
        --requests 16 --variants all,all-inline,store --queue-file q.jsonl \
        --out runtime/bench/sink_overhead_cuda_host2.json

On a loaded CPU (other processes running) torch's OpenMP threads spin against each other:
``OMP_NUM_THREADS=1`` keeps one run from taking minutes, and the CPU-time ratios (this
thread's, the process's) are the figures that mean something there; wall time mostly
measures the scheduler.

Writes ``--out`` (JSON with every raw number) and a Markdown table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_obs.engine.loop import Engine
from dspark_obs.engine.session import (
    Models,
    load_cost_table,
    load_models,
    traffic_to_requests,
)
from dspark_obs.engine.types import EngineConfig, GenRequest
from dspark_obs.fanout import FanOut, RecordSink
from dspark_obs.sinks import OtelSink, PrometheusSink
from dspark_obs.sinks.process import SinkProcess
from dspark_obs.sinks.serve import start_http
from dspark_obs.store import Store
from dspark_obs.testing.otlp_drop import start_otlp_drop
from dspark_obs.testing.tiny_models import tiny_models
from dspark_obs.workloads import load_traffic, mixed_traffic

VARIANTS = ("none", "prometheus", "store", "all")
INLINE = ("store-inline", "all-inline", "telemetry-process", "all-process")  # FanOut without
# threads: sinks on the record worker (*-process: some or all of them in a child process)
# the --tiny models: a 64-token vocabulary, the drafter config's own Markov rank and window
TINY = dict(vocab_size=64, max_position=1024, markov_rank=None, context_window=None,
            drafter_name="tiny")  # fmt: skip


def requests_for(
    models: Models, n: int, new_tokens: int, tiny: bool, queue_file: Path | None = None
) -> list[GenRequest]:
    if tiny:
        rng = np.random.default_rng(0)
        return [
            GenRequest(rid=f"r{i}", prompt_ids=rng.integers(0, 64, size=12).tolist(),
                       max_new_tokens=new_tokens, workload=("math", "chat", "poetry")[i % 3],
                       ignore_eos=True)
            for i in range(n)
        ]  # fmt: skip
    if queue_file is None:
        traffic = mixed_traffic(n, seed=0, max_new_tokens=new_tokens)
    else:  # a saved queue (bench_throughput.py --save-queue): no prompt sources needed
        traffic = load_traffic(queue_file)
        if len(traffic) < n:
            raise SystemExit(f"{queue_file} holds {len(traffic)} requests, {n} needed")
        traffic = traffic[:n]
        for t in traffic:
            t.max_new_tokens, t.arrival_step, t.temperature = new_tokens, 0, 0.0
    return traffic_to_requests(traffic, models.tokenizer)


class LiveSinks:
    """The sinks of one variant, with what serves them (scraper, HTTP server)."""

    def __init__(self, variant: str, store_dir: Path, otlp_url: str, args: Any) -> None:
        self.sinks: list[RecordSink] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._servers: list[Any] = []
        if variant in ("store", "all", "store-inline", "all-inline", "telemetry-process"):
            self.sinks.append(Store(store_dir))
        if variant in ("telemetry-process", "all-process"):
            child = SinkProcess(
                store_dir if variant == "all-process" else None, 0, otlp_url,
                export_interval_s=args.export_interval,
            )  # fmt: skip
            self.sinks.append(child)
            self._scraped(child.url, args.scrape_interval)
        if variant in ("prometheus", "all", "all-inline"):
            prom = PrometheusSink()
            server = start_http(prom.registry, 0)
            self._servers.append(server)
            self.sinks.append(prom)

            self._scraped(server.url, args.scrape_interval)
            if variant in ("all", "all-inline"):
                self.sinks.append(
                    OtelSink(otlp_url, aggregator=prom.aggregator,
                             export_interval_s=args.export_interval)
                )  # fmt: skip
        for t in self._threads:
            t.start()

    def _scraped(self, url: str, interval: float) -> None:
        """Prometheus' side: a GET /metrics every scrape interval, from a thread here."""

        def scrape() -> None:
            while not self._stop.wait(interval):
                try:
                    urllib.request.urlopen(f"{url}/metrics", timeout=5).read()
                except OSError:  # the run is closing: its server went first
                    return

        self._threads.append(threading.Thread(target=scrape, daemon=True))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        for s in self._servers:
            s.close()


def median_interval(values: list[float], level: float = 0.9) -> tuple[float, float, float]:
    """A distribution-free interval for the median of ``values``: the k-th smallest and the
    k-th largest, with the largest k whose coverage 1 - 2 P(Binomial(n, 1/2) < k) is at
    least ``level`` (k = 1, min to max, up to 7 values at 90%). Returns (low, high, coverage):
    a ratio's median is an estimate, and with repetitions spread +-5% this says how far."""
    xs, n = sorted(values), len(values)

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def variant_list(text: str | None, inline: bool) -> list[str]:
    """The variants a run compares, ``none`` (the baseline every ratio divides by) first."""
    if text is None:
        return list(VARIANTS) + (list(INLINE) if inline else [])
    wanted = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in VARIANTS + INLINE]
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}; "
                         f"choose from {', '.join(VARIANTS + INLINE)}")
    return ["none"] + [v for v in dict.fromkeys(wanted) if v != "none"]


def one_run(
    engine: Engine, reqs: list[GenRequest], variant: str, tmp: Path, otlp_url: str, tag: str,
    args: Any,
) -> dict[str, Any]:  # fmt: skip
    store_dir = tmp / tag
    live = LiveSinks(variant, store_dir, otlp_url, args)
    threaded = variant not in INLINE
    fan = FanOut(live.sinks, threaded=threaded, queue_batches=args.queue_batches)
    c0, p0 = time.thread_time(), time.process_time()
    res = engine.run(reqs, fan.emit, tag)
    decode_cpu, process_cpu = time.thread_time() - c0, time.process_time() - p0
    t0 = time.perf_counter()
    lanes = [asdict(s) for s in fan.drain()]
    fan.close()
    close_s = time.perf_counter() - t0
    live.stop()
    shutil.rmtree(store_dir, ignore_errors=True)
    assert not fan.errors, [str(e) for e in fan.errors[:3]]
    return {
        "variant": variant,
        "tokens": res.committed_tokens,
        "steps": res.steps,
        "seconds": res.seconds,
        "tok_s": res.tokens_per_second,
        "close_seconds": close_s,
        "decode_thread_cpu_s": decode_cpu,  # this thread only: what the decode loop spent
        "process_cpu_s": process_cpu,  # every thread (sinks, torch's pool) during the run
        "lanes": lanes,
        "outputs": res.outputs,
    }


def bench_batch(models: Models, bs: int, args: Any, tmp: Path, otlp_url: str) -> dict[str, Any]:
    table = None if args.tiny else load_cost_table(args.cost_table, args.device)
    config = EngineConfig(  # compiled on a GPU, as bench_throughput.py runs it
        mode=args.mode, gamma=5, max_batch=bs, cost_table=table, compile=args.device == "cuda",
        flush_every=args.flush_every,
    )  # fmt: skip
    engine = Engine(models.target, models.drafter, config, models.stop_ids)
    n = max(args.requests, args.queue_factor * bs)
    reqs = requests_for(models, n, args.new_tokens, args.tiny, args.queue_file)
    variants = args.variant_list
    print(f"batch {bs}: {len(reqs)} requests, warm-up", file=sys.stderr)
    one_run(engine, reqs, "all", tmp, otlp_url, f"warm-{bs}", args)
    reps: list[dict[str, dict[str, Any]]] = []
    for rep in range(args.reps):
        k = rep % len(variants)
        order = variants[k:] + variants[:k]
        runs = {v: one_run(engine, reqs, v, tmp, otlp_url, f"b{bs}-{v}-{rep}", args)
                for v in order}  # fmt: skip
        base = runs["none"]["outputs"]
        for v, r in runs.items():  # the sinks must not change what is decoded
            assert r.pop("outputs") == base, f"batch {bs} {v}: outputs differ from none"
        reps.append(runs)
        line = ", ".join(f"{v} {runs[v]['tok_s']:.1f}" for v in variants)
        print(f"batch {bs} rep {rep}: tok/s {line}", file=sys.stderr)
    summary = {}
    for v in variants:
        ratios = [r[v]["tok_s"] / r["none"]["tok_s"] for r in reps]
        summary[v] = {
            "median_tok_s": statistics.median(r[v]["tok_s"] for r in reps),
            "median_ratio": statistics.median(ratios),
            "median_ratio_interval": median_interval(ratios),
            "ratios": ratios,
            "max_queue_depth": max((ln["max_depth"] for r in reps for ln in r[v]["lanes"]),
                                   default=0),
            "blocked": sum(ln["blocked"] for r in reps for ln in r[v]["lanes"]),
            "blocked_seconds": sum(ln["blocked_seconds"] for r in reps for ln in r[v]["lanes"]),
            "median_close_seconds": statistics.median(r[v]["close_seconds"] for r in reps),
            # time in the sinks' write calls, wherever they ran (the record worker's thread,
            # inline): what the producer's process paid for its sinks
            "median_write_seconds": statistics.median(
                sum(ln["work_seconds"] for ln in r[v]["lanes"]) for r in reps
            ),
            "median_seconds": statistics.median(r[v]["seconds"] for r in reps),
            "decode_cpu_ratio": statistics.median(
                r[v]["decode_thread_cpu_s"] / r["none"]["decode_thread_cpu_s"] for r in reps
            ),
            "process_cpu_ratio": statistics.median(
                r[v]["process_cpu_s"] / r["none"]["process_cpu_s"] for r in reps
            ),
        }  # fmt: skip
    return {"batch": bs, "requests": len(reqs), "reps": reps, "summary": summary}


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    variants = list(results[0]["summary"])
    lines = [
        f"Sink overhead, {meta['model']} on {meta['device']}, {meta['mode']}, "
        f"{meta['new_tokens']} new tokens, records every {meta['flush_every']} steps or 1 s, "
        f"{meta['reps']} reps (median of per-rep ratios), "
        f"{meta['torch_threads']} torch thread(s), load average {meta['load_average_1m_end']:.1f}"
        " at the end",
        "",
        "| batch | variant | tok/s | tok/s / none (interval, coverage) | decode-thread CPU / none "
        "| process CPU / none | producer blocked (s) | max queue | sink writes s / run s "
        "| close s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for v in variants:
            s = res["summary"][v]
            lo, hi, cov = s["median_ratio_interval"]
            lines.append(
                f"| {res['batch']} | {v} | {s['median_tok_s']:.1f} | {s['median_ratio']:.4f} "
                f"({lo:.3f}-{hi:.3f}, {cov:.0%}) "
                f"| {s['decode_cpu_ratio']:.4f} | {s['process_cpu_ratio']:.4f} "
                f"| {s['blocked']}x ({s['blocked_seconds']:.3f}) | {s['max_queue_depth']} "
                f"| {s['median_write_seconds']:.3f} / {s['median_seconds']:.2f} "
                f"| {s['median_close_seconds']:.3f} |"
            )
    lines += ["", f"`{meta['command']}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--batch", default="1,8", help="comma list of batch sizes")
    ap.add_argument("--requests", type=int, default=4, help="queue length, at least ...")
    ap.add_argument("--queue-factor", type=int, default=2, help="... this many per slot")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mode", default="compact")
    ap.add_argument("--cost-table", default=None, help="default: the shipped table of --device")
    ap.add_argument("--queue-batches", type=int, default=16, help="queue bound per sink")
    ap.add_argument("--flush-every", type=int, default=EngineConfig.flush_every,
                    help="steps per record hand-over (or one second, whichever first)")
    ap.add_argument("--scrape-interval", type=float, default=15.0)
    ap.add_argument("--export-interval", type=float, default=10.0)
    ap.add_argument("--inline", action="store_true",
                    help="also run the inline variants (sinks on the record worker's thread)")
    ap.add_argument("--variants", default=None,
                    help=f"comma list from {', '.join(VARIANTS + INLINE)} (default: the first "
                    "four, plus the inline ones with --inline); none is always run")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (smoke run)")
    ap.add_argument(
        "--switch-interval", type=float, default=None,
        help="sys.setswitchinterval (s): how long a sink thread may hold the GIL (default 5 ms)",
    )  # fmt: skip
    ap.add_argument("--queue-file", type=Path, default=None,
                    help="replay this saved queue (JSONL) instead of building one from the prompts")
    ap.add_argument("--drafter", default=None, help="drafter checkpoint (default: the shipped one)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (a .md goes beside it)")
    args = ap.parse_args()
    args.variant_list = variant_list(args.variants, args.inline)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    models = tiny_models(**TINY) if args.tiny else load_models(args.drafter, device=args.device)
    if args.tiny and args.device != "cpu":
        models = replace(models, target=models.target.to(args.device),
                         drafter=models.drafter.to(args.device))  # fmt: skip
    receiver, otlp_url = start_otlp_drop()
    batches = [int(b) for b in args.batch.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        results = [bench_batch(models, bs, args, Path(tmp), otlp_url) for bs in batches]
    receiver.shutdown()
    meta = {
        "model": models.model_name,
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "mode": args.mode,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "flush_every": args.flush_every,
        "torch_threads": torch.get_num_threads(),
        "switch_interval_s": sys.getswitchinterval(),
        "load_average_1m_end": os.getloadavg()[0],  # a shared machine: how busy it was
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": "python " + shlex.join(sys.argv),
    }
    md = markdown(results, meta)
    print(md)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(md)


if __name__ == "__main__":
    main()
