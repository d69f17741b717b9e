"""Where a DSpark step's wall time goes on the batched engine: overlap on vs off, GPU busy
share, and the cost table's predicted vs measured step time.

For each batch size, DSpark compact serves the same queue with ``overlap`` on (step k's
records are built while the device drafts step k + 1) and off, interleaved, ``--reps``
times; the ratio of tokens/s is taken within each repetition, then the median. On CUDA one
more run at the first batch size goes under ``torch.profiler``: GPU busy = the union of
kernel intervals over the wall time of the run's decode loop. Every compact step records the
cost table's prediction beside its measured time; the median relative error is reported.

    python bench/bench_overlap.py --device cuda --batch 1,16,64 --queue-file q.jsonl
    python bench/bench_overlap.py --device cpu --batch 1,4 --new-tokens 32 --reps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dspark_obs.engine.loop import Engine
from dspark_obs.engine.session import load_cost_table, load_models, traffic_to_requests
from dspark_obs.engine.types import EngineConfig
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.workloads import load_traffic


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(models: Any, reqs: list, bs: int, table: Any, args: argparse.Namespace,
        overlap: bool) -> tuple[float, Any]:
    """One compact run: (tokens/s, the steps table as a DataFrame)."""
    cfg = EngineConfig(mode="compact", gamma=5, max_batch=bs, cost_table=table,
                       overlap=overlap, compile=args.compile)
    eng = Engine(models.target, models.drafter, cfg, models.stop_ids)
    sink = MemorySink()
    sync(args.device)
    t0 = time.perf_counter()
    res = eng.run(reqs, FanOut([sink]).emit, f"overlap-{overlap}-{bs}")
    sync(args.device)
    return res.committed_tokens / (time.perf_counter() - t0), sink.table("steps").to_pandas()


def gpu_busy(models: Any, reqs: list, bs: int, table: Any, args: argparse.Namespace) -> float:
    """Share of a run's wall time during which some kernel ran (torch.profiler, CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    run(models, reqs, bs, table, args, True)  # warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run(models, reqs, bs, table, args, True)
        wall = time.perf_counter() - t0
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type.name == "CUDA"
    )
    busy, cur = 0.0, None
    for start, end in spans:
        if cur is None or start > cur[1]:
            busy += 0.0 if cur is None else cur[1] - cur[0]
            cur = [start, end]
        else:
            cur[1] = max(cur[1], end)
    busy += 0.0 if cur is None else cur[1] - cur[0]
    return busy / 1e6 / wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--queue-file", required=True, help="workload JSONL (bench_throughput's)")
    ap.add_argument("--queue-factor", type=float, default=2.0)
    ap.add_argument("--cost-table", default=None)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--out", default=None, help="JSON (out/bench_overlap_<device>.json)")
    args = ap.parse_args(argv)
    args.compile = args.device == "cuda" if args.compile is None else args.compile
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    models = load_models(device=args.device, dtype=dtype)
    table = load_cost_table(args.cost_table, args.device)
    traffic = load_traffic(args.queue_file)
    out: dict[str, Any] = {"command": " ".join(["python", "bench/bench_overlap.py", *sys.argv[1:]]),
                           "device": args.device, "batches": {}}
    for bs in [int(b) for b in args.batch.split(",")]:
        n = max(24, int(args.queue_factor * bs))
        reqs = traffic_to_requests(traffic[:n], models.tokenizer)
        for r in reqs:
            r.max_new_tokens, r.arrival_step = args.new_tokens, 0
        run(models, reqs, bs, table, args, True)  # warm (graphs, compile)
        on, off, ratios, errors = [], [], [], []
        for _ in range(args.reps):
            a, steps = run(models, reqs, bs, table, args, True)
            b, _ = run(models, reqs, bs, table, args, False)
            on.append(a)
            off.append(b)
            ratios.append(a / b)
            pred = steps.predicted_step_ms.astype(float)
            ok = pred.notna()
            errors += list((pred[ok] - steps.step_cpu_ms[ok]).abs() / steps.step_cpu_ms[ok])
        row = {
            "overlap_on_tok_s": statistics.median(on),
            "overlap_off_tok_s": statistics.median(off),
            "ratio_on_off": statistics.median(ratios),
            "ratios": ratios,
            "predicted_step_median_rel_error": statistics.median(errors) if errors else None,
        }
        if args.device == "cuda" and bs == int(args.batch.split(",")[0]):
            row["gpu_busy"] = gpu_busy(models, reqs, bs, table, args)
        out["batches"][bs] = row
        log(f"bs={bs}: on {row['overlap_on_tok_s']:.0f} tok/s, off {row['overlap_off_tok_s']:.0f},"
            f" ratio {row['ratio_on_off']:.3f}; predicted-step error "
            f"{row['predicted_step_median_rel_error']}; gpu busy {row.get('gpu_busy')}")
    path = Path(args.out or f"out/bench_overlap_{args.device}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["batches"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
