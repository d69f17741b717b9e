"""A tiny, fully known DSpark world: a compact run and its cap-accept companion.

Why: the estimator and the companion pairing make claims ("under greedy the ceiling is
recovered exactly", "the bracket contains the truth") that can only be checked where the
truth is known. Here the target and the drafter are Markov tables over a small vocabulary
(next-token distribution given the previous token and the position), verification is the
real rule (greedy argmax match, or rejection sampling min(1, p/q) with residual resampling),
and the same request schedule (windows) drives both runs. Output rows use the schema's
columns; the compact rows carry the estimator fields produced by
:class:`~dspark_obs.analytics.estimator.BlockAcceptRecorder`, and the compact run is also
rendered as SGLang's estimator JSONL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dspark_obs.analytics.estimator import BlockAcceptRecorder
from dspark_obs.sglang.estimator_writer import eos_line, estimator_line

WINDOW_WEIGHTS = {
    # relative weight of verify_len = 1..gamma+1 (truncated / padded to gamma+1)
    "math": (1, 1, 2, 3, 4, 4, 3, 2),
    "chat": (2, 3, 4, 3, 2, 2, 1, 1),
    "poetry": (4, 4, 3, 2, 1, 1, 1, 1),
}
DRAFT_NOISE = {"math": 0.6, "chat": 1.2, "poetry": 1.9}


@dataclass
class SimConfig:
    n_requests: int = 24
    gamma: int = 5
    max_new_tokens: int = 40
    temperature: float = 0.0
    vocab: int = 24
    n_phases: int = 3  # the target conditions on position mod n_phases too (breaks cycles)
    eos_token: int | None = 0
    eos_bias: float = 0.0
    sharpness: float = 2.5
    workloads: tuple[str, ...] = ("math", "chat", "poetry")
    seed: int = 0
    # True: like the embedded engine, every mode consumes the same gamma + 1 uniforms per step
    # (coins, then one for the bonus) and cap-accept commits what compact commits (a capped
    # step's bonus comes from the target at the window's row), so both runs follow the same
    # tokens also under sampling and differ only in the coin flips of trimmed drafts.
    # False (default): cap-accept draws its own coins and bonuses, paths may diverge.
    shared_draws: bool = False


@dataclass
class SimResult:
    runs: pd.DataFrame
    compact_req_steps: pd.DataFrame
    cap_req_steps: pd.DataFrame
    compact_requests: pd.DataFrame
    cap_requests: pd.DataFrame
    compact_steps: pd.DataFrame
    cap_steps: pd.DataFrame
    compact_jsonl: list[str] = field(default_factory=list)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


class _World:
    """Target and drafter logits tables over (token before last, last token, position phase)."""

    def __init__(self, cfg: SimConfig, rng: np.random.Generator) -> None:
        v, ph = cfg.vocab, cfg.n_phases
        self.cfg = cfg
        self.target = rng.normal(0.0, cfg.sharpness, size=(v, v, ph, v))
        if cfg.eos_token is not None:
            self.target[..., cfg.eos_token] += cfg.eos_bias
        noise = rng.normal(0.0, 1.0, size=(len(cfg.workloads), v, v, ph, v))
        self.draft = {
            w: self.target + DRAFT_NOISE.get(w, 1.0) * noise[i] for i, w in enumerate(cfg.workloads)
        }

    def logits(self, table: np.ndarray, ctx: tuple[int, int], pos: int) -> np.ndarray:
        return table[ctx[0], ctx[1], pos % self.cfg.n_phases]

    def logprobs(self, table: np.ndarray, ctx: tuple[int, int], pos: int) -> np.ndarray:
        """log-softmax(logits / max(T, 1e-5)), as SGLang's estimator gathers them."""
        return _log_softmax(self.logits(table, ctx, pos) / max(self.cfg.temperature, 1e-5))

    def probs(self, table: np.ndarray, ctx: tuple[int, int], pos: int) -> np.ndarray:
        lg = self.logits(table, ctx, pos)
        if self.cfg.temperature == 0.0:
            out = np.zeros(lg.size)
            out[int(np.argmax(lg))] = 1.0
            return out
        return np.exp(_log_softmax(lg / self.cfg.temperature))

    def pick(
        self, table: np.ndarray, ctx: tuple[int, int], pos: int, rng: np.random.Generator
    ) -> int:
        if self.cfg.temperature == 0.0:
            return int(np.argmax(self.logits(table, ctx, pos)))
        p = self.probs(table, ctx, pos)
        return int(rng.choice(p.size, p=p))


