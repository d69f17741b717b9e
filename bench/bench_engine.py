"""Embedded engine throughput: no-spec decoding vs DSpark static and compact, side by side.

SmolLM2-135M-Instruct (fp32) with the shipped drafter, greedy, mixed eval prompts, all
requests arriving at once. For each batch size every variant runs on the same prompts in
the same process, interleaved, ``--reps`` times; the table reports median tokens/s and the
ratio to no-spec measured in the same repetition.

    python bench/bench_engine.py [--batch 1,4,16] [--new-tokens 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark_obs.engine.loop import Engine, EngineConfig, GenRequest
from dspark_obs.engine.session import load_cost_table, load_models, traffic_to_requests
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.workloads import mixed_traffic


def no_spec(target, reqs: list[GenRequest], stop_ids: frozenset[int]) -> int:
    """Plain batched greedy decoding with the KV cache: one target token per request per step."""
    caches = [target.new_cache(len(r.prompt_ids) + r.max_new_tokens + 2) for r in reqs]
    last = []
    for r, c in zip(reqs, caches, strict=True):
        out = target.prefill(r.prompt_ids, c)
        last.append(int(torch.argmax(out.logits[0][-1])))
    produced = [1] * len(reqs)  # the prefill's token
    live = [i for i, r in enumerate(reqs) if last[i] not in stop_ids and r.max_new_tokens > 1]
    while live:
        out = target.forward([torch.tensor([last[i]]) for i in live], [caches[i] for i in live])
        nxt = []
        for j, i in enumerate(live):
            last[i] = int(torch.argmax(out.logits[j][-1]))
            produced[i] += 1
            if last[i] not in stop_ids and produced[i] < reqs[i].max_new_tokens:
                nxt.append(i)
        live = nxt
    return sum(produced)


def dspark(models, reqs: list[GenRequest], mode: str, table) -> int:
    cfg = EngineConfig(mode=mode, gamma=5, max_batch=len(reqs), cost_table=table)
    eng = Engine(models.target, models.drafter, cfg, models.stop_ids)
    res = eng.run(reqs, FanOut([MemorySink()]).emit, f"bench-{mode}")
    return res.committed_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = load_models()
    table = load_cost_table(None, "cpu")
    print(f"cost table for compact: {'runtime/cost_tables/smollm2_cpu.json' if table else 'none'}")
    rows = []
    for bs in (int(b) for b in args.batch.split(",")):
        traffic = mixed_traffic(
            bs, seed=bs, split="eval", rate=None, max_new_tokens=args.new_tokens
        )
        reqs = traffic_to_requests(traffic, models.tokenizer)
        for r in reqs:
            r.arrival_step = 0
        tps: dict[str, list[float]] = {"no-spec": [], "static": [], "compact": []}
        ratios: dict[str, list[float]] = {"static": [], "compact": []}
        with torch.inference_mode():
            for _ in range(args.reps):
                t = time.perf_counter()
                n = no_spec(models.target, reqs, frozenset(models.stop_ids))
                base = n / (time.perf_counter() - t)
                tps["no-spec"].append(base)
                for mode in ("static", "compact"):
                    t = time.perf_counter()
                    n = dspark(models, reqs, mode, table)
                    v = n / (time.perf_counter() - t)
                    tps[mode].append(v)
                    ratios[mode].append(v / base)
        med = {k: statistics.median(v) for k, v in tps.items()}
        rows.append((bs, med, {k: statistics.median(v) for k, v in ratios.items()}))
        print(
            f"bs={bs:>2}  no-spec {med['no-spec']:7.1f} tok/s  static {med['static']:7.1f} "
            f"({rows[-1][2]['static']:.2f}x)  compact {med['compact']:7.1f} "
            f"({rows[-1][2]['compact']:.2f}x)",
            flush=True,
        )
    print(
        "\n| batch | no-spec tok/s | static tok/s | static / no-spec "
        "| compact tok/s | compact / no-spec |"
    )
    print("|---|---|---|---|---|---|")
    for bs, med, rat in rows:
        print(
            f"| {bs} | {med['no-spec']:.1f} | {med['static']:.1f} | {rat['static']:.2f}x | "
            f"{med['compact']:.1f} | {rat['compact']:.2f}x |"
        )


if __name__ == "__main__":
    main()
