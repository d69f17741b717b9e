"""Where a throughput run's wall time goes, per step: prefill, launching, reading, waiting.

The same queue as ``bench_throughput.py`` (two requests per slot, 128 new tokens; batch 1:
24 requests) is served by no-spec and by the engine (``--mode``), each twice (the first run
captures graphs and compiles; the second is reported). Wrappers time, per run and divided by
its steps: ``BatchedRuntime.prefill`` (followed by a device synchronize, so it includes
whatever the device still had queued before it: under launching ahead, the step in flight),
``Engine._admit`` (prefill plus the first tokens), the step pipeline's ``_launch``,
``_read``, ``_whole_block``, ``_accept_and_commit`` and ``_hand_over``,
``BlockVerified.fetch`` (the host waiting for the device) and the queued record work
(``run_pending``). Parts overlap (``_read`` includes ``fetch``), so they do not add up to
the wall time. Prefill group sizes are counted too.

    python bench/bench_step_breakdown.py --queue-file q.jsonl --batch 64,256 \
        --drafter runtime/drafter --cost-table runtime/cost_tables/smollm2_h200.json \
        --out out/step_breakdown.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dspark_obs.engine import step as step_module
from dspark_obs.engine.batched import BatchedRuntime
from dspark_obs.engine.block_verify import BlockVerified
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.no_spec import run_no_spec
from dspark_obs.engine.session import load_cost_table, load_models, traffic_to_requests
from dspark_obs.engine.step import StepPipeline
from dspark_obs.engine.types import EngineConfig
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.workloads import load_traffic

SECONDS: collections.defaultdict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()
PREFILL_SIZES: collections.Counter[int] = collections.Counter()
PIPELINE = ("_split_step", "_launch", "_read", "_whole_block", "_hand_over", "_commit")


def timed(owner: Any, name: str, label: str, sync: bool = False) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall time to ``SECONDS[label]``."""
    fn = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if sync:
                torch.cuda.synchronize()
            SECONDS[label] += time.perf_counter() - t0
            CALLS[label] += 1

    setattr(owner, name, wrapper)


def instrument() -> None:
    prefill = BatchedRuntime.prefill

    def counted(self: BatchedRuntime, slots: Any, prompts: Any) -> Any:
        PREFILL_SIZES[len(slots)] += 1
        return prefill(self, slots, prompts)

    BatchedRuntime.prefill = counted  # type: ignore[method-assign]
    timed(BatchedRuntime, "prefill", "prefill", sync=True)
    timed(Engine, "_admit", "admit")
    for name in PIPELINE:
        timed(StepPipeline, name, name.lstrip("_"))
    timed(BlockVerified, "fetch", "fetch (waiting)")
    timed(step_module, "run_pending", "run_pending")


def measure(run: Callable[[], Any]) -> dict[str, Any]:
    SECONDS.clear()
    CALLS.clear()
    PREFILL_SIZES.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = run()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "steps": res.steps,
        "tok_s": res.committed_tokens / wall,
        "ms_per_step": wall * 1000 / res.steps,
        "parts_ms_per_step": {k: v * 1000 / res.steps for k, v in sorted(SECONDS.items())},
        "calls": dict(CALLS),
        "prefill_sizes": dict(sorted(PREFILL_SIZES.items())),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queue-file", required=True, help="bench_throughput.py --save-queue file")
    ap.add_argument("--batch", default="64,256")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--mode", choices=("static", "compact"), default="compact")
    ap.add_argument("--drafter", default=None, help="drafter directory (default: shipped)")
    ap.add_argument("--cost-table", default=None, help="cost table for compact")
    ap.add_argument("--out", default="out/step_breakdown.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("this breakdown times CUDA runs (the CPU has nothing to overlap)")
    instrument()
    models = load_models(args.drafter, device="cuda", dtype=torch.bfloat16)
    table = load_cost_table(args.cost_table, "cuda") if args.mode == "compact" else None
    traffic = load_traffic(args.queue_file)
    out: dict[str, Any] = {
        "command": " ".join(["python", "bench/bench_step_breakdown.py", *sys.argv[1:]]),
        "runs": {},
    }
    for bs in [int(b) for b in args.batch.split(",") if b]:
        reqs = traffic_to_requests(traffic[: 24 if bs == 1 else 2 * bs], models.tokenizer)
        for r in reqs:
            r.max_new_tokens = args.new_tokens

        def nospec(reqs: list = reqs, bs: int = bs) -> Any:
            return run_no_spec(
                models.target, list(reqs), max_batch=bs, stop_ids=tuple(models.stop_ids),
                backend="batched", cuda_graphs=True, compiled=True,
            )  # fmt: skip

        def engine(reqs: list = reqs, bs: int = bs) -> Any:
            cfg = EngineConfig(
                mode=args.mode, gamma=5, max_batch=bs, cost_table=table, compile=True
            )
            eng = Engine(models.target, models.drafter, cfg, models.stop_ids)
            return eng.run(list(reqs), FanOut([MemorySink()]).emit, f"breakdown-{bs}")

        for name, run in (("nospec", nospec), (args.mode, engine)):
            measure(run)  # warm: graphs, compile
            row = measure(run)
            out["runs"][f"{name}-b{bs}"] = row
            parts = ", ".join(f"{k} {v:.2f}" for k, v in row["parts_ms_per_step"].items())
            print(f"{name} b{bs}: {row['tok_s']:.0f} tok/s, {row['ms_per_step']:.2f} ms/step "
                  f"({parts})", flush=True)  # fmt: skip
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
