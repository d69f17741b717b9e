"""Train and evaluate the shipped DSpark drafter (runtime/drafter) end to end.

Two stages, so the GPU machine needs neither the workload source packages nor a tokenizer:

1. ``prompts`` (any machine with the workloads + tokenizer): chat-template the TRAIN and
   EVAL split prompts into token ids -> one JSON file (plus the EOS ids).
2. ``run`` (CUDA for the real run, CPU for a smoke run): load SmolLM2 from the GGUF, generate
   the target's responses, train (``train_drafter``), evaluate on the EVAL prompts
   (``drafter_eval.evaluate``) and write the export + ``eval.json`` + ``eval.md``.
   ``--random-target`` replaces the real weights by a random SmolLM2-shaped model (timing).
   ``--init-from DIR`` starts from a saved drafter; ``--snapshot-every N`` exports the drafter
   every N steps (and at step 0) and evaluates it on the HELD-OUT train prompts in background
   processes (one per workload and temperature), so accept length is monitored as it trains.
3. ``merge`` joins per-process evaluation JSONs; ``calibrate`` fits one STS per sampling
   regime on held-out-train records and scores it on EVAL records (sts.json, sts_greedy.json).

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
    from dspark_obs.engine.train_data import workload_prompts
    from dspark_obs.engine.weights import load_smollm2, stop_token_ids

    _, tok = load_smollm2(path=a.gguf)
    counts = {w: int(n) for w, n in zip(WORKLOADS, a.train_counts.split(","), strict=True)}
    train = workload_prompts(tok, WORKLOADS, counts, "train", a.seed, a.max_prompt_tokens)
    ev = eval_prompt_ids(tok, WORKLOADS, a.eval_n, a.seed, a.max_prompt_tokens)
    # held-out = the last heldout_n TRAIN prompts of each workload, never trained on
    heldout: dict[str, list[list[int]]] = {w: [] for w in WORKLOADS}
    for w in WORKLOADS:
        rows = [ids for x, ids in train if x == w]
        heldout[w] = rows[len(rows) - a.heldout_n :] if a.heldout_n else []
    held = {id(ids) for rows in heldout.values() for ids in rows}
    train = [(w, ids) for w, ids in train if id(ids) not in held]
    blob = {
        "train": [[w, ids] for w, ids in train],
        "heldout": heldout,
        "prompts": ev,
        "eos_ids": list(stop_token_ids(tok)),
        "train_counts": counts,
        "seed": a.seed,
        "max_prompt_tokens": a.max_prompt_tokens,
    }
    Path(a.out).write_text(json.dumps(blob))
    per = {w: sum(1 for x, _ in train if x == w) for w in WORKLOADS}
    print(
        f"train prompts kept {per}; held-out {[len(v) for v in heldout.values()]}; "
        f"eval {[len(v) for v in ev.values()]} -> {a.out}"
    )


def snapshot_monitor(a: argparse.Namespace, out: Path) -> Any:
    """on_snapshot callback: export the drafter, evaluate it on the held-out train prompts
    in background processes (the GPU is mostly idle in the latency-bound decode loop)."""
    import os
    import subprocess

    procs: list[Any] = []
    temps = [t for t in a.monitor_temperatures.split(",") if t]

    def on_snapshot(step: int, drafter: Any) -> None:
        snap = drafter.save(out / "snapshots" / f"step{step}")
        mon = out / "monitor"
        mon.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for w in WORKLOADS:
            for t in temps:
                name = f"step{step}_{w}_T{t}"
                cmd = [
                    sys.executable, "-m", "dspark_obs.engine.drafter_eval",
                    "--drafter", str(snap), "--gguf", a.gguf, "--prompts-file", a.prompts,
                    "--prompts-key", "heldout", "--workloads", w, "--temperatures", t,
                    "--n", str(a.monitor_n), "--gamma", str(a.eval_gamma),
                    "--max-new-tokens", str(a.monitor_max_new_tokens),
                    "--batch-size", str(a.monitor_n), "--device", a.device,
                    "--out", str(mon / f"{name}.json"),
                ]  # fmt: skip
                log = (mon / f"{name}.log").open("w")
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        print(f"[monitor] step {step}: {len(temps) * len(WORKLOADS)} held-out evals started")

    on_snapshot.procs = procs  # type: ignore[attr-defined]
    return on_snapshot


SAME_NAMED_ARGS = (
    "gamma", "steps", "batch_size", "lr", "resume", "seed", "max_new_tokens", "blocks_per_seq",
    "gamma_decay", "gen_batch_size", "warmup", "ckpt_every", "log_every",
)  # fmt: skip
"""``run``'s options passed to train_drafter under the same name."""


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
    monitor = snapshot_monitor(a, out) if a.snapshot_every and blob.get("heldout") else None
    res = train_drafter(
        target,
        out_dir=out,
        prompts=train,
        device=dev,
        **{name: getattr(a, name) for name in SAME_NAMED_ARGS},
        time_budget_s=a.time_budget,
        eos_ids=eos,
        drafter_config=json.loads(a.drafter_config) if a.drafter_config else None,
        modes=[m for m in a.modes.split(",") if m],
        init_from=a.init_from,
        on_snapshot=monitor,
        snapshot_every=a.snapshot_every,
        log=lambda s: print(s, flush=True),
    )
    if monitor is not None:
        if res.step % a.snapshot_every:
            monitor(res.step, res.drafter)  # the final weights, on the same held-out prompts
        for proc in monitor.procs:
            proc.wait()
        print(monitor_table(out / "monitor"), flush=True)
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


