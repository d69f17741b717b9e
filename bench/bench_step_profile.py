"""Where a DSpark step's time goes, per batch size: device time of the draft and verify
passes, host time of the whole step, and the graph tiers a step really replays.

For each batch size and each tier setting (``old``: the graph tiers before engine v3, batch
<= 128 and <= 1,024 packed tokens; ``new``: the current defaults), DSpark ``static`` and
no-spec serve the same queue (every request arrives at step 0); one untimed warm-up run per
variant captures the graphs first. Per run: tokens/s, wall ms per step, and from the
``steps`` records the medians of ``step_cpu_ms`` (host wall time of the step),
``draft_gpu_ms`` and ``target_verify_gpu_ms`` (CUDA events). ``--cprofile B`` adds the top
host functions (cProfile, self time) of one static run at batch B; ``--kernels B`` the top
CUDA kernels (torch.profiler) of one run of ``--mode`` and one no-spec run at batch B. ``--syncs B``
lists where one run at batch B makes the host wait for the device (torch's sync debug mode:
``.cpu()``, ``.item()``, pageable copies), counted per call site of our code; ``--timeline B``
the host's wall time per step in each part of the step (launch, the read-back's wait, the
read, the record work), from timers around those calls (far lighter than cProfile).

    python bench/bench_step_profile.py --device cuda --queue-file q.jsonl --batch 1,64,256 \
        --cprofile 1,64 --kernels 256 --out out/step_profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dspark_obs.engine import slots
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.no_spec import run_no_spec
from dspark_obs.engine.session import load_cost_table, load_models, traffic_to_requests
from dspark_obs.engine.types import EngineConfig
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.workloads import load_traffic

OLD_TIERS = {
    "batch_tiers": (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128),
    "token_tiers": tuple(t for t in slots.TOKEN_TIERS if t <= 1024),
}
NEW_TIERS = {"batch_tiers": slots.BATCH_TIERS, "token_tiers": slots.TOKEN_TIERS}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine_run(
    models: Any,
    reqs: list,
    bs: int,
    tiers: dict,
    device: str,
    mode: str = "static",
    table: Any = None,
) -> dict[str, Any]:
    cfg = EngineConfig(
        mode=mode, gamma=5, max_batch=bs, compile=device == "cuda", cost_table=table, **tiers
    )
    eng = Engine(models.target, models.drafter, cfg, models.stop_ids)
    sink = MemorySink()
    sync(device)
    t0 = time.perf_counter()
    res = eng.run(reqs, FanOut([sink]).emit, f"prof-{bs}")
    sync(device)
    wall = time.perf_counter() - t0
    steps = sink.table("steps").to_pandas()
    full = steps[steps.bs == steps.bs.max()]

    def med(col: str) -> float | None:
        vals = full[col].dropna()
        return float(statistics.median(vals)) if len(vals) else None

    return {
        "tok_s": res.committed_tokens / wall,
        "wall_ms_per_step": wall * 1000.0 / max(res.steps, 1),
        "steps": res.steps,
        "step_cpu_ms": med("step_cpu_ms"),
        "draft_gpu_ms": med("draft_gpu_ms"),
        "verify_gpu_ms": med("target_verify_gpu_ms"),
        "verify_tokens": med("num_verify_tokens"),
        "outputs": res.outputs,
    }


def nospec_run(models: Any, reqs: list, bs: int, device: str) -> dict[str, Any]:
    sync(device)
    t0 = time.perf_counter()
    res = run_no_spec(
        models.target,
        reqs,
        max_batch=bs,
        stop_ids=models.stop_ids,
        cuda_graphs=device == "cuda",
        compiled=device == "cuda",
    )
    sync(device)
    wall = time.perf_counter() - t0
    return {
        "tok_s": res.committed_tokens / wall,
        "steps": res.steps,
        "wall_ms_per_step": wall * 1000.0 / max(res.steps, 1),
        "outputs": res.outputs,
    }


def host_profile(
    models: Any, reqs: list, bs: int, device: str, mode: str, table: Any, top: int = 25
) -> str:
    engine_run(models, reqs, bs, NEW_TIERS, device, mode, table)  # warm: graphs, compile
    prof = cProfile.Profile()
    prof.enable()
    run = engine_run(models, reqs, bs, NEW_TIERS, device, mode, table)
    prof.disable()
    buf = io.StringIO()
    buf.write(f"{run['steps']} steps, {run['wall_ms_per_step']:.2f} ms per step under cProfile\n")
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("tottime").print_stats("dspark_obs", top)  # our own Python
    stats.sort_stats("cumulative").print_stats("dspark_obs", 2 * top)  # where the step goes
    return buf.getvalue()


def sync_sites(
    models: Any, reqs: list, bs: int, device: str, mode: str, table: Any, top: int = 20
) -> str:
    """Where one run makes the host wait for the device, per call site in our code."""
    engine_run(models, reqs, bs, NEW_TIERS, device, mode, table)  # warm: graphs, compile
    sites: Counter[str] = Counter()

    def record(message: Any, *_: Any, **__: Any) -> None:
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack() if "dspark_obs" in f.filename]
        where = " <- ".join(
            f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(ours[-3:])
        )
        sites[where or "outside dspark_obs"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown, warnings.showwarning = warnings.showwarning, record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run = engine_run(models, reqs, bs, NEW_TIERS, device, mode, table)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    steps = max(run["steps"], 1)
    lines = [f"{run['steps']} steps, {sum(sites.values())} syncs"]
    for where, n in sites.most_common(top):
        lines.append(f"{n / steps:7.2f} per step  {where}")
    return "\n".join(lines)


TIMED = (  # (module, class, method): the parts of a step, outermost first
    ("dspark_obs.engine.loop", "Engine", "_admit"),
    ("dspark_obs.engine.step", "StepPipeline", "step"),
    ("dspark_obs.engine.step", "StepPipeline", "_launch"),
    ("dspark_obs.engine.step", "StepPipeline", "_read"),
    ("dspark_obs.engine.step", "StepPipeline", "_split_step"),
    ("dspark_obs.engine.step", "StepPipeline", "_commit"),
    ("dspark_obs.engine.step", "StepPipeline", "_hand_over"),
    ("dspark_obs.engine.block_verify", "BlockVerified", "fetch"),
    ("dspark_obs.engine.batched", "BatchedRuntime", "draft"),
    ("dspark_obs.engine.batched", "BatchedRuntime", "verify_block"),
    ("dspark_obs.engine.reference", "ReferenceRuntime", "draft"),
    ("dspark_obs.engine.reference", "ReferenceRuntime", "verify_block"),
    ("dspark_obs.engine.step", None, "run_pending"),
)


def timeline(models: Any, reqs: list, bs: int, device: str, mode: str, table: Any) -> str:
    """Host wall ms per step in each part of the step (timers around the calls of TIMED)."""
    import importlib

    engine_run(models, reqs, bs, NEW_TIERS, device, mode, table)  # warm: graphs, compile
    spent: defaultdict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    undo: list[Callable[[], None]] = []

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0
                calls[name] += 1

        return wrapper

    for module_name, cls_name, meth in TIMED:
        owner: Any = importlib.import_module(module_name)
        if cls_name is not None:
            owner = getattr(owner, cls_name)
        fn = getattr(owner, meth)
        name = f"{cls_name}.{meth}" if cls_name else meth
        setattr(owner, meth, timed(name, fn))
        undo.append(lambda o=owner, m=meth, f=fn: setattr(o, m, f))
    try:
        run = engine_run(models, reqs, bs, NEW_TIERS, device, mode, table)
    finally:
        for fn in undo:
            fn()
    steps = max(run["steps"], 1)
    lines = [f"{run['steps']} steps, {run['wall_ms_per_step']:.3f} wall ms per step"]
    for name in sorted(spent, key=spent.get, reverse=True):
        lines.append(
            f"{spent[name] * 1000.0 / steps:8.3f} ms per step  {calls[name] / steps:5.2f} calls"
            f"  {name}"
        )
    return "\n".join(lines)


def kernel_profile(
    models: Any, reqs: list, bs: int, device: str, mode: str, table: Any, top: int = 25
) -> str:
    from torch.profiler import ProfilerActivity, profile

    def dspark() -> Any:
        return engine_run(models, reqs, bs, NEW_TIERS, device, mode, table)

    out = []
    for name, fn in ((mode, dspark), ("nospec", lambda: nospec_run(models, reqs, bs, device))):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top)
        out.append(f"== {name} bs={bs}\n{table}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--queue-file", required=True)
    ap.add_argument("--batch", default="1,64,256")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--tiers", default="old,new")
    ap.add_argument("--cprofile", default="", help="batch sizes for a host cProfile")
    ap.add_argument("--kernels", default="", help="batch sizes for a torch.profiler table")
    ap.add_argument("--syncs", default="", help="batch sizes for a list of host-device syncs")
    ap.add_argument("--timeline", default="", help="batch sizes for host ms per step part")
    ap.add_argument(
        "--mode",
        choices=("static", "compact"),
        default="static",
        help="DSpark mode of the engine runs (compact reads --cost-table)",
    )
    ap.add_argument("--cost-table", default=None, help="cost table for compact")
    ap.add_argument("--drafter", default=None, help="drafter directory (default: shipped)")
    ap.add_argument("--out", default="out/step_profile.json")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    models = load_models(args.drafter, device=args.device, dtype=dtype)
    table = load_cost_table(args.cost_table, args.device) if args.mode == "compact" else None
    traffic = load_traffic(args.queue_file)
    result: dict[str, Any] = {
        "command": " ".join(["python", "bench/bench_step_profile.py", *sys.argv[1:]]),
        "rows": [],
    }
    texts: list[str] = []
    sizes = [int(b) for b in args.batch.split(",") if b]
    for bs in sizes:
        reqs = traffic_to_requests(traffic[:bs], models.tokenizer)
        for r in reqs:
            r.max_new_tokens, r.arrival_step = args.new_tokens, 0
        nospec_run(models, reqs, bs, args.device)  # warm
        ns = nospec_run(models, reqs, bs, args.device)
        for tier_name in args.tiers.split(","):
            tiers = OLD_TIERS if tier_name == "old" else NEW_TIERS
            engine_run(models, reqs, bs, tiers, args.device, args.mode, table)  # warm
            row = engine_run(models, reqs, bs, tiers, args.device, args.mode, table)
            same = sum(row["outputs"][k] == ns["outputs"][k] for k in ns["outputs"])
            line = {
                "batch": bs,
                "tiers": tier_name,
                "mode": args.mode,
                "dspark_tok_s": row["tok_s"],
                "nospec_tok_s": ns["tok_s"],
                "dspark_ms_per_step": row["wall_ms_per_step"],
                "nospec_ms_per_step": ns["wall_ms_per_step"],
                "step_cpu_ms": row["step_cpu_ms"],
                "draft_gpu_ms": row["draft_gpu_ms"],
                "verify_gpu_ms": row["verify_gpu_ms"],
                "verify_tokens": row["verify_tokens"],
                "exact_match": same / len(ns["outputs"]),
            }
            result["rows"].append(line)
            log(json.dumps(line))
        if str(bs) in args.cprofile.split(","):
            texts.append(
                f"== host cProfile, {args.mode} bs={bs}\n"
                + host_profile(models, reqs, bs, args.device, args.mode, table)
            )
        if str(bs) in args.syncs.split(","):
            texts.append(
                f"== host-device syncs, {args.mode} bs={bs}\n"
                + sync_sites(models, reqs, bs, args.device, args.mode, table)
            )
        if str(bs) in args.timeline.split(","):
            texts.append(
                f"== host timeline, {args.mode} bs={bs}\n"
                + timeline(models, reqs, bs, args.device, args.mode, table)
            )
        if str(bs) in args.kernels.split(","):
            texts.append(kernel_profile(models, reqs, bs, args.device, args.mode, table))
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    path.with_suffix(".txt").write_text("\n\n".join(texts))
    print("\n\n".join(texts)[-6000:])
    print(
        "| batch | tiers | mode | no-spec tok/s | DSpark tok/s | ms/step no-spec | "
        "ms/step DSpark | host step ms | draft gpu ms | verify gpu ms | verify tokens | exact |"
    )
    for r in result["rows"]:
        print(
            "| {batch} | {tiers} | {mode} | {nospec_tok_s:.0f} | {dspark_tok_s:.0f} | "
            "{nospec_ms_per_step:.2f} | {dspark_ms_per_step:.2f} | {step_cpu_ms} | "
            "{draft_gpu_ms} | {verify_gpu_ms} | {verify_tokens} | {exact_match:.2f} |".format(**r)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
