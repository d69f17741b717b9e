"""Training the DSpark drafter against its target (the project's own recipe).

Each training step runs the frozen target teacher-forced over a batch of target-generated
sequences (:mod:`~dspark_obs.engine.train_data`; hidden states at the drafter's layers and
the target's distribution p at every position, :mod:`~dspark_obs.engine.train_runner`), then
the drafter over many blocks per sequence at random anchors (an attention mask keeps every
block to context <= its anchor), scored by the DSpark objective
(:mod:`~dspark_obs.engine.train_loss`). This module is the loop: schedule, checkpoints,
resume, export.

``init_from`` starts from a saved drafter (e.g. the shipped one) with a fresh optimizer (the
warm-up restarts); a greedy head it lacks starts as a copy of its sampling head.
``on_snapshot(step, drafter)`` is called every ``snapshot_every`` steps (and at step 0) for
held-out monitoring while training runs.

Checkpoints go to ``out_dir/checkpoint.pt`` as training runs; ``resume=True`` continues from
there with the same data (``out_dir/data.pt``) and the same batch/anchor order (both are a
function of ``seed`` and the step number).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark_obs.engine.drafter import CONFIG_FILE, WEIGHTS_FILE, Drafter
from dspark_obs.engine.drafter_config import DrafterConfig
from dspark_obs.engine.train_data import (
    TrainData,
    atomic_save,
    batch_indices,
    build_train_data,
    sample_anchors,
    workload_prompts,
)
from dspark_obs.engine.train_loss import LossParts, drafter_loss
from dspark_obs.engine.train_runner import PaddedRunner

WORKLOAD_NAMES = ("math", "chat", "poetry")
DATA_FILE = "data.pt"
CKPT_FILE = "checkpoint.pt"
EXPORT_DIR = "drafter"


@dataclass
class TrainResult:
    """What a training run produced."""

    drafter: Drafter
    out_dir: Path
    export_dir: Path
    step: int
    history: list[dict[str, Any]]


def _lr_at(step: int, steps: int, lr: float, warmup: int, time_frac: float = 0.0) -> float:
    """Linear warmup, then cosine to 10% over whichever runs out first: steps or time."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = max((step - warmup) / max(steps - warmup, 1), time_frac)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train_step_loss(
    drafter: Drafter,
    runner: PaddedRunner,
    data: TrainData,
    idx: Sequence[int],
    gamma: int,
    blocks_per_seq: int,
    gamma_decay: float,
    gen: torch.Generator,
    device: torch.device,
    loss_weights: Mapping[str, float] | None = None,
    regime_heads: bool = False,
) -> LossParts:
    """One batch: teacher-forced target pass, many-block drafter pass, DSpark loss.

    ``loss_weights`` overrides the objective's term weights (``ce``, ``tv``, ``kl``,
    ``conf``); ``regime_heads`` trains each confidence head on its own regime's rows only.
    """
    seqs = [data.seqs[i] for i in idx]
    plens = [data.prompt_lens[i] for i in idx]
    lens = [len(s) for s in seqs]
    anchors = sample_anchors(plens, lens, blocks_per_seq, gen).to(device)
    b, t_max = len(seqs), max(lens)
    tokens = torch.zeros(b, t_max, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    tokens = tokens.to(device)
    hidden, last = runner.features(tokens, drafter.hidden_layers)
    _, logits, z = drafter.forward_train(hidden, tokens, anchors, gamma)
    offs = torch.arange(gamma, device=device)
    ppos = anchors.unsqueeze(-1) + offs  # target logits at a+k predict token a+k+1
    lens_t = torch.tensor(lens, device=device)
    valid = (ppos + 1) < lens_t[:, None, None]
    ppos_c = ppos.clamp(max=t_max - 2)
    nxt = tokens.gather(1, (ppos_c + 1).reshape(b, -1)).view_as(ppos)
    rows = last.gather(1, ppos_c.reshape(b, -1, 1).expand(-1, -1, last.shape[-1]))
    with torch.no_grad():
        tl = drafter.target.lm_head(rows).float().view(*ppos.shape, -1)  # type: ignore[operator]
    regime = None
    if regime_heads:
        regime = torch.tensor([data.modes[i] == "greedy" for i in idx], device=device)
    weights = {f"w_{k}": float(v) for k, v in (loss_weights or {}).items()}
    return drafter_loss(logits, z, tl, nxt, valid, gamma_decay, regime=regime, **weights)


LOSS_TERMS = ("ce", "tv", "kl", "conf")


def parse_loss_weights(text: str | None) -> dict[str, float]:
    """``"ce=0.1,tv=0.5,kl=0.5"`` -> weights of the objective's terms (others keep defaults)."""
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in LOSS_TERMS:
            raise ValueError(f"loss weight {part!r}: expected NAME=VALUE with NAME in {LOSS_TERMS}")
        try:
            out[name] = float(value)
        except ValueError as exc:
            raise ValueError(f"loss weight {part!r}: {value!r} is not a number") from exc
    return out


@torch.no_grad()
def heldout_monitor(
    drafter: Drafter,
    runner: PaddedRunner,
    data: TrainData,
    gamma: int,
    blocks_per_seq: int,
    gamma_decay: float,
    device: torch.device,
    batch_size: int,
    seed: int,
) -> dict[str, dict[str, Any]]:
    """Teacher-forced accept estimates per workload and mode on held-out sequences (the
    same anchors every call, so snapshots compare): greedy accept ``1 + sum_k P(argmax
    matches at 1..k)`` and the mean analytic acceptance ``1 - TV`` per position."""
    out: dict[str, dict[str, Any]] = {}
    groups: dict[str, list[int]] = {}
    for i, (w, m) in enumerate(zip(data.workloads, data.modes, strict=True)):
        groups.setdefault(f"{w}/{m}", []).append(i)
    for key, rows in sorted(groups.items()):
        rows = rows[:batch_size]
        gen = torch.Generator().manual_seed(seed)
        parts = train_step_loss(
            drafter, runner, data, rows, gamma, blocks_per_seq, gamma_decay, gen, device
        )
        out[key] = {
            "est_greedy": 1.0 + sum(parts.prefix_match),
            "accept_1mtv": parts.accept_1mtv,
            "conf_mean": parts.conf_mean,
            "sequences": len(rows),
        }
    return out


def train_drafter(
    target: nn.Module,
    tokenizer: Any | None = None,
    *,
    out_dir: str | Path,
    workloads: Sequence[str] = WORKLOAD_NAMES,
    prompts_per_workload: int | Mapping[str, int] = 1000,
    prompts: Sequence[tuple[str, Sequence[int]]] | None = None,
    gamma: int = 5,
    steps: int = 2000,
    batch_size: int = 32,
    lr: float = 5e-4,
    resume: bool = False,
    device: str | torch.device = "cpu",
    seed: int = 0,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 384,
    modes: Sequence[str] = ("greedy", "sample"),
    blocks_per_seq: int = 16,
    gamma_decay: float = 4.0,
    drafter_config: DrafterConfig | Mapping[str, Any] | None = None,
    gen_batch_size: int = 64,
    warmup: int = 100,
    weight_decay: float = 0.0,
    ckpt_every: int = 200,
    log_every: int = 20,
    time_budget_s: float | None = None,
    stop_after: int | None = None,
    runner: Any | None = None,
    eos_ids: Sequence[int] | None = None,
    init_from: str | Path | None = None,
    on_snapshot: Callable[[int, Drafter], None] | None = None,
    snapshot_every: int = 0,
    loss_weights: Mapping[str, float] | None = None,
    regime_heads: bool = False,
    one_mode_per_prompt: bool = False,
    data: TrainData | None = None,
    monitor: TrainData | None = None,
    monitor_every: int = 0,
    log: Callable[[str], None] = print,
) -> TrainResult:
    """Generate target data (or reuse ``out_dir/data.pt``), train, checkpoint, export.

    ``prompts`` (pairs of workload name and token ids) bypasses the workload loaders (tests,
    custom data). ``time_budget_s`` stops early (checkpointed) when the wall clock runs out
    and also paces the LR schedule; ``stop_after`` ends this invocation after that many steps
    (checkpointed; ``resume=True`` continues on the same schedule), for time-sliced machines.
    The trained drafter is exported with :meth:`Drafter.save` to ``out_dir/drafter``.

    ``data`` trains on ready sequences (several recipes sharing one generated set);
    ``one_mode_per_prompt`` answers each prompt once, the modes in turn (more distinct
    prompts for the same generation time). ``monitor`` (held-out sequences) is scored
    teacher-forced every ``monitor_every`` steps and at the end (``heldout`` in the history).
    """
    dev = torch.device(device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    t_start = time.time()
    run = runner if runner is not None else PaddedRunner(target, dev)
    if eos_ids is not None:
        eos = list(eos_ids)
    elif tokenizer is not None:
        from dspark_obs.engine.weights import stop_token_ids

        eos = list(stop_token_ids(tokenizer))
    else:
        eos = []

    data_path = out / DATA_FILE
    if data is not None:
        log(f"[data] {len(data.seqs)} given sequences")
    elif data_path.exists() and (resume or prompts is None):
        data = TrainData.load(data_path)
        log(f"[data] reusing {data_path} ({len(data.seqs)} sequences)")
    else:
        if prompts is None:
            if tokenizer is None:
                raise ValueError("need a tokenizer (or prompts=) to build training data")
            prompts = workload_prompts(
                tokenizer, workloads, prompts_per_workload, "train", seed, max_prompt_tokens
            )
        log(f"[data] generating responses for {len(prompts)} prompts, modes={list(modes)}")
        data = build_train_data(
            run, prompts, max_new_tokens, modes, eos, seed, gen_batch_size, log,
            one_mode_per_prompt=one_mode_per_prompt,
        )
        data.save(data_path)
    if not data.seqs:
        raise ValueError("no training sequences (all responses shorter than 2 tokens)")

    if isinstance(drafter_config, DrafterConfig):
        cfg = drafter_config
    elif init_from is not None:
        cfg = _init_config(init_from, drafter_config)
    else:
        cfg = DrafterConfig.for_target(target, gamma_max=gamma, **dict(drafter_config or {}))
    if gamma > cfg.gamma_max:
        raise ValueError(f"gamma={gamma} > drafter gamma_max={cfg.gamma_max}")
    drafter = Drafter(cfg, target).to(dev)
    if init_from is not None and not (resume and (out / CKPT_FILE).exists()):
        _init_weights(drafter, init_from)
        log(f"[train] initialized from {init_from} (fresh optimizer, warm-up {warmup} steps)")
    for prm in target.parameters():
        prm.requires_grad_(False)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    history: list[dict[str, Any]] = []
    start_step = 0
    ckpt_path = out / CKPT_FILE
    if resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location=dev, weights_only=False)
        drafter.load_state_dict(ck["drafter"])
        opt.load_state_dict(ck["optim"])
        start_step = int(ck["step"])
        history = list(ck.get("history", []))
        log(f"[train] resumed from {ckpt_path} at step {start_step}")

    def save_ckpt(step: int) -> None:
        atomic_save(
            {
                "drafter": drafter.state_dict(),
                "optim": opt.state_dict(),
                "step": step,
                "config": cfg.to_json(),
                "history": history,
            },
            ckpt_path,
        )

    amp: AbstractContextManager[Any] = (
        torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext()
    )
    drafter.train()
    step = start_step
    t0 = time.time()
    train_budget = None if time_budget_s is None else max(time_budget_s - (t0 - t_start), 1.0)
    win: list[LossParts] = []
    stopped_early = False

    def watch(at: int) -> None:
        assert monitor is not None
        drafter.eval()
        with amp:
            held = heldout_monitor(
                drafter, run, monitor, gamma, blocks_per_seq, gamma_decay, dev, batch_size, seed
            )
        drafter.train()
        history.append({"step": at, "heldout": held})
        log(f"[heldout] step {at} " + " ".join(
            f"{k} {v['est_greedy']:.2f}/{sum(v['accept_1mtv']):.2f}" for k, v in held.items()
        ))

    if monitor is not None and step == 0:
        watch(0)
    if on_snapshot is not None and step == 0:
        drafter.eval()
        on_snapshot(0, drafter)
        drafter.train()
    while step < steps:
        if stop_after is not None and step - start_step >= stop_after:
            stopped_early = True
            break
        if time_budget_s is not None and time.time() - t_start > time_budget_s:
            stopped_early = True
            log(f"[train] time budget {time_budget_s:.0f}s reached at step {step}")
            break
        tfrac = 0.0 if train_budget is None else (time.time() - t0) / train_budget
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, steps, lr, warmup, tfrac)
        idx = batch_indices(len(data.seqs), batch_size, step, seed)
        gen = torch.Generator().manual_seed(seed * 7919 + step)
        with amp:
            parts = train_step_loss(
                drafter, run, data, idx, gamma, blocks_per_seq, gamma_decay, gen, dev,
                loss_weights, regime_heads,
            )
        opt.zero_grad(set_to_none=True)
        parts.loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        step += 1
        win.append(parts)
        if step % log_every == 0 or step == steps:
            rec = _summary(
                win, step, step - start_step, gnorm, opt.param_groups[0]["lr"], time.time() - t0
            )
            history.append(rec)
            win = []
            log(
                f"[train] step {step}/{steps} loss {rec['loss']:.4f} ce {rec['ce']:.3f} "
                f"tv {rec['tv']:.3f} bce {rec['bce']:.3f} greedy-acc-len~{rec['est_greedy']:.2f} "
                f"match {_fmt(rec['greedy_match'])} 1-tv {_fmt(rec['accept_1mtv'])} "
                f"conf {_fmt(rec['conf_mean'])} gconf {_fmt(rec['conf_greedy_mean'])} "
                f"lr {rec['lr']:.2e} {rec['steps_per_s']:.2f} it/s"
            )
        if monitor is not None and monitor_every and step % monitor_every == 0:
            watch(step)
        if step % ckpt_every == 0:
            save_ckpt(step)
        if on_snapshot is not None and snapshot_every and step % snapshot_every == 0:
            drafter.eval()
            on_snapshot(step, drafter)
            drafter.train()
    if monitor is not None and not (monitor_every and step % monitor_every == 0):
        watch(step)
    save_ckpt(step)
    drafter.eval()
    meta = {
        "steps": step,
        "gamma": gamma,
        "batch_size": batch_size,
        "lr": lr,
        "blocks_per_seq": blocks_per_seq,
        "gamma_decay": gamma_decay,
        "sequences": len(data.seqs),
        "data": data.info,
        "seed": seed,
        "init_from": str(init_from) if init_from is not None else None,
        "warmup": warmup,
        "stopped_early": stopped_early,
        "loss_weights": dict(loss_weights or {}),
        "regime_heads": regime_heads,
        "last": history[-1] if history else None,
    }
    export = drafter.save(out / EXPORT_DIR, meta=meta)
    (out / "train_history.json").write_text(json.dumps(history, indent=1))
    return TrainResult(drafter, out, export, step, history)


