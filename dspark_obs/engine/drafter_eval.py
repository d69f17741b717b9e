"""Offline quality of a drafter: real speculative decoding with full-block verification.

For each workload and temperature, requests run the whole draft -> verify -> accept loop on
the embedded target (``Target.forward`` with one KVCache per request, the drafter with its
per-request :class:`~dspark_obs.engine.drafter.DrafterCache`); every block of ``gamma``
drafts is verified in full (``static`` mode), so no position is censored. Reported:

* mean accept length per step (1 + correct drafts: the bonus token included; the uncut
  full-block value, also on a request's last step);
* conditional acceptance per position j: P(draft j accepted | drafts < j accepted);
* raw ECE per position (DESIGN.md parity definition: survival S_j clamped to
  [1e-8, 1 - 1e-8], label 1[j <= correct_drafts], 15 equal-width bins);
* AUROC of the position-1 confidence against "draft 1 accepted".

With ``records=True`` the per-step correct counts and raw confidence logits come back too,
so STS can be fitted on one prompt split and scored on another (:func:`calibration_report`:
one STS per sampling regime, fitted on held-out TRAIN prompts, scored on the EVAL split).

Greedy (temperature 0): a draft is correct iff it equals the target's argmax. Temperature
T > 0: rejection sampling, accept draft x with probability min(1, p(x)/q(x)), on rejection
sample from norm(max(p - q, 0)); p and q both at temperature T.

CLI (CPU subset, or CUDA for the full numbers)::

    python -m dspark_obs.engine.drafter_eval --drafter runtime/drafter --n 4 \\
        --max-new-tokens 64 --device cpu --out /tmp/eval.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dspark_obs.analytics.calibration import auroc, ece
from dspark_obs.engine.drafter import Drafter


@dataclass
class SpecStats:
    """Per-step records of one (workload, temperature) run."""

    gamma: int
    correct: list[int] = field(default_factory=list)
    survival: list[list[float]] = field(default_factory=list)
    conf_logits: list[list[float]] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    def extend(self, other: SpecStats) -> None:
        """Append another run's steps (same gamma)."""
        for name in ("correct", "survival", "conf_logits", "committed", "outputs"):
            getattr(self, name).extend(getattr(other, name))

    def summary(self) -> dict[str, Any]:
        c = np.asarray(self.correct, dtype=np.int64)
        s = np.asarray(self.survival, dtype=np.float64).reshape(-1, self.gamma)
        cond, eces, acc_rate = [], [], []
        for j in range(1, self.gamma + 1):
            reached = (c >= j - 1).sum()
            cond.append(float((c >= j).sum() / reached) if reached else float("nan"))
            label = (c >= j).astype(np.float64)
            eces.append(ece(s[:, j - 1], label) if c.size else float("nan"))
            acc_rate.append(float(label.mean()) if c.size else float("nan"))
        return {
            "steps": int(c.size),
            "mean_accept_length": float((c + 1).mean()) if c.size else float("nan"),
            "tokens_per_step": float(np.mean(self.committed)) if self.committed else float("nan"),
            "cond_accept": cond,
            "prefix_accept": acc_rate,
            "mean_survival": s.mean(0).tolist() if c.size else [],
            "ece": eces,
            "auroc_1": auroc(s[:, 0], c >= 1) if c.size else float("nan"),
            "generated_tokens": int(sum(len(o) for o in self.outputs)),
        }


def _accept(
    logits: Tensor, drafts: Tensor, q: Tensor, temperature: float, gen: torch.Generator
) -> tuple[int, int]:
    """(correct drafts, bonus token) for one request's verified block.

    logits [gamma+1, V] target logits at anchor..last draft; drafts [gamma]; q [gamma, V]."""
    g = drafts.shape[0]
    if temperature <= 0:
        arg = logits.argmax(-1)
        ok = (drafts == arg[:g]).long()
        c = int(ok.cumprod(0).sum())
        return c, int(arg[c])
    p = torch.softmax(logits.float() / temperature, -1)
    idx = torch.arange(g, device=p.device)
    p_tok = p[idx, drafts]
    q_tok = q[idx, drafts].clamp_min(1e-30)
    u = torch.rand(g, generator=gen, device=gen.device).to(p.device)
    ok = (u < (p_tok / q_tok).clamp(max=1.0)).long()
    c = int(ok.cumprod(0).sum())
    if c < g:
        res = (p[c] - q[c]).clamp_min(0)
        if float(res.sum()) <= 0:
            res = p[c]
        dist = res / res.sum()
    else:
        dist = p[g]
    tok = torch.multinomial(dist.to(gen.device), 1, generator=gen)
    return c, int(tok)


