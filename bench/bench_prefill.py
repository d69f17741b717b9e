"""What a prefill costs on the GPU, and that it still computes what the reference target does.

For ``k`` prompts of the eval queue prefilled together into empty slots of a graphed,
compiled runtime (with and without the drafter): the median wall time of 10 calls (each
synchronized) against the device time of its kernels (torch.profiler, one call). Then the
check: the logits at every prompt's last position against the reference target's own
prefill (``Target.prefill``, the readable model), one prompt at a time and all at once, with
one prompt longer than the widest prefill chunk.

    python bench/bench_prefill.py --queue-file q.jsonl --drafter runtime/drafter \
        --out out/prefill.json
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
from torch.profiler import ProfilerActivity, profile

from dspark_obs.engine.batched import BatchedRuntime
from dspark_obs.engine.session import load_models, traffic_to_requests
from dspark_obs.engine.shared_runtime import shared_runtime
from dspark_obs.workloads import load_traffic


def prefill_once(rt: BatchedRuntime, prompts: list[list[int]]) -> list[int]:
    """Prefill into fresh slots, read the first tokens (the one wait), free the slots."""
    slots = [rt.acquire() for _ in prompts]
    first = rt.prefill(slots, prompts).argmax(-1).tolist()
    for s in sorted(slots, reverse=True):
        rt.release(s)
    return first


def timing(rt: BatchedRuntime, prompts: list[list[int]], k: int) -> dict[str, float]:
    groups = [prompts[i : i + k] for i in range(4)]  # four different prompt mixes
    for g in groups:
        prefill_once(rt, g)  # capture
    walls = []
    for i in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prefill_once(rt, groups[i % 4])
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1000)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill_once(rt, groups[0])
        torch.cuda.synchronize()
    device = sum(e.self_device_time_total for e in prof.key_averages()) / 1000
    return {"k": k, "wall_ms_median": statistics.median(walls), "device_ms": device}


def check(rt: BatchedRuntime, models: Any, prompts: list[list[int]]) -> dict[str, Any]:
    target = models.target
    refs = [target.prefill(p, target.new_cache(len(p) + 8)).logits[0][-1].float() for p in prompts]
    out: dict[str, Any] = {}
    for name, groups in (
        ("one at a time", [[i] for i in range(len(prompts))]),
        ("all at once", [list(range(len(prompts)))]),
    ):
        worst, agree = 0.0, 0
        for g in groups:
            slots = [rt.acquire() for _ in g]
            logits = rt.prefill(slots, [prompts[i] for i in g])
            for j, i in enumerate(g):
                worst = max(worst, float((logits[j] - refs[i]).abs().max()))
                agree += int(logits[j].argmax() == refs[i].argmax())
            for s in sorted(slots, reverse=True):
                rt.release(s)
        out[name] = {"argmax_agrees": agree, "prompts": len(prompts), "max_abs_diff": worst}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queue-file", required=True, help="bench_throughput.py --save-queue file")
    ap.add_argument("--drafter", default=None, help="drafter directory (default: shipped)")
    ap.add_argument("--sizes", default="1,4,64", help="prompts per prefill")
    ap.add_argument("--out", default="out/prefill.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("this bench times graphed prefills on a GPU")
    models = load_models(args.drafter, device="cuda", dtype=torch.bfloat16)
    reqs = traffic_to_requests(load_traffic(args.queue_file)[:64], models.tokenizer)
    prompts = [r.prompt_ids for r in reqs]
    result: dict[str, Any] = {
        "command": " ".join(["python", "bench/bench_prefill.py", *sys.argv[1:]]),
        "timing": {},
    }
    with torch.inference_mode():
        for label, drafter in (("with drafter", models.drafter), ("no drafter", None)):
            rt = shared_runtime(
                models.target, drafter, max_batch=64, max_len=1024, gamma=5, compiled=True
            )
            rows = [timing(rt, prompts, int(k)) for k in args.sizes.split(",")]
            result["timing"][label] = rows
            for r in rows:
                print(f"{label} k={r['k']}: wall {r['wall_ms_median']:.2f} ms, "
                      f"device {r['device_ms']:.2f} ms", flush=True)  # fmt: skip
            if drafter is not None:
                long = [x for p in prompts[:6] for x in p][:700]  # past the widest chunk
                result["check"] = check(rt, models, [*prompts[:16], long])
                print(json.dumps(result["check"]), flush=True)
            rt.busy = False
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
