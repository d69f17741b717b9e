"""Observability overhead: the same engine run with the live telemetry sinks on vs off.

SmolLM2-135M-Instruct (fp32, CPU) with the shipped drafter, compact mode, mixed eval prompts.
Four variants run on the same requests in one process, interleaved, ``--reps`` times:

* ``off``:       no sinks at all (the FanOut still validates every batch);
* ``telemetry``: Prometheus (/metrics served, scraped every ``--scrape-interval`` s by a
                 thread here) + OpenTelemetry (OTLP/HTTP to a loopback receiver, exporting
                 every ``--export-interval`` s). Defaults 15 s / 10 s (a common scrape
                 interval; OTel's default export interval is 60 s); 1 / 1 is a stress setting;
* ``store``:     the DuckDB/Parquet store only (what ``dspark-obs run`` always does);
* ``all``:       the store + the telemetry.

Each repetition's wall time is compared with the ``off`` run of the same repetition; the
table reports medians over repetitions. The telemetry's own share is ``telemetry`` / ``off``
(and ``all`` / ``store``); the store's fsyncs make wall time noisy on a shared disk, so process
CPU time and the aggregation's own CPU time are reported beside it.

    python bench/bench_observability.py [--requests 6] [--new-tokens 24] [--reps 4] [--tiny]
        [--scrape-interval 15] [--export-interval 10]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

from dspark_obs.engine.session import (
    Models,
    load_cost_table,
    load_models,
    run_with_companion,
    traffic_to_requests,
)
from dspark_obs.engine.types import EngineConfig, GenRequest
from dspark_obs.sinks import OtelSink, PrometheusSink
from dspark_obs.sinks.serve import start_http
from dspark_obs.store import Store
from dspark_obs.testing.otlp_drop import start_otlp_drop
from dspark_obs.testing.tiny_models import tiny_models
from dspark_obs.workloads import mixed_traffic


def tiny_setup(n: int, new_tokens: int) -> tuple[Models, list[GenRequest]]:
    models = tiny_models(
        vocab_size=6, max_position=1024, markov_rank=None, context_window=None, drafter_name="tiny"
    )
    rng = np.random.default_rng(0)
    reqs = [
        GenRequest(
            rid=f"r{i}",
            prompt_ids=rng.integers(0, 6, size=8).tolist(),
            max_new_tokens=new_tokens,
            workload=("math", "chat", "poetry")[i % 3],
            temperature=1.0,
            seed=i,
        )  # fmt: skip
        for i in range(n)
    ]
    return models, reqs


def one_run(models, reqs, config, variant: str, tmp: Path, otlp_url: str, rep: int, args):
    sinks, extra = [], []
    store_dir = tmp / f"{variant}-{rep}"
    if variant in ("store", "all"):
        sinks.append(Store(store_dir))
    if variant in ("telemetry", "all"):
        prom = PrometheusSink()
        server = start_http(prom.registry, 0)
        otel = OtelSink(
            otlp_url, aggregator=prom.aggregator, export_interval_s=args.export_interval
        )
        sinks += [prom, otel]
        stop = threading.Event()

        def scrape() -> None:  # Prometheus' side: a GET /metrics every scrape interval
            while not stop.wait(args.scrape_interval):
                urllib.request.urlopen(f"{server.url}/metrics", timeout=5).read()

        scraper = threading.Thread(target=scrape, daemon=True)
        scraper.start()
        extra = [stop, scraper, server]
    t0, c0 = time.perf_counter(), time.process_time()
    run_with_companion(models, reqs, config, sinks, f"bench-{variant}-{rep}", companion=False)
    for s in sinks:
        s.close()  # part of the cost: flushes what is still queued
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    fold = 0.0
    if extra:
        extra[0].set()
        extra[1].join()
        extra[2].close()
        fold = sinks[-2].fold_cpu_seconds
    shutil.rmtree(store_dir, ignore_errors=True)
    return seconds, cpu, fold


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--scrape-interval", type=float, default=15.0)
    ap.add_argument("--export-interval", type=float, default=10.0)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (fast smoke run)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    if args.tiny:
        models, reqs = tiny_setup(args.requests, args.new_tokens)
        table = None
    else:
        models = load_models(device=args.device)
        traffic = mixed_traffic(args.requests, seed=0, max_new_tokens=args.new_tokens)
        reqs = traffic_to_requests(traffic, models.tokenizer)
        table = load_cost_table(None, args.device)
    config = EngineConfig(mode="compact", gamma=5, max_batch=args.max_batch, cost_table=table)
    receiver, otlp_url = start_otlp_drop()

    variants = ("off", "telemetry", "store", "all")
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpus: dict[str, list[float]] = {v: [] for v in variants}
    fold_share: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        one_run(models, reqs, config, "all", Path(tmp), otlp_url, -1, args)  # warm-up
        for rep in range(args.reps):
            order = variants if rep % 2 == 0 else variants[::-1]  # interleaved, alternating
            for v in order:
                wall, cpu, fold = one_run(models, reqs, config, v, Path(tmp), otlp_url, rep, args)
                times[v].append(wall)
                cpus[v].append(cpu)
                if v == "telemetry":
                    fold_share.append(fold / wall)
            print(f"rep {rep}: " + ", ".join(f"{v} {times[v][-1]:.2f}s" for v in variants))
    receiver.shutdown()

    def ratio(d: dict[str, list[float]], a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(d[a], d[b], strict=True))

    print()
    print("| variant | median wall s | wall / off | process CPU / off |")
    print("|---|---|---|---|")
    for v in variants:
        print(
            f"| {v} | {statistics.median(times[v]):.3f} | {ratio(times, v, 'off'):.4f} "
            f"| {ratio(cpus, v, 'off'):.4f} |"
        )
    print(
        f"\nall / store: wall {ratio(times, 'all', 'store'):.4f}, process CPU "
        f"{ratio(cpus, 'all', 'store'):.4f}; aggregation CPU / run wall (median): "
        f"{statistics.median(fold_share):.4%}"
    )
    model = "tiny" if args.tiny else "SmolLM2-135M"
    print(
        f"{model}, {args.requests} requests x {args.new_tokens} tokens, batch {args.max_batch}, "
        f"{args.reps} reps, {torch.get_num_threads()} torch threads, scrape every "
        f"{args.scrape_interval:g} s, OTLP export every {args.export_interval:g} s"
    )
    flags = " --tiny" if args.tiny else ""
    print(
        f"rerun: python bench/bench_observability.py --requests {args.requests} "
        f"--new-tokens {args.new_tokens} --max-batch {args.max_batch} --reps {args.reps} "
        f"--scrape-interval {args.scrape_interval:g} --export-interval {args.export_interval:g}"
        f"{flags}"
    )


if __name__ == "__main__":
    main()