@torch.no_grad()
def speculative_run(
    target: Any,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    gamma: int = 5,
    temperature: float = 0.0,
    max_new_tokens: int = 256,
    eos_ids: Sequence[int] = (),
    seed: int = 0,
) -> SpecStats:
    """Speculative decoding of a batch of prompts with full-block verification.

    Shows the per-step protocol a decode loop follows: prefill (features of every prompt
    position go to the drafter cache, the first token becomes the anchor); then each step
    draft -> verify [anchor, drafts] -> accept -> truncate the target cache to the
    committed length -> append features of anchor + accepted drafts -> bonus = new anchor.
    """
    dev = target.device
    layers = drafter.hidden_layers
    gen = torch.Generator(device=dev).manual_seed(seed)
    stats = SpecStats(gamma)
    eos = {int(e) for e in eos_ids}
    n = len(prompts)
    caches = [target.new_cache(len(p) + max_new_tokens + gamma + 2) for p in prompts]
    dcaches = [drafter.new_cache() for _ in prompts]
    toks = [torch.tensor(list(p), dtype=torch.long, device=dev) for p in prompts]
    out = target.forward(toks, caches, layers, last_logits_only=True)
    anchors: list[int] = []
    outputs: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        drafter.extend(dcaches[i], out.hidden[i])
        lg = out.logits[i][-1]
        if temperature <= 0:
            t = int(lg.argmax())
        else:
            pr = torch.softmax(lg.float() / temperature, -1)
            t = int(torch.multinomial(pr, 1, generator=gen))
        anchors.append(t)
        outputs[i].append(t)
    active = [i for i in range(n) if anchors[i] not in eos and max_new_tokens > 1]
    while active:
        blk = drafter.draft_batch(
            [dcaches[i] for i in active], [anchors[i] for i in active], gamma, temperature, gen
        )
        verify = [
            torch.cat([torch.tensor([anchors[i]], device=dev), blk.tokens[j].to(dev)])
            for j, i in enumerate(active)
        ]
        lens0 = [caches[i].length for i in active]
        vout = target.forward(verify, [caches[i] for i in active], layers)
        surv = blk.survival.cpu()
        zraw = blk.conf_logits.float().cpu()
        still = []
        for j, i in enumerate(active):
            c, bonus = _accept(
                vout.logits[j], blk.tokens[j].to(dev), blk.probs[j].to(dev), temperature, gen
            )
            stats.correct.append(c)
            stats.survival.append(surv[j].tolist())
            stats.conf_logits.append(zraw[j].tolist())
            new = [int(t) for t in blk.tokens[j, :c].tolist()] + [bonus]
            room = max_new_tokens - len(outputs[i])
            cut = new[:room]
            for k, t in enumerate(cut):
                if t in eos:
                    cut = cut[: k + 1]
                    break
            outputs[i].extend(cut)
            stats.committed.append(len(cut))
            caches[i].truncate(lens0[j] + c + 1)
            drafter.extend(dcaches[i], vout.hidden[j][: c + 1])
            anchors[i] = bonus
            if len(cut) == len(new) and bonus not in eos and len(outputs[i]) < max_new_tokens:
                still.append(i)
        active = still
    stats.outputs = outputs
    return stats


