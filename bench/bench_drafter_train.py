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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_obs.engine.drafter_eval import evaluate, markdown_table  # noqa: E402
from dspark_obs.engine.train import train_drafter  # noqa: E402

WORKLOADS = ("math", "chat", "poetry")


VARIANT_ASKS = {
    "math": (
        "Write a new math word problem like the one below, with different people, objects "
        "and numbers. Write only the new problem.\n\nProblem: {text}"
    ),
    "chat": (
        "Write one new question that a user might ask an AI assistant, on a different topic "
        "from the one below. Write only the new question.\n\n{text}"
    ),
    "poetry": (
        "Write four new lines of poetry in the style of the lines below. Write only the "
        "poem.\n\n{text}"
    ),
}
"""How the target is asked for a variant of a train prompt (``run --variants``)."""


def _instruction_prefix(workload: str) -> str:
    """The text a workload's user message starts with before the problem / verse."""
    from dspark_obs.workloads import gsm, poetry

    return {"math": gsm.INSTRUCTION + "\n\n", "poetry": poetry.INSTRUCTION + "\n\n"}.get(
        workload, ""
    )


def chat_wrap(tok: Any, prefix: str) -> tuple[list[int], list[int]]:
    """Token ids before and after a user message's body (``prefix`` + body) in the chat
    template, so a body written by the target becomes a prompt without a tokenizer."""
    marker = "\u2063BODY\u2063"
    text = tok.apply_chat_template(
        [{"role": "user", "content": prefix + marker}], add_generation_prompt=True,
        tokenize=False,
    )
    before, after = text.split(marker)
    return (
        list(tok.encode(before, add_special_tokens=False)),
        list(tok.encode(after, add_special_tokens=False)),
    )


def cmd_prompts(a: argparse.Namespace) -> None:
    import random

    from dspark_obs.engine.drafter_eval import eval_prompt_ids
    from dspark_obs.engine.train_data import encoded_prompts
    from dspark_obs.engine.weights import encode_chat, load_smollm2, stop_token_ids

    _, tok = load_smollm2(path=a.gguf)
    counts: dict[str, int | None] = (
        {w: None for w in WORKLOADS}
        if a.train_counts == "all"
        else {w: int(n) for w, n in zip(WORKLOADS, a.train_counts.split(","), strict=True)}
    )
    rows = {
        w: encoded_prompts(tok, w, "train", counts[w], a.seed, a.max_prompt_tokens)
        for w in WORKLOADS
    }
    ev = eval_prompt_ids(tok, WORKLOADS, a.eval_n, a.seed, a.max_prompt_tokens)
    heldout: dict[str, list[list[int]]] = {w: [] for w in WORKLOADS}
    train: list[tuple[str, list[int], Any]] = []
    held_templates: list[int] = []
    if a.heldout_templates:  # math held out by template: the shift the eval split has
        templates = sorted({int(pr.meta["template"]) for _, pr in rows["math"]})
        held_templates = sorted(random.Random(a.seed).sample(templates, a.heldout_templates))
    for w in WORKLOADS:
        if w == "math" and held_templates:
            held = [r for r in rows[w] if int(r[1].meta["template"]) in held_templates]
            kept = [r for r in rows[w] if int(r[1].meta["template"]) not in held_templates]
            heldout[w] = [ids for ids, _ in held[: a.heldout_n]]
        else:  # the last heldout_n TRAIN prompts of each workload, never trained on
            cut = len(rows[w]) - a.heldout_n if a.heldout_n else len(rows[w])
            kept = rows[w][:cut]
            heldout[w] = [ids for ids, _ in rows[w][cut:]]
        train.extend((w, ids, pr) for ids, pr in kept)
    blob: dict[str, Any] = {
        "train": [[w, ids] for w, ids, _ in train],
        "heldout": heldout,
        "prompts": ev,
        "eos_ids": list(stop_token_ids(tok)),
        "train_counts": {w: (len(rows[w]) if counts[w] is None else counts[w]) for w in WORKLOADS},
        "heldout_math_templates": held_templates,
        "seed": a.seed,
        "max_prompt_tokens": a.max_prompt_tokens,
    }
    if a.variant_requests:  # the target will write variants of these train prompts on the GPU
        rng = random.Random(a.seed + 1)
        reqs: list[list[Any]] = []
        for w in WORKLOADS:
            mine = [pr for x, _, pr in train if x == w]
            for pr in rng.sample(mine, min(a.variant_requests, len(mine))):
                body = pr.text[len(_instruction_prefix(w)) :][: a.variant_max_chars]
                ask = VARIANT_ASKS[w].format(text=body)
                reqs.append([w, encode_chat(tok, [{"role": "user", "content": ask}])])
        blob["variant_requests"] = reqs
        blob["variant_wraps"] = {w: chat_wrap(tok, _instruction_prefix(w)) for w in WORKLOADS}
    Path(a.out).write_text(json.dumps(blob))
    per = {w: sum(1 for x, _, _ in train if x == w) for w in WORKLOADS}
    print(
        f"train prompts kept {per}; held-out {[len(v) for v in heldout.values()]}"
        f"{f' (math templates {held_templates})' if held_templates else ''}; "
        f"eval {[len(v) for v in ev.values()]}; "
        f"variant requests {len(blob.get('variant_requests', []))} -> {a.out}"
    )