def monitor_table(folder: Path) -> str:
    """Held-out accept length per snapshot step, workload and temperature (markdown)."""
    rows: dict[tuple[int, str], dict[str, float]] = {}
    for f in sorted(folder.glob("step*_*.json")):
        step = int(f.name.split("_")[0][4:])
        for key, s in json.loads(f.read_text())["results"].items():
            w, t = key.split("@T")
            rows.setdefault((step, f"T{t}"), {})[w] = s["mean_accept_length"]
    lines = ["| step | T | " + " | ".join(WORKLOADS) + " |", "|---|---|---|---|---|"]
    for (step, t), v in sorted(rows.items()):
        cells = " | ".join(f"{v[w]:.3f}" if w in v else "" for w in WORKLOADS)
        lines.append(f"| {step} | {t} | {cells} |")
    return "\n".join(lines)


def read_json(path: str | Path) -> Any:
    """A JSON file, gzip-compressed when its name ends in .gz."""
    import gzip

    p = Path(path)
    text = gzip.decompress(p.read_bytes()).decode() if p.suffix == ".gz" else p.read_text()
    return json.loads(text)


def cmd_merge(a: argparse.Namespace) -> None:
    from dspark_obs.engine.drafter_eval import merge_results

    parts = [read_json(f) for f in a.files]
    merged = merge_results(parts)
    Path(a.out).write_text(json.dumps(merged, indent=1))
    print(markdown_table(merged))


def cmd_calibrate(a: argparse.Namespace) -> None:
    from dspark_obs.engine.drafter_eval import calibration_report

    fit = read_json(a.fit)
    ev = read_json(a.eval)
    rep = calibration_report(fit, ev, gamma_max=a.gamma_max)
    Path(a.out).write_text(json.dumps(rep, indent=1))
    names = {"T0": "sts_greedy.json", "T1": "sts.json"}
    for regime, r in rep.items():
        if a.write_sts and regime in names:
            (Path(a.write_sts) / names[regime]).write_text(json.dumps(r["sts"], indent=2))
        print(f"{regime}: temperatures {[round(t, 3) for t in r['sts']['temperatures']]}")
        for name, e in r["eval"].items():
            raw = " / ".join(f"{x:.3f}" for x in e["ece_raw"])
            sts = " / ".join(f"{x:.3f}" for x in e["ece_sts"])
            print(f"  {name}: ECE raw {raw} | after STS {sts} | AUROC1 {e['auroc_1']:.3f}")