def _init_config(
    init_from: str | Path, overrides: DrafterConfig | Mapping[str, Any] | None
) -> DrafterConfig:
    """The saved drafter's config with ``overrides`` applied (e.g. a greedy head)."""
    conf = json.loads((Path(init_from) / CONFIG_FILE).read_text())
    d = dict(conf["drafter"])
    d.update(dict(overrides or {}))
    return DrafterConfig.from_json(d)


def _init_weights(drafter: Drafter, init_from: str | Path) -> None:
    """Load a saved drafter's weights; a greedy head it lacks copies its sampling head, and
    layers past its depth start as the identity (their output projections zero, so the
    deeper drafter begins exactly where the saved one is)."""
    from safetensors.torch import load_file

    sd = {k: v.float() for k, v in load_file(str(Path(init_from) / WEIGHTS_FILE)).items()}
    own = drafter.state_dict()
    if "conf_head_greedy.weight" in own and "conf_head_greedy.weight" not in sd:
        sd["conf_head_greedy.weight"] = sd["conf_head.weight"].clone()
        sd["conf_head_greedy.bias"] = sd["conf_head.bias"].clone()
    for k, v in own.items():
        if k.startswith("layers.") and k not in sd:
            fresh = v.detach().clone()
            if k.endswith(("o_proj.weight", "down.weight")):
                fresh.zero_()
            sd[k] = fresh
    bad = [k for k, v in sd.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    missing = sorted(set(own) - set(sd))
    if bad or missing:
        raise ValueError(f"{init_from}: cannot initialize from it: shapes {bad} missing {missing}")
    drafter.load_state_dict({k: v for k, v in sd.items() if k in own})


def _fmt(xs: Sequence[float]) -> str:
    return "[" + " ".join(f"{x:.2f}" for x in xs) + "]"


def _summary(
    win: Sequence[LossParts], step: int, done: int, gnorm: float, lr: float, elapsed: float
) -> dict[str, Any]:
    n = len(win)

    def avg_list(name: str) -> list[float]:
        rows = [getattr(p, name) for p in win]
        return [sum(r[k] for r in rows) / n for k in range(len(rows[0]))]

    match = avg_list("greedy_match")
    # teacher-forced estimate of the greedy accept length (1 + E[leading argmax matches])
    est = 1.0 + sum(avg_list("prefix_match"))
    return {
        "step": step,
        "loss": sum(float(p.loss.detach()) for p in win) / n,
        "ce": sum(p.ce for p in win) / n,
        "tv": sum(p.tv for p in win) / n,
        "bce": sum(p.bce for p in win) / n,
        "bce_greedy": sum(p.bce_greedy for p in win) / n,
        "greedy_match": match,
        "accept_1mtv": avg_list("accept_1mtv"),
        "conf_mean": avg_list("conf_mean"),
        "conf_greedy_mean": avg_list("conf_greedy_mean") if win[0].conf_greedy_mean else [],
        "est_greedy": est,
        "grad_norm": gnorm,
        "lr": lr,
        "elapsed_s": elapsed,
        "steps_per_s": done / max(elapsed, 1e-9),
    }
