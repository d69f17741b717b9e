"""Training the DSpark drafter against its target (the project's own recipe).

Data: responses generated *by the target* for train-split prompts of the workloads (math,
chat, poetry), both greedy and temperature-1 samples, so the drafter learns the target's own
distribution rather than a dataset's. Each training step runs the frozen target
teacher-forced over a batch of those sequences (hidden states at the drafter's layers, and
the target's distribution p at every position), then the drafter over many blocks per
sequence at random anchors (an attention mask keeps every block to context <= its anchor).

Objective (DSpark): per block position k (1-based), weighted by exp(-(k-1)/gamma_decay),
``0.1 * CE(q_k, realized x_k) + 0.9 * TV(p_k, q_k) + 1.0 * BCE(c_k, 1 - TV(p_k, q_k))`` with
the BCE target detached. TV drives q towards p (what rejection sampling rewards); the small
CE term keeps the mode sharp for greedy; the confidence head learns the analytic acceptance.
A drafter with a greedy confidence head adds ``1.0 * BCE(c^greedy_k, 1[argmax q_k ==
argmax p_k])``: the event greedy verification accepts.

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
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark_obs.engine.drafter import Drafter, DrafterConfig
from dspark_obs.engine.model import ModelConfig

WORKLOAD_NAMES = ("math", "chat", "poetry")
DATA_FILE = "data.pt"
CKPT_FILE = "checkpoint.pt"
EXPORT_DIR = "drafter"


# --------------------------------------------------------------------------- loss pieces
def position_weights(gamma: int, gamma_decay: float, device: Any = None) -> Tensor:
    """w_k = exp(-(k-1)/gamma_decay), k = 1..gamma: early drafts matter most (they gate
    every later one)."""
    k = torch.arange(gamma, dtype=torch.float32, device=device)
    return torch.exp(-k / gamma_decay)


def tv_distance(p: Tensor, q: Tensor) -> Tensor:
    """Total-variation distance 0.5 * sum |p - q| over the last dim."""
    return 0.5 * (p - q).abs().sum(-1)


@dataclass
class LossParts:
    """Loss and the per-position diagnostics logged while training."""

    loss: Tensor
    ce: float
    tv: float
    bce: float
    accept_1mtv: list[float]  # mean analytic acceptance 1 - TV per position
    greedy_match: list[float]  # mean 1[argmax q == argmax p] per position
    prefix_match: list[float]  # mean 1[argmax q == argmax p at positions 1..k]
    conf_mean: list[float]
    bce_greedy: float = 0.0  # greedy-head BCE (0 without a greedy head)
    conf_greedy_mean: list[float] = field(default_factory=list)


def drafter_loss(
    logits: Tensor,
    conf_logits: Tensor,
    target_logits: Tensor,
    next_tokens: Tensor,
    valid: Tensor,
    gamma_decay: float,
    w_ce: float = 0.1,
    w_tv: float = 0.9,
    w_conf: float = 1.0,
) -> LossParts:
    """DSpark objective over rows [..., gamma] (logits [..., gamma, V]).

    target_logits are the target's logits for the same predicted positions; next_tokens the
    realized tokens; valid masks positions past the end of a sequence. conf_logits are
    [..., gamma] (sampling head) or [..., gamma, 2] (sampling head, greedy head).
    """
    gamma = logits.shape[-2]
    lq = torch.log_softmax(logits.float(), -1)
    q = lq.exp()
    p = torch.softmax(target_logits.float(), -1)
    tv = tv_distance(p, q)  # [..., gamma]
    ce = -lq.gather(-1, next_tokens.unsqueeze(-1)).squeeze(-1)
    match = (logits.argmax(-1) == target_logits.argmax(-1)).float()
    z = conf_logits.float()
    z_greedy = None
    if z.dim() == logits.dim():
        z, z_greedy = z[..., 0], z[..., 1]
    acc = (1.0 - tv).detach().clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(z, acc, reduction="none")
    w = position_weights(gamma, gamma_decay, logits.device) * valid.float()
    denom = w.sum().clamp_min(1e-9)
    per = w_ce * ce + w_tv * tv + w_conf * bce
    bce_g = None
    if z_greedy is not None:
        bce_g = F.binary_cross_entropy_with_logits(z_greedy, match, reduction="none")
        per = per + w_conf * bce_g
    loss = (per * w).sum() / denom
    with torch.no_grad():
        vf = valid.float().reshape(-1, gamma)
        n = vf.sum(0).clamp_min(1.0)

        def pos_mean(x: Tensor) -> list[float]:
            return ((x.reshape(-1, gamma).float() * vf).sum(0) / n).tolist()

        parts = LossParts(
            loss=loss,
            ce=float((ce * w).sum() / denom),
            tv=float((tv * w).sum() / denom),
            bce=float((bce * w).sum() / denom),
            accept_1mtv=pos_mean(1.0 - tv),
            greedy_match=pos_mean(match),
            prefix_match=pos_mean(match.reshape(-1, gamma).cumprod(-1)),
            conf_mean=pos_mean(torch.sigmoid(z)),
        )
        if z_greedy is not None and bce_g is not None:
            parts.bce_greedy = float((bce_g * w).sum() / denom)
            parts.conf_greedy_mean = pos_mean(torch.sigmoid(z_greedy))
    return parts


# --------------------------------------------------------------------------- target access
class PaddedRunner:
    """Padded, batched passes over the target's own modules (generation, teacher forcing).

    The engine's ``Target.forward`` is ragged with per-request attention, right for serving
    but slow for data generation over hundreds of rows; here every row shares one padded
    tensor, one SDPA call per layer and a preallocated KV buffer. Same weights, same maths
    (tests check it against ``Target.forward``).
    """

    def __init__(self, target: nn.Module, device: torch.device | str):
        tgt: Any = target
        self.target = tgt
        self.device = torch.device(device)
        self.cfg: ModelConfig = tgt.cfg

    def _qkv(self, blk: Any, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, H, T, hd], k/v [B, kvh, T, hd]; cos/sin [B*T, hd/2] for the rows' positions."""
        from dspark_obs.engine.model import apply_rope

        cfg = self.cfg
        b, t, _ = x.shape
        hd = cfg.head_dim
        q, k, v = blk.attn.wqkv(blk.attn_norm(x)).split(
            (cfg.hidden_size, cfg.kv_dim, cfg.kv_dim), dim=-1
        )
        q = apply_rope(q.reshape(b * t, cfg.num_heads, hd), cos, sin)
        k = apply_rope(k.reshape(b * t, cfg.num_kv_heads, hd), cos, sin)
        q = q.view(b, t, cfg.num_heads, hd).transpose(1, 2)
        k = k.view(b, t, cfg.num_kv_heads, hd).transpose(1, 2)
        v = v.reshape(b, t, cfg.num_kv_heads, hd).transpose(1, 2)
        return q, k, v

    def _rope_table(self, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        from dspark_obs.engine.model import rope_cos_sin

        pos = torch.arange(n, device=self.device)
        return rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def _finish(self, blk: Any, x: Tensor, o: Tensor) -> Tensor:
        b, t = x.shape[:2]
        x = x + blk.attn.wo(o.transpose(1, 2).reshape(b, t, -1))
        return x + blk.mlp(blk.mlp_norm(x))

    def _rep(self, kv: Tensor) -> Tensor:
        """Expand kv heads to query heads (head h uses kv head h // group), so SDPA can pick
        its fused kernels whatever its grouped-query support."""
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        return kv if group == 1 else kv.repeat_interleave(group, 1)

    @torch.no_grad()
    def features(self, tokens: Tensor, layers: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Teacher-forced pass over right-padded tokens [B, T]: hidden states of ``layers``
        concatenated [B, T, L*d] and the final-normed last layer [B, T, d]."""
        tgt = self.target
        b, t = tokens.shape
        x = tgt.embed(tokens)
        cos, sin = self._rope_table(t, x.dtype)
        cos, sin = cos.repeat(b, 1), sin.repeat(b, 1)
        captured: dict[int, Tensor] = {}
        for i, blk in enumerate(tgt.layers):
            q, k, v = self._qkv(blk, x, cos, sin)
            o = F.scaled_dot_product_attention(q, self._rep(k), self._rep(v), is_causal=True)
            x = self._finish(blk, x, o)
            if i in layers:
                captured[i] = x
        hidden = torch.cat([captured[i] for i in layers], -1)
        return hidden, tgt.norm(x)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator,
        eos_ids: Sequence[int],
    ) -> list[list[int]]:
        """Continue every prompt (greedy if temperature <= 0, else sampled) to EOS/limit.

        Left-padded prompts, one KV buffer for the batch; each row's positions start at 0.
        The returned responses include the EOS token when one was produced.
        """
        tgt, cfg, dev = self.target, self.cfg, self.device
        b = len(prompts)
        plen = max(len(p) for p in prompts)
        total = plen + max_new_tokens
        pads = torch.tensor([plen - len(p) for p in prompts], device=dev)
        toks = torch.zeros(b, plen, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            toks[i, plen - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        cols = torch.arange(total, device=dev)
        key_ok = cols[None, :] >= pads[:, None]  # [B, total]
        shape = (b, cfg.num_kv_heads, total, cfg.head_dim)
        kbuf = [torch.zeros(shape, device=dev, dtype=tgt.dtype) for _ in tgt.layers]
        vbuf = [torch.zeros(shape, device=dev, dtype=tgt.dtype) for _ in tgt.layers]
        cos_t, sin_t = self._rope_table(total, tgt.dtype)
        # prefill (pad queries also see themselves so no softmax row is empty)
        pos = (cols[None, :plen] - pads[:, None]).clamp_min(0).reshape(-1)
        causal = cols[None, :plen, None] >= cols[None, None, :plen]
        eye = torch.eye(plen, dtype=torch.bool, device=dev)[None]
        mask = ((causal & key_ok[:, None, :plen]) | eye)[:, None]
        x = tgt.embed(toks)
        for li, blk in enumerate(tgt.layers):
            q, k, v = self._qkv(blk, x, cos_t[pos], sin_t[pos])
            kbuf[li][:, :, :plen] = k
            vbuf[li][:, :, :plen] = v
            o = F.scaled_dot_product_attention(q, self._rep(k), self._rep(v), attn_mask=mask)
            x = self._finish(blk, x, o)
        logits = tgt.lm_head(tgt.norm(x[:, -1])).float()
        out = torch.zeros(b, max_new_tokens, dtype=torch.long, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        n_out = torch.full((b,), max_new_tokens, dtype=torch.long, device=dev)
        eos = torch.tensor(sorted(set(int(e) for e in eos_ids)) or [-1], device=dev)
        group = cfg.num_heads // cfg.num_kv_heads
        scale = cfg.head_dim**-0.5
        for step in range(max_new_tokens):
            nxt = _pick(logits, temperature, generator)
            out[:, step] = nxt
            hit = torch.isin(nxt, eos) & ~done
            n_out = torch.where(hit, torch.full_like(n_out, step + 1), n_out)
            done |= hit
            if step + 1 == max_new_tokens or (step % 16 == 15 and bool(done.all())):
                break
            col = plen + step
            pos = col - pads
            neg = torch.zeros(b, 1, 1, col + 1, device=dev, dtype=torch.float32)
            neg.masked_fill_(~key_ok[:, None, None, : col + 1], float("-inf"))
            x = tgt.embed(nxt[:, None])
            cos, sin = cos_t[pos], sin_t[pos]
            for li, blk in enumerate(tgt.layers):
                q, k, v = self._qkv(blk, x, cos, sin)
                kbuf[li][:, :, col] = k[:, :, 0]
                vbuf[li][:, :, col] = v[:, :, 0]
                # one query per row: grouped-query attention as two small matmuls, no copies
                qg = q.view(b, cfg.num_kv_heads, group, cfg.head_dim)
                sc = (qg @ kbuf[li][:, :, : col + 1].transpose(-1, -2)).float() * scale + neg
                o = torch.softmax(sc, -1).to(qg.dtype) @ vbuf[li][:, :, : col + 1]
                x = self._finish(blk, x, o.reshape(b, cfg.num_heads, 1, cfg.head_dim))
            logits = tgt.lm_head(tgt.norm(x[:, -1])).float()
        rows = out.tolist()
        lens = n_out.tolist()
        return [r[:n] for r, n in zip(rows, lens, strict=True)]


def _pick(logits: Tensor, temperature: float, generator: torch.Generator) -> Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# --------------------------------------------------------------------------- data
@dataclass
class TrainData:
    """Target-generated training sequences (prompt + response token ids)."""

    seqs: list[list[int]]
    prompt_lens: list[int]
    workloads: list[str]
    modes: list[str]  # "greedy" | "sample"
    info: dict[str, Any] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        _atomic_save(
            {
                "seqs": self.seqs,
                "prompt_lens": self.prompt_lens,
                "workloads": self.workloads,
                "modes": self.modes,
                "info": self.info,
            },
            path,
        )

    @classmethod
    def load(cls, path: Path) -> TrainData:
        d = torch.load(path, weights_only=False)
        return cls(d["seqs"], d["prompt_lens"], d["workloads"], d["modes"], d.get("info", {}))


def workload_prompts(
    tokenizer: Any,
    workloads: Sequence[str],
    counts: int | Mapping[str, int],
    split: str,
    seed: int,
    max_prompt_tokens: int,
) -> list[tuple[str, list[int]]]:
    """(workload, prompt ids) for each workload's prompts; over-long prompts are dropped."""
    from dspark_obs.engine.weights import encode_chat
    from dspark_obs.workloads import load_prompts

    out: list[tuple[str, list[int]]] = []
    for w in workloads:
        n = counts[w] if isinstance(counts, Mapping) else counts
        for pr in load_prompts(w, split, n, seed):
            ids = encode_chat(tokenizer, pr.messages)
            if len(ids) <= max_prompt_tokens:
                out.append((w, ids))
    return out


def build_train_data(
    runner: Any,
    prompts: Sequence[tuple[str, Sequence[int]]],
    max_new_tokens: int,
    modes: Sequence[str],
    eos_ids: Sequence[int],
    seed: int,
    gen_batch_size: int,
    log: Callable[[str], None] = print,
) -> TrainData:
    """Generate the target's responses (greedy and/or temperature-1) for every prompt."""
    data = TrainData([], [], [], [])
    gen = torch.Generator(device=runner.device).manual_seed(seed)
    # length-sorted batches: similar prompt lengths waste less padding / compute
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][1]))
    t0 = time.time()
    ntok = 0
    for mode in modes:
        temp = 0.0 if mode == "greedy" else 1.0
        for s in range(0, len(order), gen_batch_size):
            idx = order[s : s + gen_batch_size]
            outs = runner.generate(
                [prompts[i][1] for i in idx], max_new_tokens, temp, gen, eos_ids
            )
            for i, resp in zip(idx, outs, strict=True):
                if len(resp) < 2:
                    continue
                w, p = prompts[i]
                data.seqs.append(list(p) + resp)
                data.prompt_lens.append(len(p))
                data.workloads.append(w)
                data.modes.append(mode)
                ntok += len(resp)
            log(
                f"[gen] {mode} {min(s + gen_batch_size, len(order))}/{len(order)} prompts, "
                f"{ntok} tokens, {ntok / max(time.time() - t0, 1e-9):.0f} tok/s"
            )
    data.info = {"max_new_tokens": max_new_tokens, "modes": list(modes), "tokens": ntok}
    return data