def snapshot_monitor(a: argparse.Namespace, out: Path) -> Any:
    """on_snapshot callback: export the drafter, evaluate it on the held-out train prompts
    in background processes (the GPU is mostly idle in the latency-bound decode loop)."""
    procs: list[Any] = []
    temps = [t for t in a.monitor_temperatures.split(",") if t]

    def on_snapshot(step: int, drafter: Any) -> None:
        snap = drafter.save(out / "snapshots" / f"step{step}")
        procs.extend(
            eval_processes(
                snap, a, "heldout", a.monitor_n, a.eval_gamma, a.monitor_max_new_tokens,
                out / "monitor", f"step{step}", records=False, temps=temps,
            )
        )
        print(f"[monitor] step {step}: {len(temps) * len(WORKLOADS)} held-out evals started")

    on_snapshot.procs = procs  # type: ignore[attr-defined]
    return on_snapshot


def load_target(a: argparse.Namespace) -> Any:
    """SmolLM2 from the GGUF (bf16 on CUDA, fp32 on CPU), or a random one of its shape."""
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
    return target


def cmd_data(a: argparse.Namespace) -> None:
    """Generate the training sequences once (variants first, then responses) and the
    held-out monitor's sequences, for several recipes to share."""
    from dspark_obs.engine.train_data import build_train_data, variant_prompts
    from dspark_obs.engine.train_runner import PaddedRunner

    target = load_target(a)
    blob = json.loads(Path(a.prompts).read_text())
    eos = blob["eos_ids"]
    runner = PaddedRunner(target, torch.device(a.device))
    train = [(w, ids) for w, ids in blob["train"]]
    if a.train_limit:
        train = train[: a.train_limit]
    modes = [m for m in a.modes.split(",") if m]
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.time()
    variants: list[tuple[str, list[int]]] = []
    if a.variants and blob.get("variant_requests"):
        reqs = [(w, ids) for w, ids in blob["variant_requests"]][: a.variants or None]
        wraps = {w: (pre, post) for w, (pre, post) in blob["variant_wraps"].items()}
        variants = variant_prompts(
            runner, reqs, wraps, a.variant_max_new_tokens, a.variant_temperature, eos,
            a.seed, a.gen_batch_size, log=log,
        )
        variants = [(w, ids) for w, ids in variants if len(ids) <= blob["max_prompt_tokens"]]
    data = build_train_data(
        runner, train + variants, a.max_new_tokens, modes, eos, a.seed, a.gen_batch_size,
        log, one_mode_per_prompt=a.one_mode_per_prompt,
    )
    data.info.update(
        {"prompts": len(train), "variant_prompts": len(variants), "seconds": time.time() - t0}
    )
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data.save(out / "data.pt")
    held = [(w, ids) for w in WORKLOADS for ids in blob.get("heldout", {}).get(w, [])]
    if held:
        mon = build_train_data(runner, held, a.max_new_tokens, modes, eos, a.seed + 1,
                               a.gen_batch_size, log)
        mon.save(out / "heldout.pt")
    print(f"[data] {len(data.seqs)} sequences ({len(variants)} variant prompts), "
          f"{data.info['tokens']} tokens in {time.time() - t0:.0f}s -> {out}", flush=True)


SAME_NAMED_ARGS = (
    "gamma", "steps", "batch_size", "lr", "resume", "seed", "max_new_tokens", "blocks_per_seq",
    "gamma_decay", "gen_batch_size", "warmup", "ckpt_every", "log_every", "regime_heads",
    "one_mode_per_prompt", "monitor_every",
)  # fmt: skip
"""``run``'s options passed to train_drafter under the same name."""


