"""Train and evaluate the shipped DSpark drafter (runtime/drafter) end to end.

Two stages, so the GPU machine needs neither the workload source packages nor a tokenizer:

1. ``prompts`` (any machine with the workloads + tokenizer): chat-template the TRAIN and
   EVAL split prompts into token ids -> one JSON file (plus the EOS ids).
2. ``run`` (CUDA for the real run, CPU for a smoke run): load SmolLM2 from the GGUF, generate
   the target's responses, train (``train_drafter``), evaluate on the EVAL prompts
   (``drafter_eval.evaluate``) and write the export + ``eval.json`` + ``eval.md``.
   ``--random-target`` replaces the real weights by a random SmolLM2-shaped model (timing).

Reproduce the shipped checkpoint (see runtime/drafter/MODEL_CARD.md for the exact numbers)::

    python bench/bench_drafter_train.py prompts --out prompts.json
    python bench/bench_drafter_train.py run --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        --prompts prompts.json --out-dir out/drafter_run --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_obs.engine.drafter_eval import evaluate, markdown_table  # noqa: E402
from dspark_obs.engine.train import train_drafter  # noqa: E402

WORKLOADS = ("math", "chat", "poetry")


def cmd_prompts(a: argparse.Namespace) -> None:
    from dspark_obs.engine.drafter_eval import eval_prompt_ids
    from dspark_obs.engine.train import workload_prompts
    from dspark_obs.engine.weights import load_smollm2, stop_token_ids

    _, tok = load_smollm2(path=a.gguf)
    counts = {w: int(n) for w, n in zip(WORKLOADS, a.train_counts.split(","), strict=True)}
    train = workload_prompts(tok, WORKLOADS, counts, "train", a.seed, a.max_prompt_tokens)
    ev = eval_prompt_ids(tok, WORKLOADS, a.eval_n, a.seed, a.max_prompt_tokens)
    blob = {
        "train": [[w, ids] for w, ids in train],
        "prompts": ev,
        "eos_ids": list(stop_token_ids(tok)),
        "train_counts": counts,
        "seed": a.seed,
        "max_prompt_tokens": a.max_prompt_tokens,
    }
    Path(a.out).write_text(json.dumps(blob))
    per = {w: sum(1 for x, _ in train if x == w) for w in WORKLOADS}
    print(f"train prompts kept {per}; eval {[len(v) for v in ev.values()]} -> {a.out}")


def cmd_run(a: argparse.Namespace) -> None:
    from dspark_obs.engine.model import ModelConfig, Target
    from dspark_obs.engine.weights import load_target_from_gguf

    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.time()
    if a.random_target:
        torch.manual_seed(0)
        target: Any = Target(ModelConfig.smollm2_135m()).to(dev, dtype).eval()
        target.requires_grad_(False)
    else:
        target = load_target_from_gguf(a.gguf, device=dev, dtype=dtype)
    print(f"[run] target loaded in {time.time() - t0:.1f}s on {dev} {dtype}", flush=True)
    blob = json.loads(Path(a.prompts).read_text())
    train = [(w, ids) for w, ids in blob["train"]]
    if a.train_limit:
        train = train[: a.train_limit]
    eos = blob["eos_ids"]
    out = Path(a.out_dir)
    res = train_drafter(
        target,
        out_dir=out,
        prompts=train,
        gamma=a.gamma,
        steps=a.steps,
        batch_size=a.batch_size,
        lr=a.lr,
        resume=a.resume,
        device=dev,
        seed=a.seed,
        max_new_tokens=a.max_new_tokens,
        blocks_per_seq=a.blocks_per_seq,
        gamma_decay=a.gamma_decay,
        gen_batch_size=a.gen_batch_size,
        warmup=a.warmup,
        ckpt_every=a.ckpt_every,
        log_every=a.log_every,
        time_budget_s=a.time_budget,
        eos_ids=eos,
        drafter_config=json.loads(a.drafter_config) if a.drafter_config else None,
        log=lambda s: print(s, flush=True),
    )
    print(f"[run] trained to step {res.step}; export {res.export_dir}", flush=True)
    if dev.type == "cuda":
        print(f"[run] peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    if a.eval_n <= 0:
        return
    prompts = {w: blob["prompts"][w][: a.eval_n] for w in WORKLOADS}
    temps = [float(t) for t in a.temperatures.split(",")]
    ev = evaluate(
        target,
        res.drafter,
        prompts,
        gamma=a.eval_gamma,
        temperatures=temps,
        max_new_tokens=a.eval_max_new_tokens,
        eos_ids=eos,
        batch_size=a.eval_batch_size,
        seed=a.seed,
        log=lambda s: print(s, flush=True),
    )
    ev["command"] = " ".join(sys.argv)
    (out / "eval.json").write_text(json.dumps(ev, indent=1))
    (out / "eval.md").write_text(markdown_table(ev))
    print(markdown_table(ev), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("--gguf", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--train-counts", default="2200,2200,1817")
    p.add_argument("--eval-n", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run")
    r.add_argument("--gguf", default=None)
    r.add_argument("--random-target", action="store_true")
    r.add_argument("--prompts", required=True)
    r.add_argument("--train-limit", type=int, default=0)
    r.add_argument("--out-dir", required=True)
    r.add_argument("--device", default="cuda")
    r.add_argument("--gamma", type=int, default=7)
    r.add_argument("--steps", type=int, default=3000)
    r.add_argument("--batch-size", type=int, default=32)
    r.add_argument("--lr", type=float, default=6e-4)
    r.add_argument("--resume", action="store_true")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--blocks-per-seq", type=int, default=24)
    r.add_argument("--gamma-decay", type=float, default=4.0)
    r.add_argument("--gen-batch-size", type=int, default=512)
    r.add_argument("--warmup", type=int, default=100)
    r.add_argument("--ckpt-every", type=int, default=500)
    r.add_argument("--log-every", type=int, default=100)
    r.add_argument("--time-budget", type=float, default=None)
    r.add_argument("--drafter-config", default=None, help="JSON overrides of DrafterConfig")
    r.add_argument("--eval-n", type=int, default=128)
    r.add_argument("--eval-gamma", type=int, default=5)
    r.add_argument("--temperatures", default="0,1")
    r.add_argument("--eval-max-new-tokens", type=int, default=256)
    r.add_argument("--eval-batch-size", type=int, default=128)
    a = ap.parse_args()
    cmd_prompts(a) if a.cmd == "prompts" else cmd_run(a)


if __name__ == "__main__":
    main()
