"""The host's turn per DSpark step, measured where there is no GPU.

On the H200 the host's per-step work (plan, acceptance check, commit, record arrays, the
estimator's gathers) bounds the step at small and middle batch sizes (README, "Engine
throughput"). This bench isolates that work on any machine: a tiny random target and drafter
(one layer, a 64-token vocabulary), whose forwards cost next to nothing, served by the batched
runtime in compact mode under a table that trims (so censored blocks open and the estimator's
record work runs, as under a trimming table on the GPU). Milliseconds per step are then mostly
host work; compare two codes by running this on each, minutes apart, or use ``--profile``.

    python bench/bench_host_step.py --batch 1,16,64 --reps 5
    python bench/bench_host_step.py --batch 64 --profile 25
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dspark_obs.engine.loop import Engine
from dspark_obs.engine.types import EngineConfig, GenRequest
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.testing.tiny_models import tiny_pair, trimming_table

VOCAB = 64


def requests(batch: int, new_tokens: int, seed: int) -> list[GenRequest]:
    rng = np.random.default_rng(seed)
    return [
        GenRequest(rid=f"r{i}", prompt_ids=rng.integers(0, VOCAB, size=8).tolist(),
                   max_new_tokens=new_tokens)  # fmt: skip
        for i in range(batch)
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,16,64", help="comma-separated batch sizes")
    ap.add_argument("--new-tokens", type=int, default=48, help="per request")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per batch size (median)")
    ap.add_argument("--mode", choices=("static", "compact"), default="compact")
    ap.add_argument("--profile", type=int, default=0,
                    help="print this many functions of a cProfile run (see --sort)")
    ap.add_argument("--sort", default="tottime", choices=("tottime", "cumulative"),
                    help="--profile's order: own time, or time with callees")
    ap.add_argument("--out", type=Path, default=None, help="JSON summary path")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target, drafter = tiny_pair(3, vocab_size=VOCAB, num_layers=1, context_window=16,
                                perturb=0.2, double=False)  # fmt: skip
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        cfg = EngineConfig(mode=args.mode, max_batch=batch, backend="batched",
                           cost_table=trimming_table() if args.mode == "compact" else None)
        engine = Engine(target, drafter, cfg)
        reqs = requests(batch, args.new_tokens, seed=batch)
        engine.run(list(reqs), FanOut([MemorySink()]).emit, "warm-up")
        per_step, steps = [], 0
        for rep in range(args.reps):
            t0 = time.perf_counter()
            res = engine.run(list(reqs), FanOut([MemorySink()]).emit, f"rep{rep}")
            per_step.append((time.perf_counter() - t0) / res.steps * 1e3)
            steps = res.steps
        ms = statistics.median(per_step)
        rows.append({"batch": batch, "steps": steps, "ms_per_step": ms, "reps": per_step})
        print(f"batch {batch:4d}: {steps} steps, {ms:.3f} ms per step (median of {args.reps})")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            engine.run(list(reqs), FanOut([MemorySink()]).emit, "profile")
            prof.disable()
            pstats.Stats(prof, stream=sys.stdout).sort_stats(args.sort).print_stats(args.profile)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"mode": args.mode, "new_tokens": args.new_tokens,
                                        "rows": rows}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
