"""The block-accept estimator under top-k / top-p sampling, before and after recording log p
of the processed target distribution, judged against cap-accept companions.

Per sampling setting and replicate: one compact run recorded the exact way (log p of the
distribution acceptance used), the same compact run recorded the old way (log_softmax of
logits / T, what SGLang's recorder gathers and why it skips such rows), and the cap-accept
companion. Decoding is identical in all three (only the recorded estimator fields differ),
so the two estimates are judged against the same truth, side by side.

    python bench/bench_truncated_estimator.py --model tiny [--replicates 20]
    python bench/bench_truncated_estimator.py --model smollm2 [--replicates 2] [--requests 4]

``tiny``: random-initialized models of the SmolLM2 architecture with a 6-token vocabulary
(so drafts are often accepted and trimming matters), random prompts, seconds per replicate.
``smollm2``: the real target and the shipped drafter on mixed eval prompts (minutes).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from dspark_obs.analytics import coverage, estimate_blocks, pair_companion, validate_estimator
from dspark_obs.engine.censored import ESTIMATOR_MIN_TEMPERATURE
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.session import load_cost_table, load_models, traffic_to_requests
from dspark_obs.engine.types import EngineConfig, GenRequest
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.testing.tiny_models import tiny_models
from dspark_obs.workloads import mixed_traffic

SETTINGS = {
    "tiny": {"T=1": {}, "T=1 top_k=2": {"top_k": 2}, "T=1 top_p=0.8": {"top_p": 0.8}},
    "smollm2": {"T=1": {}, "T=1 top_k=20": {"top_k": 20}, "T=1 top_p=0.9": {"top_p": 0.9}},
}
TINY_VOCAB = 6


def _tiny_requests(n: int, seed: int, new_tokens: int) -> list[GenRequest]:
    rng = np.random.default_rng(seed)
    return [
        GenRequest(
            rid=f"r{i}",
            prompt_ids=rng.integers(0, TINY_VOCAB, size=int(rng.integers(3, 9))).tolist(),
            max_new_tokens=int(rng.integers(new_tokens // 2, new_tokens + 1)),
            workload="tiny",
            temperature=1.0,
            seed=100 + i,
            arrival_step=int(rng.integers(0, 6)),
        )
        for i in range(n)
    ]


def _tiny_table():
    from dspark_obs.cost_table import AdditiveCostTable

    return AdditiveCostTable(0.01, (1, 16), (0.0, 0.0), (1, 8, 16, 64), (0.0, 0.01, 0.03, 0.15))


def _old_logprobs(logits: torch.Tensor, live) -> torch.Tensor:
    t = max(live.req.temperature, ESTIMATOR_MIN_TEMPERATURE)
    return torch.log_softmax(logits.double() / t, dim=-1)


def _run(models, cfg: EngineConfig, reqs, run_id: str, old: bool) -> MemorySink:
    sink = MemorySink()
    fan = FanOut([sink])
    eng = Engine(models.target, models.drafter, cfg, models.stop_ids)
    if old:
        eng._estimator_logprobs = _old_logprobs  # type: ignore[method-assign]
    with torch.inference_mode():
        eng.run(reqs, fan.emit, run_id)
    return sink


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--replicates", type=int, default=20)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON summary here")
    args = ap.parse_args()
    tiny = args.model == "tiny"
    models = None if tiny else load_models()
    table = _tiny_table() if tiny else load_cost_table(None, "cpu")
    compact = EngineConfig(mode="compact", gamma=5, max_batch=args.requests, cost_table=table)
    cap = replace(compact, mode="cap-accept")
    rows, t0 = [], time.perf_counter()
    for label, sampling in SETTINGS[args.model].items():
        vals: dict[str, list[pd.DataFrame]] = {"exact": [], "old": []}
        for rep in range(args.replicates):
            if tiny:
                models = tiny_models(rep, double=True, vocab_size=TINY_VOCAB, drafter_name="tiny")
                base = _tiny_requests(args.requests, 2000 + rep, args.new_tokens)
            else:
                traffic = mixed_traffic(
                    args.requests, seed=2000 + rep, max_new_tokens=args.new_tokens, temperature=1.0
                )
                base = traffic_to_requests(traffic, models.tokenizer)
            reqs = [replace(r, **sampling) for r in base]
            truth = _run(models, cap, reqs, "c-cap", old=False)
            for how in ("exact", "old"):
                sink = _run(models, compact, reqs, "c", old=how == "old")
                pair = pair_companion(
                    sink.table("req_steps"),
                    truth.table("req_steps"),
                    sink.table("requests"),
                    truth.table("requests"),
                    greedy=True,
                )
                assert pair.identical, pair.message
                est = estimate_blocks(
                    sink.table("req_steps").to_pandas(), sink.table("requests").to_pandas()
                )
                vals[how].append(validate_estimator(est, pair, by=(), n_boot=100, seed=rep))
            print(f"{label}: replicate {rep + 1}/{args.replicates} done", flush=True)
        for how, v in vals.items():
            cov = coverage(v, by=()).iloc[0]
            allv = pd.concat(v)
            rows.append(
                {
                    "setting": label,
                    "recorded": how,
                    "replicates": int(cov.replicates),
                    "truth_mean_ceiling": float(allv.truth_mean_ceiling.mean()),
                    "mean_point": float(allv.mean_point.mean()),
                    "mean_pct_err": float(cov.mean_pct_err),
                    "inside_bracket_rate": float(cov.inside_bracket_rate),
                    "interval_coverage": float(cov.interval_coverage),
                }
            )
        print(pd.DataFrame(rows).to_string(index=False), flush=True)
    print(f"{time.perf_counter() - t0:.0f} s")
    cmd = (
        f"python bench/bench_truncated_estimator.py --model {args.model} "
        f"--replicates {args.replicates} "
        f"--requests {args.requests} --new-tokens {args.new_tokens}"
    )
    print(f"rerun: {cmd}")
    if args.out:
        args.out.write_text(json.dumps({"command": cmd, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