def cmd_run(a: argparse.Namespace) -> None:
    from dspark_obs.engine.train import parse_loss_weights
    from dspark_obs.engine.train_data import TrainData

    dev = torch.device(a.device)
    target = load_target(a)
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
        loss_weights=parse_loss_weights(a.loss),
        data=TrainData.load(Path(a.data)) if a.data else None,
        monitor=TrainData.load(Path(a.monitor_data)) if a.monitor_data else None,
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


def eval_processes(
    drafter: Path, a: argparse.Namespace, key: str, n: int, gamma: int, max_new: int,
    out: Path, tag: str, records: bool, temps: Sequence[str] = ("0", "1"),
) -> list[Any]:
    """One ``drafter_eval`` process per workload and temperature in ``temps`` (the decode
    loop is latency-bound, so they share one GPU well), writing ``out/{tag}_{w}_T{t}.json``
    and its ``.log``."""
    import os
    import subprocess

    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    for w in WORKLOADS:
        for t in temps:
            cmd = [
                sys.executable, "-m", "dspark_obs.engine.drafter_eval", "--drafter",
                str(drafter), "--gguf", a.gguf, "--prompts-file", a.prompts,
                "--prompts-key", key, "--workloads", w, "--temperatures", t, "--n", str(n),
                "--gamma", str(gamma), "--max-new-tokens", str(max_new), "--batch-size",
                str(n), "--device", a.device, "--out", str(out / f"{tag}_{w}_T{t}.json"),
            ] + (["--records"] if records else [])  # fmt: skip
            log = (out / f"{tag}_{w}_T{t}.log").open("w")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    return procs


