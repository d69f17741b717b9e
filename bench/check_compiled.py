"""Compiled against eager on the device the compiled path serves (CUDA), with random
SmolLM2-shaped models: no weights needed, so it runs on a bare GPU machine in a minute or two.

Two checks per dtype:

* pool: the same prefill and two packed forwards, then one draft, run by a runtime eager and
  by one compiled (``torch.compile`` with inductor, as ``--compile`` runs): the largest
  difference of the logits, the target pool, the drafter pool and the confidences, and
  whether the drafted tokens are equal;
* engine: greedy tokens of no-spec (eager, compiled) and of static and compact (eager,
  compiled) over a queue of two requests per slot, each as its match rate against eager
  no-spec (the share of tokens before each request's first difference).

In float32 everything should match (1.000); in bf16 compiled kernels round apart from eager
ones, and random models, whose logits sit close together, flip greedy picks often: there the
figures show the size of that rounding, not a fault.

    python bench/check_compiled.py --device cuda --batch 16,64
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_obs.engine.drafter import Drafter
from dspark_obs.engine.drafter_config import DrafterConfig
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.model import ModelConfig, Target
from dspark_obs.engine.no_spec import run_no_spec
from dspark_obs.engine.session import load_cost_table
from dspark_obs.engine.types import EngineConfig, GenRequest
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.testing.compiled_check import eager_and_compiled

VOCAB = 8  # a small vocabulary, so random drafts are sometimes accepted
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def random_models(device: torch.device, dtype: torch.dtype, seed: int) -> tuple[Target, Drafter]:
    """SmolLM2-135M's shapes (6 of its 30 layers) and the shipped drafter's, random weights."""
    torch.manual_seed(seed)
    cfg = replace(ModelConfig.smollm2_135m(), vocab_size=VOCAB, max_position=2048, num_layers=6)
    target = Target(cfg)
    drafter = Drafter(DrafterConfig.for_target(target, num_layers=3, gamma_max=7, markov_rank=8,
                                               context_window=1024), target)  # fmt: skip
    with torch.no_grad():
        for p in [*target.parameters(), *drafter.parameters()]:
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    return target.to(device, dtype).eval(), drafter.to(device, dtype).eval()


@torch.no_grad()
def pool_check(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    target, drafter = random_models(device, dtype, 3)
    prompts = [[1, 2, 3, 4, 5] * 9, [6, 7] * 30, [1, 1, 2, 3, 5, 0, 7] * 5]
    steps = [[[1, 2], [3], [4, 5, 6]], [[7], [0, 1, 2], [3]]]
    runs = eager_and_compiled(target, drafter, prompts, steps, gamma=5, max_len=256)
    eager, comp = runs[False], runs[True]

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max())

    return {
        "logits": max(diff(a, b) for a, b in zip(eager.logits, comp.logits, strict=True)),
        "target_pool": diff(eager.kv, comp.kv),
        "drafter_pool": diff(eager.dkv, comp.dkv),
        "confidence": diff(eager.block.confidence, comp.block.confidence),
        "draft_tokens_equal": bool(torch.equal(eager.block.tokens, comp.block.tokens)),
    }


def match_rate(want: dict[str, list[int]], got: dict[str, list[int]]) -> float:
    """Tokens before each request's first difference, over all of ``want``'s tokens."""
    same = total = 0
    for rid, a in want.items():
        b = got[rid]
        differ = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        k = next(differ, min(len(a), len(b)))
        same, total = same + k, total + len(a)
    return same / max(total, 1)


def engine_check(device: torch.device, dtype: torch.dtype, batch: int) -> dict[str, float]:
    target, drafter = random_models(device, dtype, 1)
    rng = np.random.default_rng(batch)
    lengths = rng.integers(10, 200, size=2 * batch)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in lengths]
    reqs = [GenRequest(rid=f"r{i:03d}", prompt_ids=p, max_new_tokens=48, temperature=0.0, seed=i)
            for i, p in enumerate(prompts)]  # fmt: skip
    graphs = device.type == "cuda"
    want = run_no_spec(target, reqs, max_batch=batch, cuda_graphs=graphs).outputs
    got = {"nospec-compiled": run_no_spec(target, reqs, max_batch=batch, cuda_graphs=graphs,
                                          compiled=True).outputs}  # fmt: skip
    table = load_cost_table(None, device.type)
    for mode in ("static", "compact"):
        for compiled in (False, True):
            cfg = EngineConfig(mode=mode, max_batch=batch, compile=compiled, backend="batched",
                               cost_table=table if mode == "compact" else None)  # fmt: skip
            res = Engine(target, drafter, cfg).run(reqs, FanOut([MemorySink()]).emit, mode)
            got[f"{mode}-{'compiled' if compiled else 'eager'}"] = res.outputs
    return {name: round(match_rate(want, outputs), 4) for name, outputs in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="fp32,bf16", help="comma list of fp32, bf16")
    ap.add_argument("--batch", default="16", help="comma list of batch sizes (engine check)")
    ap.add_argument("--out", type=Path, default=None, help="JSON of every figure")
    args = ap.parse_args()
    device = torch.device(args.device)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"device": args.device, "pool": {}, "engine": {}}
    for name in args.dtype.split(","):
        report["pool"][name] = pool_check(device, DTYPES[name])
        print(f"[{time.perf_counter() - t0:6.1f} s] {name} pool: {report['pool'][name]}",
              flush=True)  # fmt: skip
        for batch in (int(b) for b in args.batch.split(",")):
            report["engine"][f"{name} b{batch}"] = engine_check(device, DTYPES[name], batch)
            print(f"[{time.perf_counter() - t0:6.1f} s] {name} batch {batch} match vs eager "
                  f"no-spec: {report['engine'][f'{name} b{batch}']}", flush=True)  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