def _f32(x: float) -> float:
    return float(np.float32(x))


class _Request:
    def __init__(self, i: int, cfg: SimConfig, world: _World, seed: int) -> None:
        self.rid = f"req-{i:04d}"
        self.workload = cfg.workloads[i % len(cfg.workloads)]
        ss = np.random.SeedSequence([seed, i])
        wseed, cseed, sseed, pseed = ss.spawn(4)
        self.window_rng = np.random.default_rng(wseed)  # same in both runs: same windows
        self.conf_rng = np.random.default_rng(cseed)
        self.rng = np.random.default_rng(sseed)  # sampling; shared seed, paths may diverge
        prompt = np.random.default_rng(pseed).integers(1, cfg.vocab, size=2)
        self.seq = [int(t) for t in prompt]
        self.prompt_len = 2
        self.finish: str | None = None
        self.draft_table = world.draft[self.workload]
        weights = np.asarray(WINDOW_WEIGHTS.get(self.workload, (1,) * 8), dtype=np.float64)
        weights = np.resize(weights, cfg.gamma + 1)
        self.window_p = weights / weights.sum()

    @property
    def output(self) -> list[int]:
        return self.seq[self.prompt_len :]


@dataclass
class _Block:
    """One request's draft block in one step: what verification and the row builder read."""

    req: _Request
    cfg: SimConfig
    world: _World
    prefix_len: int
    drafts: list[int] = field(default_factory=list)

    def ctx(self, row: int) -> tuple[int, int]:
        """Context of verify row ``row`` (row 0: the anchor), drafts standing in after it."""
        full = self.req.seq + self.drafts
        return full[self.prefix_len - 2 + row], full[self.prefix_len - 1 + row]


def _step(req: _Request, cfg: SimConfig, world: _World, full_verify: bool) -> dict:
    """One verify step of one request; returns the req-step row fields (+ private extras)."""
    g, t = cfg.gamma, cfg.temperature
    prefix_len = len(req.seq)
    verify_len = int(req.window_rng.choice(g + 1, p=req.window_p)) + 1
    w = verify_len - 1
    block = _Block(req, cfg, world, prefix_len)
    drafts, ctx = block.drafts, block.ctx

    q_lp, conf = [], []
    for j in range(1, g + 1):
        c, pos = ctx(j - 1), prefix_len - 1 + j
        d = world.pick(req.draft_table, c, pos, req.rng)
        drafts.append(d)
        q_lp.append(_f32(world.logprobs(req.draft_table, c, pos)[d]))
        p1 = float(np.clip(np.exp(_log_softmax(world.logits(world.target, c, pos)))[d], 0.02, 0.98))
        z = 2.0 * np.log(p1 / (1.0 - p1)) + 0.6 + 0.4 * req.conf_rng.normal()
        conf.append(float(1.0 / (1.0 + np.exp(-z))))

    if cfg.shared_draws and t > 0.0:
        shared = _shared_accept(block, w)  # cl, trim, bonus
        return _finish_step(block, verify_len, *shared, q_lp, conf)
    limit = g if full_verify else w
    correct = 0
    bonus = None
    while correct < limit:
        c, pos = ctx(correct), prefix_len + correct
        p = world.probs(world.target, c, pos)
        d = drafts[correct]
        if t == 0.0:
            ok = p[d] == 1.0
            if not ok:
                bonus = int(np.argmax(p))
        else:
            q = world.probs(req.draft_table, c, pos)
            ok = req.rng.random() < min(1.0, p[d] / q[d])
            if not ok:
                resid = np.maximum(p - q, 0.0)
                resid = resid / resid.sum() if resid.sum() > 0 else p
                bonus = int(req.rng.choice(resid.size, p=resid))
        if not ok:
            break
        correct += 1
    cl = min(correct, w)
    cap_trim = correct - cl
    if cl < correct:  # capped: the next draft was accepted by the full verify
        bonus = drafts[cl]
    elif bonus is None:  # every verified draft accepted: the bonus comes from the target
        bonus = world.pick(world.target, ctx(cl), prefix_len + cl, req.rng)
    return _finish_step(block, verify_len, cl, cap_trim, bonus, q_lp, conf)