def evaluate(
    target: Any,
    drafter: Drafter,
    prompts: Mapping[str, Sequence[Sequence[int]]],
    gamma: int = 5,
    temperatures: Sequence[float] = (0.0, 1.0),
    max_new_tokens: int = 256,
    eos_ids: Sequence[int] = (),
    batch_size: int = 64,
    seed: int = 0,
    log: Callable[[str], None] = print,
    records: bool = False,
) -> dict[str, Any]:
    """Run :func:`speculative_run` per workload and temperature; a JSON-ready summary
    (``records``: also every step's correct drafts and raw confidence logits)."""
    res: dict[str, Any] = {
        "gamma": gamma,
        "max_new_tokens": max_new_tokens,
        "prompts": {w: len(p) for w, p in prompts.items()},
        "results": {},
    }
    for temp in temperatures:
        for w, plist in prompts.items():
            t0 = time.time()
            stats = SpecStats(gamma)
            for s in range(0, len(plist), batch_size):
                part = speculative_run(
                    target,
                    drafter,
                    plist[s : s + batch_size],
                    gamma,
                    temp,
                    max_new_tokens,
                    eos_ids,
                    seed + s,
                )
                stats.extend(part)
            summ = stats.summary()
            summ["seconds"] = time.time() - t0
            res["results"][f"{w}@T{temp:g}"] = summ
            if records:
                res.setdefault("records", {})[f"{w}@T{temp:g}"] = {
                    "correct": stats.correct,
                    "conf_logits": [[round(z, 4) for z in row] for row in stats.conf_logits],
                }
            log(
                f"[eval] {w} T={temp:g}: accept length {summ['mean_accept_length']:.3f} "
                f"over {summ['steps']} steps; cond {_fmt(summ['cond_accept'])} "
                f"ece {_fmt(summ['ece'])} auroc1 {summ['auroc_1']:.3f} ({summ['seconds']:.1f}s)"
            )
    return res