def cmd_heads(a: argparse.Namespace) -> None:
    """Both confidence heads on the same greedy decoding steps (drafts do not depend on the
    confidence, so one run scores both): raw ECE per position and AUROC at position 1."""
    import numpy as np

    from dspark_obs.analytics.calibration import auroc, ece
    from dspark_obs.engine.drafter import Drafter
    from dspark_obs.engine.drafter_eval import eval_prompt_ids, speculative_run
    from dspark_obs.engine.weights import load_smollm2, stop_token_ids

    target, tok = load_smollm2(device=a.device, path=a.gguf)
    drafter = Drafter.load(a.drafter, target, device=a.device)
    if drafter.conf_head_greedy is None:
        raise SystemExit(f"{a.drafter}: no greedy confidence head to compare")
    calls: list[list[Any]] = []
    conf = drafter._conf

    def both(h: Any, u: Any) -> Any:  # stash [B, 2] per position, return as before
        z = conf(h, u)
        if not calls or len(calls[-1]) == a.gamma:
            calls.append([])
        calls[-1].append(z.detach().cpu())
        return z

    drafter._conf = both  # type: ignore[method-assign]
    if a.prompts_file:
        blob = read_json(a.prompts_file)
        prompts = {w: blob[a.prompts_key][w][: a.n] for w in WORKLOADS}
    else:
        prompts = eval_prompt_ids(tok, WORKLOADS, a.n, a.seed, 384)
    out: dict[str, Any] = {}
    for w in WORKLOADS:
        calls.clear()
        stats = speculative_run(
            target, drafter, prompts[w], a.gamma, 0.0, a.max_new_tokens, stop_token_ids(tok)
        )
        z = np.concatenate([torch.stack(c, 1).numpy() for c in calls])  # [steps, gamma, 2]
        c = np.asarray(stats.correct)
        out[w] = {}
        for head, i in (("sampling", 0), ("greedy", 1)):
            surv = np.cumprod(1 / (1 + np.exp(-z[:, :, i])), 1)
            eces = [ece(surv[:, j], (c >= j + 1).astype(float)) for j in range(a.gamma)]
            out[w][head] = {
                "ece_raw": eces,
                "auroc_1": auroc(z[:, 0, i], c >= 1),
                "conf_logits": np.round(z[:, :, i], 4).tolist(),
            }
            print(f"{w} {head} head: raw ECE {' / '.join(f'{e:.3f}' for e in eces)}"
                  f" | AUROC1 {out[w][head]['auroc_1']:.3f} ({c.size} greedy steps)")
        out[w]["correct"] = c.tolist()
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    if a.fit_sts:  # the sampling head's greedy-regime STS, positions past gamma left at 1.0
        from dspark_obs.analytics.sts import fit_sts

        c = np.concatenate([np.asarray(out[w]["correct"]) for w in WORKLOADS])
        z = np.concatenate([np.asarray(out[w]["sampling"]["conf_logits"]) for w in WORKLOADS])
        prefix = (np.arange(z.shape[1])[None, :] < c[:, None]).astype(np.float64)
        sts = fit_sts(z, prefix, dataset=f"{a.prompts_key} T=0 sampling head").to_dict()
        sts["temperatures"] += [1.0] * max(drafter.cfg.gamma_max - len(sts["temperatures"]), 0)
        Path(a.fit_sts).write_text(json.dumps(sts, indent=2))
        print(f"STS (greedy, sampling head) -> {a.fit_sts}: {sts['temperatures']}")


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
    p.add_argument("--heldout-n", type=int, default=0, help="held-out TRAIN prompts/workload")
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
    r.add_argument("--modes", default="greedy,sample", help="one response per mode per prompt")
    r.add_argument("--init-from", default=None, help="start from this saved drafter")
    r.add_argument("--snapshot-every", type=int, default=0, help="held-out monitor period")
    r.add_argument("--monitor-n", type=int, default=16)
    r.add_argument("--monitor-max-new-tokens", type=int, default=96)
    r.add_argument("--monitor-temperatures", default="0,1")
    m = sub.add_parser("merge")
    m.add_argument("files", nargs="+")
    m.add_argument("--out", required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("--fit", required=True, help="merged held-out-train eval with records")
    c.add_argument("--eval", required=True, help="merged EVAL-split eval with records")
    c.add_argument("--gamma-max", type=int, default=7)
    c.add_argument("--out", required=True)
    c.add_argument("--write-sts", default=None, help="folder for sts.json / sts_greedy.json")
    h = sub.add_parser("heads", help="greedy vs sampling confidence head on greedy steps")
    h.add_argument("--drafter", default="runtime/drafter")
    h.add_argument("--gguf", default=None)
    h.add_argument("--n", type=int, default=8)
    h.add_argument("--gamma", type=int, default=5)
    h.add_argument("--max-new-tokens", type=int, default=128)
    h.add_argument("--device", default="cpu")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--prompts-file", default=None, help="token-id prompts (default: EVAL)")
    h.add_argument("--prompts-key", default="heldout")
    h.add_argument("--out", default=None)
    h.add_argument("--fit-sts", default=None, help="write the sampling head's greedy STS here")
    a = ap.parse_args()
    commands = {
        "prompts": cmd_prompts,
        "run": cmd_run,
        "merge": cmd_merge,
        "calibrate": cmd_calibrate,
        "heads": cmd_heads,
    }
    commands[a.cmd](a)


if __name__ == "__main__":
    main()