# --------------------------------------------------------------------------- batches
def batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Deterministic data order: epoch-wise permutations seeded by (seed, epoch)."""
    out: list[int] = []
    start = step * batch_size
    while len(out) < batch_size:
        epoch, off = divmod(start + len(out), n)
        perm = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        out.extend(perm[off : off + batch_size - len(out)])
    return out


def sample_anchors(
    prompt_lens: Sequence[int], lengths: Sequence[int], nb: int, gen: torch.Generator
) -> Tensor:
    """Stratified random anchors in [prompt_len, len - 2] (each block has >= 1 target)."""
    rows = []
    for p, t in zip(prompt_lens, lengths, strict=True):
        span = max(t - 1 - p, 1)
        u = torch.rand(nb, generator=gen)
        a = p + ((torch.arange(nb) + u) * span / nb).long().clamp(max=span - 1)
        rows.append(a)
    return torch.stack(rows)


# --------------------------------------------------------------------------- the loop
@dataclass
class TrainResult:
    """What a training run produced."""

    drafter: Drafter
    out_dir: Path
    export_dir: Path
    step: int
    history: list[dict[str, Any]]


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


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
) -> LossParts:
    """One batch: teacher-forced target pass, many-block drafter pass, DSpark loss."""
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
    return drafter_loss(logits, z, tl, nxt, valid, gamma_decay)


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
    log: Callable[[str], None] = print,
) -> TrainResult:
    """Generate target data (or reuse ``out_dir/data.pt``), train, checkpoint, export.

    ``prompts`` (pairs of workload name and token ids) bypasses the workload loaders (tests,
    custom data). ``time_budget_s`` stops early (checkpointed) when the wall clock runs out
    and also paces the LR schedule; ``stop_after`` ends this invocation after that many steps
    (checkpointed; ``resume=True`` continues on the same schedule), for time-sliced machines.
    The trained drafter is exported with :meth:`Drafter.save` to ``out_dir/drafter``.
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
    if data_path.exists() and (resume or prompts is None):
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
            run, prompts, max_new_tokens, modes, eos, seed, gen_batch_size, log
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
        _atomic_save(
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
                drafter, run, data, idx, gamma, blocks_per_seq, gamma_decay, gen, dev
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
        if step % ckpt_every == 0:
            save_ckpt(step)
        if on_snapshot is not None and snapshot_every and step % snapshot_every == 0:
            drafter.eval()
            on_snapshot(step, drafter)
            drafter.train()
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
        "last": history[-1] if history else None,
    }
    export = drafter.save(out / EXPORT_DIR, meta=meta)
    (out / "train_history.json").write_text(json.dumps(history, indent=1))
    return TrainResult(drafter, out, export, step, history)


def _init_config(
    init_from: str | Path, overrides: DrafterConfig | Mapping[str, Any] | None
) -> DrafterConfig:
    """The saved drafter's config with ``overrides`` applied (e.g. a greedy head)."""
    conf = json.loads((Path(init_from) / "config.json").read_text())
    d = dict(conf["drafter"])
    d.update(dict(overrides or {}))
    return DrafterConfig.from_json(d)


def _init_weights(drafter: Drafter, init_from: str | Path) -> None:
    """Load a saved drafter's weights; a greedy head it lacks copies its sampling head."""
    from safetensors.torch import load_file

    sd = {k: v.float() for k, v in load_file(str(Path(init_from) / "drafter.safetensors")).items()}
    own = drafter.state_dict()
    if "conf_head_greedy.weight" in own and "conf_head_greedy.weight" not in sd:
        sd["conf_head_greedy.weight"] = sd["conf_head.weight"].clone()
        sd["conf_head_greedy.bias"] = sd["conf_head.bias"].clone()
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