def merge_results(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One summary from evaluations run separately (e.g. one process per workload and T)."""
    if not parts:
        raise ValueError("nothing to merge")
    out: dict[str, Any] = {
        "gamma": parts[0]["gamma"],
        "max_new_tokens": parts[0]["max_new_tokens"],
        "prompts": {},
        "results": {},
    }
    for p in parts:
        if p["gamma"] != out["gamma"]:
            raise ValueError(f"cannot merge gamma {p['gamma']} with gamma {out['gamma']}")
        out["prompts"].update(p["prompts"])
        out["results"].update(p["results"])
        if "records" in p:
            out.setdefault("records", {}).update(p["records"])
        if "command" in p:
            out.setdefault("commands", []).append(p["command"])
    return out


def _regime_records(res: Mapping[str, Any], temp: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{workload: (correct [n], raw conf logits [n, gamma])} of one temperature label."""
    recs = res.get("records")
    if not recs:
        raise ValueError("evaluation has no per-step records (run it with records=True)")
    out = {}
    for key, r in recs.items():
        w, t = key.split("@T")
        if t == temp:
            z = np.asarray(r["conf_logits"], dtype=np.float64).reshape(len(r["correct"]), -1)
            out[w] = (np.asarray(r["correct"], dtype=np.int64), z)
    return out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def position_eces(
    correct: np.ndarray, conf_logits: np.ndarray, temperatures: Sequence[float] | None = None
) -> list[float]:
    """Parity ECE per position of the survival, raw or with STS temperatures applied."""
    g = conf_logits.shape[1]
    t = np.ones(g) if temperatures is None else np.asarray(temperatures[:g], dtype=np.float64)
    surv = np.cumprod(_sigmoid(conf_logits / t), 1)
    return [ece(surv[:, j], (correct >= j + 1).astype(np.float64)) for j in range(g)]


def calibration_report(
    fit: Mapping[str, Any], ev: Mapping[str, Any], gamma_max: int | None = None
) -> dict[str, Any]:
    """Per sampling regime: STS fitted on ``fit`` (held-out TRAIN prompts, all workloads
    pooled, SGLang's fitter), scored on ``ev`` (EVAL prompts): ECE per position raw and after
    STS, per workload and pooled, and AUROC at position 1 (STS leaves it unchanged).

    ``sts`` holds SGLang's JSON for each regime, padded to ``gamma_max`` temperatures with the
    last fitted one so a deployment at a longer block than the fit still loads it.
    """
    from dspark_obs.analytics.sts import fit_sts

    temps = sorted({k.split("@T")[1] for k in fit.get("records", {})}, key=float)
    out: dict[str, Any] = {}
    for t in temps:
        fit_rows = _regime_records(fit, t)
        c = np.concatenate([v[0] for v in fit_rows.values()])
        z = np.concatenate([v[1] for v in fit_rows.values()])
        prefix = (np.arange(z.shape[1])[None, :] < c[:, None]).astype(np.float64)
        cal = fit_sts(z, prefix, dataset=f"heldout-train T={t} " + "+".join(fit_rows))
        sts = cal.to_dict()
        pad = max((gamma_max or 0) - len(sts["temperatures"]), 0)
        sts["temperatures"] = sts["temperatures"] + [sts["temperatures"][-1]] * pad
        scored: dict[str, Any] = {}
        ev_rows = _regime_records(ev, t)
        if ev_rows:
            pooled = (
                np.concatenate([v[0] for v in ev_rows.values()]),
                np.concatenate([v[1] for v in ev_rows.values()]),
            )
            for name, (ce, ze) in {**ev_rows, "pooled": pooled}.items():
                scored[name] = {
                    "steps": int(ce.size),
                    "ece_raw": position_eces(ce, ze),
                    "ece_sts": position_eces(ce, ze, sts["temperatures"]),
                    "auroc_1": auroc(ze[:, 0], ce >= 1),
                }
        out[f"T{t}"] = {"sts": sts, "fit_steps": int(c.size), "eval": scored}
    return out


def _fmt(xs: Sequence[float]) -> str:
    return "[" + " ".join(f"{x:.3f}" for x in xs) + "]"


def markdown_table(res: Mapping[str, Any]) -> str:
    """The model card's table: one row per workload and temperature."""
    g = int(res["gamma"])
    head = (
        f"| workload | T | prompts | steps | mean accept len | cond. accept j=1..{g} "
        f"| ECE j=1..{g} | AUROC j=1 |\n|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for key, s in res["results"].items():
        w, t = key.split("@T")
        cond = " / ".join(f"{x:.3f}" for x in s["cond_accept"])
        ece = " / ".join(f"{x:.3f}" for x in s["ece"])
        roc = s.get("auroc_1", float("nan"))
        rows.append(
            f"| {w} | {t} | {res['prompts'].get(w, '')} | {s['steps']} | "
            f"{s['mean_accept_length']:.3f} | {cond} | {ece} | {roc:.3f} |"
        )
    return head + "\n".join(rows) + "\n"


def eval_prompt_ids(
    tokenizer: Any, workloads: Sequence[str], n: int, seed: int, max_prompt_tokens: int
) -> dict[str, list[list[int]]]:
    """Chat-templated EVAL-split prompts per workload (over-long prompts skipped)."""
    from dspark_obs.engine.weights import encode_chat
    from dspark_obs.workloads import available, load_prompts

    out: dict[str, list[list[int]]] = {}
    for w in workloads:
        ids = [
            encode_chat(tokenizer, p.messages)
            for p in load_prompts(w, "eval", available(w, "eval"), seed)
        ]
        out[w] = [x for x in ids if len(x) <= max_prompt_tokens][:n]
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """CLI: evaluate a saved drafter against SmolLM2 on EVAL-split prompts."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="runtime/drafter")
    ap.add_argument("--gguf", default=None, help=".gguf or wheel (default: fetch_model())")
    ap.add_argument("--workloads", default="math,chat,poetry")
    ap.add_argument("--n", type=int, default=8, help="eval prompts per workload")
    ap.add_argument("--prompts-file", default=None, help="JSON {workload: [[ids]]} instead")
    ap.add_argument("--prompts-key", default="prompts", help="which prompt set of that file")
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON summary here")
    ap.add_argument(
        "--records", action="store_true", help="keep per-step records (for STS fitting)"
    )
    a = ap.parse_args(argv)
    from dspark_obs.engine.weights import load_smollm2, load_target_from_gguf, stop_token_ids

    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    workloads = [w for w in a.workloads.split(",") if w]
    if a.prompts_file:
        blob = json.loads(Path(a.prompts_file).read_text())
        prompts = {w: blob[a.prompts_key][w][: a.n] for w in workloads}
        eos = blob["eos_ids"]
        assert a.gguf, "--prompts-file needs --gguf (no tokenizer is loaded)"
        target = load_target_from_gguf(a.gguf, device=a.device, dtype=dtype)
    else:
        target, tok = load_smollm2(device=a.device, dtype=dtype, path=a.gguf)
        prompts = eval_prompt_ids(tok, workloads, a.n, a.seed, a.max_prompt_tokens)
        eos = list(stop_token_ids(tok))
    drafter = Drafter.load(a.drafter, target, device=a.device)
    temps = [float(t) for t in a.temperatures.split(",") if t]
    res = evaluate(
        target,
        drafter,
        prompts,
        a.gamma,
        temps,
        a.max_new_tokens,
        eos,
        a.batch_size,
        a.seed,
        records=a.records,
    )
    res["command"] = "python -m dspark_obs.engine.drafter_eval " + " ".join(
        argv if argv is not None else __import__("sys").argv[1:]
    )
    print(markdown_table(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