def _shared_accept(block: _Block, w: int) -> tuple[int, int, int]:
    """(correct_drafts, cap_trim, bonus) from gamma + 1 uniforms, the same in every mode."""
    req, cfg, world, drafts, ctx = block.req, block.cfg, block.world, block.drafts, block.ctx
    prefix_len = block.prefix_len
    g = cfg.gamma
    u = req.rng.random(g + 1)
    correct = 0
    while correct < g:
        c, pos = ctx(correct), prefix_len + correct
        d = drafts[correct]
        p, q = world.probs(world.target, c, pos), world.probs(req.draft_table, c, pos)
        if not u[correct] * q[d] < p[d]:
            break
        correct += 1
    cl = min(correct, w)
    p = world.probs(world.target, ctx(cl), prefix_len + cl)
    weights = p
    if correct < w:  # rejected inside the window: residual; else the target (compact's view)
        resid = np.maximum(p - world.probs(req.draft_table, ctx(cl), prefix_len + cl), 0.0)
        weights = resid if resid.sum() > 0 else p
    cdf = np.cumsum(weights / weights.sum())
    bonus = int(min(np.searchsorted(cdf, u[g], side="right"), cdf.size - 1))
    return cl, correct - cl, bonus


def _finish_step(
    block: _Block,
    verify_len: int,
    cl: int,
    cap_trim: int,
    bonus: int,
    q_lp: list[float],
    conf: list[float],
) -> dict:
    """Commit (EOS / length cut) and build the req-step row."""
    req, cfg, world, drafts, ctx = block.req, block.cfg, block.world, block.drafts, block.ctx
    prefix_len = block.prefix_len
    t = cfg.temperature
    tokens = drafts[:cl] + [bonus]
    room = cfg.max_new_tokens - len(req.output)
    commit = tokens[:room]
    if cfg.eos_token is not None and cfg.eos_token in commit:
        commit = commit[: commit.index(cfg.eos_token) + 1]
        req.finish = "stop"
    elif len(commit) == room:
        req.finish = "length"
    rows_ctx = [ctx(r) for r in range(cl + 1)]
    req.seq.extend(commit)

    def target_logprob(row: int, tok: int) -> float:
        return _f32(world.logprobs(world.target, rows_ctx[row], prefix_len + row)[tok])

    survival = np.cumprod(conf)
    return {
        "rid": req.rid,
        "prefix_len": prefix_len,
        "verify_len": verify_len,
        "acc_len": len(commit),
        "correct_drafts": cl,
        "cap_trim": cap_trim,
        "bonus_token": bonus,
        "draft_tokens": drafts,
        "confidence": [round(c, 4) for c in conf],
        "survival": [round(float(s), 4) for s in survival],
        "workload": req.workload,
        "temperature": t,
        "top_p": 1.0,
        "top_k": -1,
        "is_last": req.finish is not None,
        "_q_lp": q_lp,
        "_target_logprob": target_logprob,
    }


