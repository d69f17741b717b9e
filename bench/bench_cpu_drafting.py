"""Cheap drafting on the CPU: the reduced draft vocabulary (``Drafter.set_draft_vocab``).

Two parts, fp32, the shipped drafter and SmolLM2, greedy, gamma 5:

1. draft cost: median wall and process CPU time of one draft call (the batched runtime's
   eager draft at batch B) with the whole vocabulary and with the top-N ids of the training
   distribution (``runtime/drafter/draft_vocab.json``), beside one 6-token verify forward
   at batch B; the sizes are interleaved call by call, ``--calls`` calls each.
2. throughput: no-spec, DSpark static and compact (shipped CPU cost table), and compact with
   the top-N draft vocabulary, interleaved in each of ``--reps`` repetitions (the order
   rotates), over the same queue per batch size; medians of tokens/s, accept length, and
   the token match against no-spec (must be 1.000 in fp32).

    python bench/bench_cpu_drafting.py --batch 1,8 --vocab 4096 --new-tokens 32 --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_obs.engine.draft_vocab import draft_vocab, load_ranking
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.no_spec import run_no_spec
from dspark_obs.engine.session import load_cost_table, load_models, traffic_to_requests
from dspark_obs.engine.shared_runtime import shared_runtime
from dspark_obs.engine.types import EngineConfig
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.testing.throughput_bench import build_queue, queue_size
from dspark_obs.workloads import load_traffic


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def draft_costs(
    models: Any, reqs: list, bs: int, sizes: list[int | None], calls: int, ranking: list[int]
) -> dict[str, float]:
    """Median ms of one draft call per vocabulary size, and of one 6-token verify forward:
    wall time, and process CPU time (``_cpu``: all threads; less sensitive to other
    processes on a shared machine)."""
    rt = shared_runtime(
        models.target, models.drafter, max_batch=bs, max_len=1024, gamma=5, cuda_graphs=False
    )
    try:
        slots = [rt.acquire() for _ in range(bs)]
        rt.prefill(slots, [r.prompt_ids for r in reqs[:bs]])
        lengths = rt.pool.lengths.copy()
        sts = np.ones((bs, 5), dtype=np.float32)
        times: dict[str, list[float]] = {}
        with torch.inference_mode():
            for _ in range(calls):
                for n in sizes:
                    models.drafter.set_draft_vocab(
                        None if n is None else draft_vocab(ranking, n, models.stop_ids)
                    )
                    t0, c0 = time.perf_counter(), time.process_time()
                    rt.draft([0.0] * bs, sts=sts)
                    name = f"draft_{n or 'full'}"
                    times.setdefault(name, []).append(time.perf_counter() - t0)
                    times.setdefault(f"{name}_cpu", []).append(time.process_time() - c0)
                models.drafter.set_draft_vocab(None)
                t0, c0 = time.perf_counter(), time.process_time()
                rt.forward(slots, [[1] * 6 for _ in slots])
                times.setdefault("verify_6", []).append(time.perf_counter() - t0)
                times.setdefault("verify_6_cpu", []).append(time.process_time() - c0)
                rt.pool.lengths[:] = lengths
        return {k: statistics.median(v) * 1000.0 for k, v in times.items()}
    finally:
        models.drafter.set_draft_vocab(None)
        rt.busy = False


def run_variant(
    models: Any, reqs: list, bs: int, variant: str, table: Any, vocab: list[int]
) -> dict[str, Any]:
    t0, c0 = time.perf_counter(), time.process_time()
    if variant == "nospec":
        res = run_no_spec(
            models.target, reqs, max_batch=bs, stop_ids=models.stop_ids, cuda_graphs=False
        )
        return {
            "tok_s": res.committed_tokens / (time.perf_counter() - t0),
            "tok_cpu_s": res.committed_tokens / (time.process_time() - c0),
            "outputs": res.outputs,
            "accept": None,
        }
    mode = "static" if variant == "static" else "compact"
    cfg = EngineConfig(mode=mode, gamma=5, max_batch=bs, cost_table=table, backend="batched")
    models.drafter.set_draft_vocab(vocab if variant == "compact_dv" else None)
    try:
        sink = MemorySink()
        res = Engine(models.target, models.drafter, cfg, models.stop_ids).run(
            reqs, FanOut([sink]).emit, f"cpu-{variant}-{bs}"
        )
    finally:
        models.drafter.set_draft_vocab(None)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = sink.table("req_steps")
    acc = steps.column("acc_len").to_numpy().mean() if steps is not None else None
    return {
        "tok_s": res.committed_tokens / wall,
        "tok_cpu_s": res.committed_tokens / cpu,
        "outputs": res.outputs,
        "accept": float(acc) if acc is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--vocab", type=int, default=4096, help="draft vocabulary size N")
    ap.add_argument("--cost-sizes", default="full,16384,8192,4096,2048")
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--queue-file", default=None)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="out/bench_cpu_drafting.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = load_models(device="cpu", dtype=torch.float32)
    table = load_cost_table(None, "cpu")
    ranking = load_ranking()
    vocab = draft_vocab(ranking, args.vocab, models.stop_ids)
    batches = [int(b) for b in args.batch.split(",") if b]
    n_max = max(queue_size(args.prompts, b, 1.0) for b in batches)
    traffic = (
        load_traffic(args.queue_file)
        if args.queue_file
        else build_queue(n_max, new_tokens=args.new_tokens)
    )
    all_reqs = traffic_to_requests(traffic[:n_max], models.tokenizer)
    for r in all_reqs:
        r.max_new_tokens, r.arrival_step, r.temperature = args.new_tokens, 0, 0.0
    sizes = [None if s == "full" else int(s) for s in args.cost_sizes.split(",")]
    out: dict[str, Any] = {
        "command": " ".join(["python", "bench/bench_cpu_drafting.py", *sys.argv[1:]]),
        "torch_threads": torch.get_num_threads(),
        "vocab": args.vocab,
        "draft_vocab_ids": len(vocab),
        "batches": {},
    }
    variants = ["nospec", "static", "compact", "compact_dv"]
    for bs in batches:
        reqs = all_reqs[: queue_size(args.prompts, bs, 1.0)]
        costs = draft_costs(models, reqs, bs, sizes, args.calls, ranking)
        log(f"bs={bs} draft/verify ms: {json.dumps({k: round(v, 2) for k, v in costs.items()})}")
        for v in variants:  # warm-up
            run_variant(models, reqs[:bs], bs, v, table, vocab)
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for rep in range(args.reps):
            k = rep % len(variants)
            for v in variants[k:] + variants[:k]:
                runs[v].append(run_variant(models, reqs, bs, v, table, vocab))
                log(f"  bs={bs} rep {rep + 1} {v:<10} {runs[v][-1]['tok_s']:7.2f} tok/s")
        base = runs["nospec"]
        row: dict[str, Any] = {"requests": len(reqs), "draft_ms": costs}
        for v in variants:
            toks = [r["tok_s"] for r in runs[v]]
            cpu_toks = [r["tok_cpu_s"] for r in runs[v]]
            row[v] = {
                "tok_s_median": statistics.median(toks),
                "tok_s": toks,
                "tok_cpu_s_median": statistics.median(cpu_toks),
                "tok_cpu_s": cpu_toks,
                "cpu_vs_nospec_median": statistics.median(
                    r["tok_cpu_s"] / b["tok_cpu_s"] for r, b in zip(runs[v], base, strict=True)
                ),
                "vs_nospec_median": statistics.median(
                    r["tok_s"] / b["tok_s"] for r, b in zip(runs[v], base, strict=True)
                ),
                "accept": runs[v][0]["accept"],
                "match": float(
                    np.mean(
                        [
                            runs[v][0]["outputs"][k] == base[0]["outputs"][k]
                            for k in base[0]["outputs"]
                        ]
                    )
                ),
            }
        out["batches"][bs] = row
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    lines = [
        "| batch | no-spec tok/s | static | compact | compact + top-N draft vocab "
        "| compact / no-spec | compact+vocab / no-spec | compact+vocab / static "
        "| accept (compact / +vocab) | draft ms full / top-N | 6-token verify ms | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for bs, r in out["batches"].items():
        d = r["draft_ms"]
        lines.append(
            f"| {bs} | {r['nospec']['tok_s_median']:.1f} | {r['static']['tok_s_median']:.1f} "
            f"| {r['compact']['tok_s_median']:.1f} | {r['compact_dv']['tok_s_median']:.1f} "
            f"| {r['compact']['vs_nospec_median']:.2f}x "
            f"| {r['compact_dv']['vs_nospec_median']:.2f}x "
            f"| {r['compact_dv']['tok_s_median'] / r['static']['tok_s_median']:.2f}x "
            f"| {r['compact']['accept']:.2f} / {r['compact_dv']['accept']:.2f} "
            f"| {d['draft_full']:.1f} / {d.get(f'draft_{args.vocab}', float('nan')):.1f} "
            f"| {d['verify_6']:.1f} "
            f"| {min(r[v]['match'] for v in variants):.3f} |"
        )
    lines += [
        "",
        "Per process CPU second (tokens / CPU s of this process, all threads: the figure least "
        "bent by other processes on a shared machine):",
        "",
        "| batch | no-spec | static | compact | compact + top-N | compact / no-spec "
        "| compact+vocab / no-spec | compact+vocab / static |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for bs, r in out["batches"].items():
        c = {v: r[v]["tok_cpu_s_median"] for v in variants}
        lines.append(
            f"| {bs} | {c['nospec']:.1f} | {c['static']:.1f} | {c['compact']:.1f} "
            f"| {c['compact_dv']:.1f} | {r['compact']['cpu_vs_nospec_median']:.2f}x "
            f"| {r['compact_dv']['cpu_vs_nospec_median']:.2f}x "
            f"| {c['compact_dv'] / c['static']:.2f}x |"
        )
    md = "\n".join(lines)
    path.with_suffix(".md").write_text(f"`{out['command']}`\n\n{md}\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
