"""Sampled rows on the device against the split step, on SmolLM2 with the shipped drafter.

A whole-block step accepts sampled rows by rejection sampling in the verify's own replay
(``dspark_obs.engine.device_sampling``; ``EngineConfig(device_sampling=True)``); the split step
(``device_sampling=False``, the CPU's default) reads the drafts back, verifies, and accepts
each request on the host. This bench serves the same
sampled queue both ways, interleaved within each repetition (the order rotates), and reports
total tokens/s, the ratio device / split taken within each repetition (medians), the accept
length, and how many requests committed exactly the same tokens both ways (on the CPU in
fp32 both paths decide from the same bits, except where a vocabulary above 32,768 lets the
host's multithreaded top-p sum round apart: see the module docstring of device_sampling).

    python bench/bench_sampled_step.py --device cpu --batch 1,8 --reps 3
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from dspark_obs.engine.loop import Engine
from dspark_obs.engine.session import load_cost_table, load_models, traffic_to_requests
from dspark_obs.engine.types import EngineConfig, GenRequest
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.testing.throughput_bench import build_queue, queue_size
from dspark_obs.workloads import load_traffic

PATHS = {"device": True, "split": False}  # name -> EngineConfig.device_sampling


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def serve(models: Any, reqs: list[GenRequest], bs: int, on_device: bool, args: Any) -> dict:
    """One run of the queue; tokens, seconds, steps, accept length and the outputs."""
    cfg = EngineConfig(mode=args.mode, max_batch=bs, cost_table=args.table,
                       device_sampling=on_device)  # fmt: skip
    sink = MemorySink()
    eng = Engine(models.target, models.drafter, cfg, models.stop_ids)
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = eng.run([GenRequest(**vars(r)) for r in reqs], FanOut([sink]).emit, "sampled")
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    acc = sink.table("req_steps").column("acc_len").to_pylist()
    return {"tokens": res.committed_tokens, "seconds": seconds, "steps": res.steps,
            "accept_length": sum(acc) / max(1, len(acc)), "outputs": res.outputs}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--prompts", type=int, default=6, help="requests per batch size (at least)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (medians)")
    ap.add_argument("--mode", choices=("static", "compact"), default="compact")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--cost-table", default=None, help="default: the shipped table")
    ap.add_argument("--queue-file", type=Path, default=None,
                    help="prompts from a saved queue (bench_throughput.py --save-queue) "
                    "instead of the prompt sources, for machines without them")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("out/bench_sampled_step.json"))
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    log(f"loading SmolLM2 + drafter on {args.device}")
    models = load_models(None, device=args.device, dtype=dtype)
    args.table = load_cost_table(args.cost_table, args.device, "batched")
    rows = []
    for bs in batches:
        n = queue_size(args.prompts, bs, 1.0)
        traffic = (load_traffic(args.queue_file)[:n] if args.queue_file
                   else build_queue(n, new_tokens=args.new_tokens, seed=0))  # fmt: skip
        reqs = traffic_to_requests(traffic, models.tokenizer)
        for i, r in enumerate(reqs):
            r.arrival_step, r.seed, r.max_new_tokens = 0, 1000 + i, args.new_tokens
            r.temperature, r.top_p, r.top_k = args.temperature, args.top_p, args.top_k
        log(f"== batch {bs}: {len(reqs)} requests x {args.new_tokens} tokens, "
            f"T={args.temperature} top_p={args.top_p} top_k={args.top_k}")
        for on_device in PATHS.values():  # warm-up
            serve(models, reqs[:bs], bs, on_device, args)
        runs: dict[str, list[dict]] = {name: [] for name in PATHS}
        for rep in range(args.reps):
            names = list(PATHS) if rep % 2 == 0 else list(PATHS)[::-1]
            for name in names:
                r = serve(models, reqs, bs, PATHS[name], args)
                runs[name].append(r)
                log(f"  rep {rep + 1}/{args.reps} {name:<6} {r['tokens']} tok "
                    f"{r['seconds']:.2f} s {r['tokens'] / r['seconds']:.1f} tok/s "
                    f"accept {r['accept_length']:.2f}")
        ratios = [d["tokens"] / d["seconds"] / (s["tokens"] / s["seconds"])
                  for d, s in zip(runs["device"], runs["split"], strict=True)]  # fmt: skip
        same = [sum(d["outputs"][k] == s["outputs"][k] for k in d["outputs"])
                for d, s in zip(runs["device"], runs["split"], strict=True)]  # fmt: skip
        row = {
            "batch": bs, "requests": len(reqs), "ratios": ratios,
            "ratio_device_over_split": statistics.median(ratios), "same_outputs": min(same),
            **{f"{name}_tok_s": statistics.median(r["tokens"] / r["seconds"] for r in rs)
               for name, rs in runs.items()},
            **{f"{name}_accept_length": statistics.median(r["accept_length"] for r in rs)
               for name, rs in runs.items()},
        }  # fmt: skip
        rows.append(row)
        log(f"  device / split {row['ratio_device_over_split']:.3f}x, same outputs "
            f"{row['same_outputs']}/{len(reqs)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python bench/bench_sampled_step.py " + shlex.join(sys.argv[1:]),
            "date": datetime.now(UTC).isoformat(), "threads": torch.get_num_threads(),
            "device": args.device, "mode": args.mode, "temperature": args.temperature,
            "top_p": args.top_p, "top_k": args.top_k, "new_tokens": args.new_tokens}  # fmt: skip
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| batch | device tok/s | split tok/s | device / split | accept (device, split) "
             "| same outputs |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['device_tok_s']:.1f} | {r['split_tok_s']:.1f} | "
                     f"{r['ratio_device_over_split']:.3f}x | {r['device_accept_length']:.2f}, "
                     f"{r['split_accept_length']:.2f} | {r['same_outputs']}/{r['requests']} |")
    args.out.with_suffix(".md").write_text(meta["command"] + "\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