def _run(
    cfg: SimConfig, world: _World, run_id: str, mode: str
) -> tuple[list, list, list, list[str]]:
    reqs = [_Request(i, cfg, world, cfg.seed) for i in range(cfg.n_requests)]
    recorder = BlockAcceptRecorder(cfg.gamma) if mode == "compact" else None
    req_rows, step_rows, jsonl = [], [], []
    fct = 0
    active = list(reqs)
    while active:
        fct += 1
        batch = []
        for req in active:
            row = _step(req, cfg, world, full_verify=(mode == "cap-accept"))
            if mode == "compact":
                row["cap_trim"] = 0  # compact never verified past the window
            q_lp, tlp = row.pop("_q_lp"), row.pop("_target_logprob")
            row.update(
                run_id=run_id,
                dp_rank=0,
                forward_ct=fct,
                gamma=cfg.gamma,
                req_pool_index=reqs.index(req),
            )
            if recorder is not None:
                est = recorder.observe(
                    req.rid,
                    fct,
                    row["prefix_len"],
                    row["verify_len"],
                    row["correct_drafts"],
                    row["draft_tokens"],
                    q_lp,
                    row["bonus_token"],
                    tlp,
                )
                row.update(est)
                jsonl.append(json.dumps(estimator_line(row)))
            batch.append(row)
        req_rows += batch
        step_rows.append(
            {
                "run_id": run_id,
                "dp_rank": 0,
                "forward_ct": fct,
                "source": "engine",
                "mode": mode,
                "bs": len(batch),
                "budget": int(sum(r["verify_len"] - 1 for r in batch)),
                "num_verify_tokens": int(sum(r["verify_len"] for r in batch)),
            }
        )
        for req in [r for r in active if r.finish is not None]:
            if recorder is not None:
                eos = recorder.finish(req.rid, natural_stop=req.finish == "stop")
                if eos:
                    jsonl.append(json.dumps(eos_line(req.rid, eos)))
        active = [r for r in active if r.finish is None]
    req_table = [
        {
            "run_id": run_id,
            "rid": r.rid,
            "dp_rank": 0,
            "workload": r.workload,
            "prompt": f"<{r.seq[0]}>",
            "prompt_tokens": r.prompt_len,
            "output_tokens": r.output,
            "completion_tokens": len(r.output),
            "finish_reason": r.finish,
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": 1.0,
            "top_k": -1,
            "seed": cfg.seed,
        }
        for r in reqs
    ]
    return req_rows, step_rows, req_table, jsonl


def simulate_pair(cfg: SimConfig | None = None, **overrides: object) -> SimResult:
    """Simulate a compact run and its cap-accept companion over the same requests and windows."""
    cfg = cfg or SimConfig()
    if overrides:
        cfg = SimConfig(**{**cfg.__dict__, **overrides})
    world = _World(cfg, np.random.default_rng([cfg.seed, 12345]))
    compact_id, cap_id = f"sim{cfg.seed}-compact", f"sim{cfg.seed}-cap"
    c_rows, c_steps, c_reqs, jsonl = _run(cfg, world, compact_id, "compact")
    a_rows, a_steps, a_reqs, _ = _run(cfg, world, cap_id, "cap-accept")
    runs = pd.DataFrame(
        [
            {
                "run_id": compact_id,
                "source": "engine",
                "mode": "compact",
                "gamma": cfg.gamma,
                "workload": "mixed",
                "temperature": cfg.temperature,
                "seed": cfg.seed,
                "companion_of": None,
            },
            {
                "run_id": cap_id,
                "source": "engine",
                "mode": "cap-accept",
                "gamma": cfg.gamma,
                "workload": "mixed",
                "temperature": cfg.temperature,
                "seed": cfg.seed,
                "companion_of": compact_id,
            },
        ]
    )
    return SimResult(
        runs=runs,
        compact_req_steps=pd.DataFrame(c_rows),
        cap_req_steps=pd.DataFrame(a_rows),
        compact_requests=pd.DataFrame(c_reqs),
        cap_requests=pd.DataFrame(a_reqs),
        compact_steps=pd.DataFrame(c_steps),
        cap_steps=pd.DataFrame(a_steps),
        compact_jsonl=jsonl,
    )
