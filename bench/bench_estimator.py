"""Validate the block-accept estimator against cap-accept companions, over seeded replicates.

Each replicate runs a small mixed workload (math / chat / poetry) in ``compact`` with the
shipped drafter and CPU cost table, then the same requests in ``cap-accept``; the estimator
sees only the compact records and is judged against the companion's measured ceiling.
Reported per workload: true mean ceiling, mean bracket [lo, hi], point estimate error, how
often the bracket held the truth and how often the 95% bootstrap interval covered it. The
same runs give utilization (committed / ceiling) and window statistics.

    python bench/bench_estimator.py [--replicates 40] [--requests 6] [--temperature 1.0]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch

from dspark_obs.analytics import (
    coverage,
    estimate_blocks,
    fit_sts_heldout,
    pair_companion,
    sts_data_from_req_steps,
    validate_estimator,
    window_stats,
)
from dspark_obs.engine.session import (
    load_cost_table,
    load_models,
    run_with_companion,
    traffic_to_requests,
)
from dspark_obs.engine.types import EngineConfig
from dspark_obs.fanout import MemorySink
from dspark_obs.workloads import mixed_traffic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replicates", type=int, default=40)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--boot", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON summary here")
    args = ap.parse_args()
    models = load_models(device=args.device)
    table = load_cost_table(None, "cpu")
    cfg = EngineConfig(mode="compact", gamma=5, max_batch=args.requests, cost_table=table)
    validations, steps_all, compact_all, pairs_ok = [], [], [], 0
    t0 = time.perf_counter()
    for rep in range(args.replicates):
        traffic = mixed_traffic(
            args.requests,
            seed=1000 + rep,
            split="eval",
            max_new_tokens=args.new_tokens,
            temperature=args.temperature,
        )
        reqs = traffic_to_requests(traffic, models.tokenizer)
        sink = MemorySink()
        with torch.inference_mode():
            run_with_companion(
                models, reqs, cfg, [sink], f"rep{rep}", companion=True, workload="mixed", seed=rep
            )
        rs = sink.table("req_steps").to_pandas()
        rq = sink.table("requests").to_pandas()
        compact, cap = rs[rs.run_id == f"rep{rep}"], rs[rs.run_id == f"rep{rep}-cap"]
        pair = pair_companion(
            compact,
            cap,
            rq[rq.run_id == f"rep{rep}"],
            rq[rq.run_id == f"rep{rep}-cap"],
            greedy=True,
        )
        pairs_ok += bool(pair.identical)
        est = estimate_blocks(compact, rq[rq.run_id == f"rep{rep}"], gamma=5)
        validations.append(validate_estimator(est, pair, n_boot=args.boot, seed=rep))
        steps_all.append(pair.steps.assign(rep=rep))
        compact_all.append(compact)
        print(
            f"replicate {rep + 1}/{args.replicates} ({time.perf_counter() - t0:.0f}s)", flush=True
        )
    cov = coverage(validations)
    val = pd.concat(validations)
    per_wl = val.groupby("workload").agg(
        truth_mean_ceiling=("truth_mean_ceiling", "mean"),
        mean_lo=("mean_lo", "mean"),
        mean_hi=("mean_hi", "mean"),
        mean_point=("mean_point", "mean"),
        point_pct_err=("point_pct_err", "mean"),
    )
    pooled_err = (
        100 * (per_wl.mean_point - per_wl.truth_mean_ceiling).abs() / per_wl.truth_mean_ceiling
    ).rename("pooled_point_pct_err")
    steps = pd.concat(steps_all)
    util = steps.groupby("workload").agg(committed=("committed", "sum"), ceiling=("ceiling", "sum"))
    util["utilization"] = util.committed / util.ceiling
    summary = (
        cov.merge(per_wl.reset_index(), on="workload")
        .merge(pooled_err.reset_index(), on="workload")
        .merge(util.reset_index(), on="workload")
    )
    pd.set_option("display.width", 200)
    print(
        f"\n{args.replicates} replicates x {args.requests} requests, T={args.temperature}; "
        f"companion identical in {pairs_ok}/{args.replicates}"
    )
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    compact = pd.concat(compact_all, ignore_index=True)
    windows = window_stats(compact)
    print("\nwindows (compact):")
    print(windows.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    runs = pd.DataFrame({"run_id": compact.run_id.unique(), "mode": "compact"})
    sts = fit_sts_heldout(sts_data_from_req_steps(compact, runs), heldout_frac=0.3, seed=0)
    print(
        f"\nSTS fitted on {sts.fit_requests} requests, judged on {sts.heldout_requests} held out: "
        f"pooled ECE {sts.pooled_before:.4f} -> {sts.pooled_after:.4f}; "
        f"T = {[round(t, 2) for t in sts.calibration.temperatures]}"
    )
    print(sts.by_workload.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "estimator": summary.to_dict(orient="records"),
                    "windows": windows.to_dict(orient="records"),
                    "sts": {
                        "before": sts.pooled_before,
                        "after": sts.pooled_after,
                        "by_workload": sts.by_workload.to_dict(orient="records"),
                    },
                },
                indent=2,
                default=float,
            )
        )


if __name__ == "__main__":
    main()