def cmd_recipes(a: argparse.Namespace) -> None:
    """Several recipes on one GPU, side by side, on one shared data set: data, training
    (one process each), held-out decoding of every result, then the winner (highest mean
    held-out accept length over workloads and temperatures) on the EVAL split and on the
    held-out split with records (for the STS fit). Writes ``recipes.json``."""
    import os
    import subprocess

    from dspark_obs.engine.drafter_eval import merge_results

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recipes = json.loads(Path(a.recipes).read_text())
    names = [r["name"] for r in recipes]
    if len(set(names)) != len(names) or not names:
        raise SystemExit(f"{a.recipes}: recipe names must be distinct and non-empty: {names}")
    if not (out / "data" / "data.pt").exists():
        subprocess.run(
            [sys.executable, __file__, "data", "--gguf", a.gguf, "--prompts", a.prompts,
             "--out-dir", str(out / "data"), "--device", a.device, *a.data_args.split()],
            check=True,
        )  # fmt: skip
    if a.wait_for:  # e.g. the init weights, still on their way to this machine
        t0 = time.time()
        while not Path(a.wait_for).exists():
            if time.time() - t0 > 600:
                raise SystemExit(f"{a.wait_for} never appeared")
            time.sleep(2)
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    procs = {}
    for r in recipes:
        d = out / r["name"]
        d.mkdir(exist_ok=True)
        cmd = [
            sys.executable, __file__, "run", "--gguf", a.gguf, "--prompts", a.prompts,
            "--out-dir", str(d), "--device", a.device, "--data", str(out / "data" / "data.pt"),
            "--monitor-data", str(out / "data" / "heldout.pt"), "--eval-n", "0",
            "--time-budget", str(a.time_budget), *a.common_args.split(), *r["args"],
        ]  # fmt: skip
        log = (d / "train.log").open("w")
        procs[r["name"]] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        print(f"[recipes] {r['name']}: {' '.join(r['args'])}", flush=True)
    failed = [n for n, p in procs.items() if p.wait() != 0]
    done = [n for n in names if n not in failed]
    print(f"[recipes] trained {done}; failed {failed}", flush=True)
    evals = []
    for n in done:
        evals += eval_processes(
            out / n / "drafter", a, "heldout", a.heldout_n, a.eval_gamma, a.heldout_max_new,
            out / "heldout_eval", n, records=False,
        )
    for p in evals:
        p.wait()
    table: dict[str, dict[str, float]] = {}
    for n in done:
        parts = [json.loads(f.read_text()) for f in (out / "heldout_eval").glob(f"{n}_*.json")]
        if len(parts) == 2 * len(WORKLOADS):
            res = merge_results(parts)["results"]
            table[n] = {k: v["mean_accept_length"] for k, v in res.items()}
    if not table:
        raise SystemExit("[recipes] no recipe finished its held-out evaluation")
    winner = max(table, key=lambda n: sum(table[n].values()) / len(table[n]))
    for n, row in table.items():
        mark = "  <- winner" if n == winner else ""
        cells = " ".join(f"{k} {v:.3f}" for k, v in sorted(row.items()))
        print(f"[recipes] held-out {n}: {cells}{mark}", flush=True)
    final = out / "final"
    procs_f = eval_processes(
        out / winner / "drafter", a, "prompts", a.eval_n, a.eval_gamma, a.eval_max_new,
        final, "eval", records=True,
    ) + eval_processes(
        out / winner / "drafter", a, "heldout", a.fit_n, a.fit_gamma, a.eval_max_new,
        final, "fit", records=True,
    )
    for p in procs_f:
        p.wait()
    summary: dict[str, Any] = {"recipes": recipes, "heldout": table, "winner": winner}
    for tag in ("eval", "fit"):
        parts = [json.loads(f.read_text()) for f in sorted(final.glob(f"{tag}_*.json"))]
        if parts:
            merged = merge_results(parts)
            (final / f"{tag}.json").write_text(json.dumps(merged))
            summary[tag] = {k: v["mean_accept_length"] for k, v in merged["results"].items()}
            print(f"[recipes] {tag} ({winner}):\n{markdown_table(merged)}", flush=True)
    (out / "recipes.json").write_text(json.dumps(summary, indent=1))


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
    p.add_argument(
        "--train-counts", default="2200,2200,1817", help="math,chat,poetry counts, or 'all'"
    )
    p.add_argument("--eval-n", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout-n", type=int, default=0, help="held-out TRAIN prompts/workload")
    p.add_argument(
        "--heldout-templates", type=int, default=0,
        help="hold out every instance of this many math train templates (held-out math "
        "then sees unseen templates, as the eval split does)",
    )
    p.add_argument(
        "--variant-requests", type=int, default=0,
        help="per workload: train prompts the target is asked to write a variant of",
    )
    p.add_argument("--variant-max-chars", type=int, default=1200)
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
    r.add_argument("--data", default=None, help="train on this data.pt (from `data`)")
    r.add_argument("--monitor-data", default=None, help="held-out data.pt, scored teacher-forced")
    r.add_argument("--monitor-every", type=int, default=0, help="held-out TF monitor period")
    r.add_argument("--loss", default=None, help="term weights, e.g. ce=0.1,tv=0.5,kl=0.5")
    r.add_argument("--regime-heads", action="store_true",
                   help="train each confidence head on its own sampling regime's sequences")
    r.add_argument("--one-mode-per-prompt", action="store_true",
                   help="answer each prompt once, the modes in turn")
    g = sub.add_parser("data", help="generate the shared training and held-out sequences")
    g.add_argument("--gguf", default=None)
    g.add_argument("--random-target", action="store_true")
    g.add_argument("--prompts", required=True)
    g.add_argument("--out-dir", required=True)
    g.add_argument("--device", default="cuda")
    g.add_argument("--train-limit", type=int, default=0)
    g.add_argument("--modes", default="greedy,sample")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--gen-batch-size", type=int, default=512)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--one-mode-per-prompt", action="store_true")
    g.add_argument("--variants", type=int, default=0,
                   help="variant requests to answer (0: none; see `prompts --variant-requests`)")
    g.add_argument("--variant-temperature", type=float, default=0.7)
    g.add_argument("--variant-max-new-tokens", type=int, default=160)
    q = sub.add_parser("recipes", help="train several recipes side by side and pick one")
    q.add_argument("--gguf", required=True)
    q.add_argument("--prompts", required=True)
    q.add_argument("--recipes", required=True, help='JSON [{"name": .., "args": [run args]}]')
    q.add_argument("--out-dir", required=True)
    q.add_argument("--device", default="cuda")
    q.add_argument("--data-args", default="", help="extra `data` arguments")
    q.add_argument("--common-args", default="", help="`run` arguments every recipe gets")
    q.add_argument("--time-budget", type=float, default=480.0, help="seconds per recipe")
    q.add_argument("--wait-for", default=None, help="a path to wait for before training")
    q.add_argument("--heldout-n", type=int, default=16)
    q.add_argument("--heldout-max-new", type=int, default=96)
    q.add_argument("--eval-n", type=int, default=24)
    q.add_argument("--eval-gamma", type=int, default=5)
    q.add_argument("--eval-max-new", type=int, default=128)
    q.add_argument("--fit-n", type=int, default=48)
    q.add_argument("--fit-gamma", type=int, default=7)
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
        "data": cmd_data,
        "recipes": cmd_recipes,
    }
    commands[a.cmd](a)


if __name__ == "__main__":
    main()
