"""Pieces of the engine throughput benchmark (``bench/bench_throughput.py``) that tests import.

The benchmark serves one queue of eval prompts per batch size with every variant
(``nospec``: plain batched greedy decoding; ``static`` / ``compact``: DSpark; ``hf``:
Hugging Face ``generate`` at batch 1) and reports, per variant and batch size, pooled and per
workload:

* total tokens/s: committed tokens / wall seconds of the whole queue. Per workload it is that
  workload's committed tokens over the same wall time (its share of the pooled figure: the
  queue is served as one mix, so a workload has no wall time of its own);
* tokens/s per request: the median over requests of ``(completion_tokens - 1) /
  (finish_time - first_token_time)``, i.e. 1 / TPOT with the first (prefill) token excluded,
  as SGLang's bench_serving and this project's serving stats define TPOT;
* accept length: mean ``acc_len`` over the run's req-step rows (committed tokens per request
  per verify step, bonus included); ``accept_len_req`` is the mean of per-request means;
* mean verify window: mean ``verify_len`` over the same rows;
* token match vs ``nospec`` of the same batch size and repetition: the share of positions
  equal up to the shorter of the two outputs, and the share of requests whose outputs are
  identical.

Everything is medianed over repetitions; ratios between variants are taken within each
repetition first and then medianed, so slow drift of the machine cancels.

Queue: :func:`build_queue` interleaves ``load_prompts`` of each workload round-robin (the
order inside each round is shuffled, seeded), so every prefix whose length is a multiple of
the number of workloads has equal shares and a longer queue extends a shorter one.
"""

from __future__ import annotations

import inspect
import math
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dspark_obs.workloads import WORKLOADS, TrafficRequest, load_prompts
from dspark_obs.workloads.base import derive_seed

__all__ = [
    "HOSTFIRST",
    "BASELINE",
    "POOLED",
    "RATIO_PAIRS",
    "VARIANTS",
    "Measurement",
    "RequestStat",
    "aggregate",
    "build_queue",
    "hf_llama_from_target",
    "markdown_tables",
    "match_outputs",
    "plot_results",
    "queue_size",
    "request_stats",
    "summarize",
]

HOSTFIRST = "compact-hostfirst"  # compact with each arrival's first token read on the host
VARIANTS = ("nospec", "static", "compact", HOSTFIRST, "hf")
BASELINE = "nospec"
POOLED = "all"
RATIO_PAIRS: tuple[tuple[str, str], ...] = (
    ("static", "nospec"),
    ("compact", "nospec"),
    ("compact", "static"),
    (HOSTFIRST, "nospec"),
    ("compact", HOSTFIRST),
    ("nospec", "hf"),
    ("static", "hf"),
    ("compact", "hf"),
)
"""(numerator, denominator) variant pairs whose per-repetition ratios are reported."""


# -- the queue ------------------------------------------------------------------------------


def queue_size(prompts: int, batch: int, factor: float = 2.0) -> int:
    """Requests served at ``batch``: at least ``prompts``, at least ``factor * batch`` (so
    every slot is reused and admission keeps the batch full), rounded up to equal shares."""
    k = len(WORKLOADS)
    n = max(int(prompts), math.ceil(factor * batch))
    return k * math.ceil(n / k)


def build_queue(
    n: int, *, new_tokens: int, seed: int = 0, split: str = "eval"
) -> list[TrafficRequest]:
    """``n`` greedy requests (``n`` a multiple of the workload count), equal shares, all
    arriving at step 0; deterministic in ``(n, seed, split)``; a prefix of a longer queue."""
    k = len(WORKLOADS)
    if isinstance(n, bool) or not isinstance(n, int) or n < k or n % k:
        raise ValueError(f"the queue needs a positive multiple of {k} requests (equal "
                         f"{'/'.join(WORKLOADS)} shares), got {n!r}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    per = {w: load_prompts(w, split, n // k, seed) for w in WORKLOADS}
    rng = random.Random(derive_seed("bench_throughput", split, seed))
    out: list[TrafficRequest] = []
    for r in range(n // k):
        order = list(WORKLOADS)
        rng.shuffle(order)
        for w in order:
            p = per[w][r]
            i = len(out)
            out.append(
                TrafficRequest(
                    prompt=p,
                    arrival_step=0,
                    max_new_tokens=new_tokens,
                    temperature=0.0,
                    seed=derive_seed("request", seed, i) % 2**31,
                    rid=f"{i:05d}-{p.id}",
                )
            )
    return out


# -- raw records ----------------------------------------------------------------------------


@dataclass
class RequestStat:
    """What one request did in one measured run."""

    rid: str
    workload: str
    tokens: int  # completion tokens, the prefill's first token included
    decode_seconds: float | None = None  # finish - first token; None where not measured
    steps: int = 0  # verify steps (req-step rows); 0 for variants without them
    acc_sum: int = 0  # sum of acc_len over those steps
    verify_sum: int = 0  # sum of verify_len over those steps

    @property
    def speed(self) -> float | None:
        """Decode tokens/s of this request (1 / TPOT, first token excluded)."""
        if self.decode_seconds is None or self.tokens < 2 or self.decode_seconds <= 0:
            return None
        return (self.tokens - 1) / self.decode_seconds


@dataclass
class Measurement:
    """One timed run of one variant over one queue at one batch size."""

    variant: str
    batch: int
    rep: int
    seconds: float
    committed_tokens: int
    steps: int
    requests: list[RequestStat]
    outputs: dict[str, list[int]] = field(default_factory=dict)
    speed_method: str = "request-rows"  # how RequestStat.decode_seconds was measured
    step_rate: float | None = None  # steps / seconds when per-request times are unknown

    def to_dict(self, outputs: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if not outputs:
            d.pop("outputs")
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Measurement:
        d = dict(d)
        d["requests"] = [RequestStat(**r) for r in d["requests"]]
        d.setdefault("outputs", {})
        return cls(**d)


def request_stats(
    request_rows: Iterable[Mapping[str, Any]], req_step_rows: Iterable[Mapping[str, Any]]
) -> list[RequestStat]:
    """RequestStats from the engine's ``requests`` and ``req_steps`` record rows."""
    acc: dict[str, list[int]] = {}
    for row in req_step_rows:
        a = acc.setdefault(row["rid"], [0, 0, 0])
        a[0] += 1
        a[1] += int(row["acc_len"])
        a[2] += int(row["verify_len"])
    out = []
    for row in request_rows:
        steps, acc_sum, verify_sum = acc.get(row["rid"], (0, 0, 0))
        out.append(
            RequestStat(
                rid=row["rid"],
                workload=row.get("workload") or "custom",
                tokens=int(row["completion_tokens"]),
                decode_seconds=float(row["finish_time"]) - float(row["first_token_time"]),
                steps=steps,
                acc_sum=acc_sum,
                verify_sum=verify_sum,
            )
        )
    return out


def match_outputs(
    ref: Mapping[str, Sequence[int]], got: Mapping[str, Sequence[int]], rids: Iterable[str]
) -> dict[str, Any]:
    """Token agreement of ``got`` with ``ref`` over ``rids``: equal positions up to the
    shorter length (pooled over requests), the common-prefix share of those positions
    (after a divergence positions only match by chance), and the share of identical outputs."""
    equal = compared = exact = n = prefix = 0
    first_diff: list[int] = []
    for rid in rids:
        if rid not in ref or rid not in got:
            continue
        a, b = list(ref[rid]), list(got[rid])
        m = min(len(a), len(b))
        eq = sum(1 for x, y in zip(a[:m], b[:m], strict=True) if x == y)
        equal += eq
        compared += m
        n += 1
        common = next((i for i in range(m) if a[i] != b[i]), m)
        prefix += common
        if a == b:
            exact += 1
        else:
            first_diff.append(common)
    return {
        "requests": n,
        "positions": compared,
        "match_rate": equal / compared if compared else None,
        "prefix_rate": prefix / compared if compared else None,
        "exact_share": exact / n if n else None,
        "first_divergence": min(first_diff) if first_diff else None,
    }


def summarize(m: Measurement, workload: str | None = None) -> dict[str, Any]:
    """Metrics of one measurement, pooled (``workload=None``) or for one workload."""
    reqs = [r for r in m.requests if workload is None or r.workload == workload]
    tokens = m.committed_tokens if workload is None else sum(r.tokens for r in reqs)
    speeds = [s for s in (r.speed for r in reqs) if s is not None]
    if speeds:
        per_req = statistics.median(speeds)
    elif m.step_rate is not None and reqs:
        per_req = m.step_rate  # one token per running request per step (no-spec decoding)
    else:
        per_req = None
    steps = sum(r.steps for r in reqs)
    with_steps = [r for r in reqs if r.steps]
    return {
        "requests": len(reqs),
        "tokens": tokens,
        "tokens_per_s": tokens / m.seconds if m.seconds > 0 else None,
        "per_request_tok_s": per_req,
        "accept_len": sum(r.acc_sum for r in reqs) / steps if steps else None,
        "accept_len_req": statistics.fmean(r.acc_sum / r.steps for r in with_steps)
        if with_steps
        else None,
        "verify_len": sum(r.verify_sum for r in reqs) / steps if steps else None,
    }


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def aggregate(
    measurements: Sequence[Measurement], baseline: str = BASELINE
) -> dict[str, list[dict[str, Any]]]:
    """Medians over repetitions per (variant, batch, scope), the ratios of :data:`RATIO_PAIRS`
    per repetition then medianed, and token match vs ``baseline`` (same batch, same rep).

    Scopes are :data:`POOLED` and each workload present. Returns ``{"cells": [...],
    "ratios": [...]}``; every cell and ratio also keeps its per-repetition values.
    """
    by: dict[tuple[str, int], dict[int, Measurement]] = {}
    for m in measurements:
        by.setdefault((m.variant, m.batch), {})[m.rep] = m
    workloads = [w for w in WORKLOADS if any(r.workload == w for m in measurements
                                             for r in m.requests)]
    workloads += sorted({r.workload for m in measurements for r in m.requests} - set(workloads))
    scopes = [POOLED, *workloads]

    def summ(m: Measurement, scope: str) -> dict[str, Any]:
        return summarize(m, None if scope == POOLED else scope)

    cells = []
    metrics = ("tokens_per_s", "per_request_tok_s", "accept_len", "accept_len_req", "verify_len")
    order = {v: i for i, v in enumerate(VARIANTS)}
    for (variant, batch), reps in sorted(by.items(), key=lambda kv: (kv[0][1],
                                                                     order.get(kv[0][0], 99),
                                                                     kv[0][0])):
        base = by.get((baseline, batch), {})
        for scope in scopes:
            per_rep = {rep: summ(m, scope) for rep, m in sorted(reps.items())}
            if not any(s["requests"] for s in per_rep.values()):
                continue
            cell: dict[str, Any] = {"variant": variant, "batch": batch, "scope": scope,
                                    "reps": len(per_rep)}
            first = next(iter(per_rep.values()))
            cell["requests"] = first["requests"]
            cell["tokens"] = first["tokens"]
            for k in metrics:
                cell[k] = _median(s[k] for s in per_rep.values())
                cell[k + "_reps"] = [s[k] for s in per_rep.values()]
            cell["seconds"] = _median(m.seconds for m in reps.values())
            if variant != baseline and base:
                matches = []
                for rep, m in sorted(reps.items()):
                    ref = base.get(rep) or next(iter(base.values()))
                    rids = [r.rid for r in m.requests if scope == POOLED or r.workload == scope]
                    matches.append(match_outputs(ref.outputs, m.outputs, rids))
                if any(x["positions"] for x in matches):
                    cell["match_rate"] = _median(x["match_rate"] for x in matches)
                    cell["match_rate_min"] = min(
                        x["match_rate"] for x in matches if x["match_rate"] is not None
                    )
                    cell["exact_share"] = _median(x["exact_share"] for x in matches)
                    cell["prefix_rate"] = _median(x["prefix_rate"] for x in matches)
                    cell["match_reps"] = matches
            cells.append(cell)

    ratios = []
    batches = sorted({b for _, b in by})
    for batch in batches:
        for num, den in RATIO_PAIRS:
            a, b = by.get((num, batch)), by.get((den, batch))
            if not a or not b:
                continue
            common = sorted(set(a) & set(b))
            if not common:
                continue
            for scope in scopes:
                tot, per = [], []
                for rep in common:
                    sa, sb = summ(a[rep], scope), summ(b[rep], scope)
                    if not (sa["requests"] and sb["requests"]):
                        continue
                    tot.append(_ratio(sa["tokens_per_s"], sb["tokens_per_s"]))
                    per.append(_ratio(sa["per_request_tok_s"], sb["per_request_tok_s"]))
                if not tot:
                    continue
                ratios.append({"batch": batch, "num": num, "den": den, "scope": scope,
                               "reps": len(tot), "total": _median(tot), "total_reps": tot,
                               "per_request": _median(per), "per_request_reps": per})
    return {"cells": cells, "ratios": ratios}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


# -- reporting ------------------------------------------------------------------------------


def _cell(summary: Mapping[str, Any], variant: str, batch: int, scope: str = POOLED
          ) -> Mapping[str, Any] | None:
    for c in summary["cells"]:
        if (c["variant"], c["batch"], c["scope"]) == (variant, batch, scope):
            return c
    return None


def _rat(summary: Mapping[str, Any], num: str, den: str, batch: int, scope: str = POOLED,
         key: str = "total") -> float | None:
    for r in summary["ratios"]:
        if (r["num"], r["den"], r["batch"], r["scope"]) == (num, den, batch, scope):
            return r[key]
    return None


def _f(v: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def markdown_tables(summary: Mapping[str, Any]) -> str:
    """The pooled table (README benchmark form), then a per-workload table."""
    batches = sorted({c["batch"] for c in summary["cells"]})
    lines = [
        "| batch | no-spec tok/s | static tok/s | static / no-spec | compact tok/s "
        "| compact / no-spec | compact / static | tok/s per request (no-spec / static / "
        "compact) | accept length (static / compact) | mean window (static / compact) "
        "| token match vs no-spec (static / compact) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in batches:
        c = {v: _cell(summary, v, b) or {} for v in ("nospec", "static", "compact")}

        def g(v: str, k: str, c: Mapping[str, Mapping[str, Any]] = c) -> float | None:
            return c[v].get(k)

        lines.append(
            f"| {b} | {_f(g('nospec', 'tokens_per_s'))} | {_f(g('static', 'tokens_per_s'))} "
            f"| {_f(_rat(summary, 'static', 'nospec', b), '.2f', 'x')} "
            f"| {_f(g('compact', 'tokens_per_s'))} "
            f"| {_f(_rat(summary, 'compact', 'nospec', b), '.2f', 'x')} "
            f"| {_f(_rat(summary, 'compact', 'static', b), '.2f', 'x')} "
            f"| {_f(g('nospec', 'per_request_tok_s'))} / {_f(g('static', 'per_request_tok_s'))}"
            f" / {_f(g('compact', 'per_request_tok_s'))} "
            f"| {_f(g('static', 'accept_len'), '.2f')} / {_f(g('compact', 'accept_len'), '.2f')} "
            f"| {_f(g('static', 'verify_len'), '.2f')} / {_f(g('compact', 'verify_len'), '.2f')} "
            f"| {_f(g('static', 'match_rate'), '.3f')} / {_f(g('compact', 'match_rate'), '.3f')} |"
        )
    hf = [c for c in summary["cells"] if c["variant"] == "hf" and c["scope"] == POOLED]
    out = "\n".join(lines)
    ab = [c for c in summary["cells"] if c["variant"] == HOSTFIRST and c["scope"] == POOLED]
    if ab:
        rows = ["| batch | compact, first token read on the host tok/s | its / no-spec "
                "| compact / it | token match vs no-spec |", "|---|---|---|---|---|"]
        for c in ab:
            b = c["batch"]
            rows.append(
                f"| {b} | {_f(c['tokens_per_s'])} "
                f"| {_f(_rat(summary, HOSTFIRST, 'nospec', b), '.2f', 'x')} "
                f"| {_f(_rat(summary, 'compact', HOSTFIRST, b), '.3f', 'x')} "
                f"| {_f(c.get('match_rate'), '.3f')} |"
            )
        out += "\n\n" + "\n".join(rows)
    if hf:
        rows = ["| batch | HF generate tok/s | tok/s per request | no-spec / HF | static / HF "
                "| compact / HF | token match vs no-spec (exact share) |",
                "|---|---|---|---|---|---|---|"]
        for c in hf:
            b = c["batch"]
            rows.append(
                f"| {b} | {_f(c['tokens_per_s'])} | {_f(c['per_request_tok_s'])} "
                f"| {_f(_rat(summary, 'nospec', 'hf', b), '.2f', 'x')} "
                f"| {_f(_rat(summary, 'static', 'hf', b), '.2f', 'x')} "
                f"| {_f(_rat(summary, 'compact', 'hf', b), '.2f', 'x')} "
                f"| {_f(c.get('match_rate'), '.3f')} ({_f(c.get('exact_share'), '.2f')}) |"
            )
        out += "\n\n" + "\n".join(rows)
    scopes = [s for s in dict.fromkeys(c["scope"] for c in summary["cells"]) if s != POOLED]
    if scopes:
        rows = ["| batch | workload | variant | tok/s (share of the queue) | tok/s per request "
                "| per request / no-spec | accept length | mean window | token match vs "
                "no-spec (exact share) |",
                "|---|---|---|---|---|---|---|---|---|"]
        for b in batches:
            for s in scopes:
                for v in VARIANTS:
                    c = _cell(summary, v, b, s)
                    if c is None:
                        continue
                    rows.append(
                        f"| {b} | {s} | {v} | {_f(c['tokens_per_s'])} "
                        f"| {_f(c['per_request_tok_s'])} "
                        f"| {_f(_rat(summary, v, 'nospec', b, s, 'per_request'), '.2f', 'x')} "
                        f"| {_f(c['accept_len'], '.2f')} | {_f(c['verify_len'], '.2f')} "
                        f"| {_f(c.get('match_rate'), '.3f')} ({_f(c.get('exact_share'), '.2f')})"
                        " |"
                    )
        out += "\n\n" + "\n".join(rows)
    return out + "\n"


def _save(fig: Any, ax: Any, title: str, stem: Path, suffix: str) -> Path:
    """Finish one plot (total tokens/s on y, grid, legend) and write it as STEM+SUFFIX.png."""
    import matplotlib.pyplot as plt

    ax.set_ylabel("total tokens/s (queue)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = stem.with_name(stem.name + suffix + ".png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_results(summary: Mapping[str, Any], stem: str | Path, title: str = "") -> list[Path]:
    """Two PNGs: total tokens/s against tokens/s per request, one line per variant with
    points labeled by batch size (the DSpark paper's throughput / per-user speed form), and
    total tokens/s against batch size. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    style = {"nospec": ("no-spec", "tab:gray", "o"), "static": ("DSpark static", "tab:blue", "s"),
             "compact": ("DSpark compact", "tab:red", "^"), "hf": ("HF generate", "black", "x"),
             HOSTFIRST: ("DSpark compact, first token read on the host", "tab:orange", "v")}
    series: dict[str, list[Mapping[str, Any]]] = {}
    for c in summary["cells"]:
        if c["scope"] == POOLED and c["tokens_per_s"] is not None:
            series.setdefault(c["variant"], []).append(c)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 5))
    for v, cs in series.items():
        cs = sorted(cs, key=lambda c: c["batch"])
        pts = [(c["per_request_tok_s"], c["tokens_per_s"], c["batch"]) for c in cs
               if c["per_request_tok_s"] is not None]
        if not pts:
            continue
        label, color, marker = style.get(v, (v, None, "o"))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color,
                label=label)
        for x, y, b in pts:
            ax.annotate(f"bs={b}", (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=8, color=color)
    ax.set_xlabel("tokens/s per request (1 / TPOT, median over requests)")
    paths.append(_save(fig, ax, title or "throughput vs per-request speed", stem, "_pareto"))

    fig, ax = plt.subplots(figsize=(7, 5))
    for v, cs in series.items():
        cs = sorted(cs, key=lambda c: c["batch"])
        label, color, marker = style.get(v, (v, None, "o"))
        ax.plot([c["batch"] for c in cs], [c["tokens_per_s"] for c in cs], marker=marker,
                color=color, label=label, linestyle="none" if len(cs) == 1 else "-")
    ax.set_xscale("log", base=2)
    ticks = sorted({c["batch"] for cs in series.values() for c in cs})
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("batch size (max concurrent requests)")
    paths.append(_save(fig, ax, title or "throughput vs batch size", stem, "_batch"))
    return paths


# -- the outside reference ------------------------------------------------------------------


def hf_llama_from_target(target: Any) -> Any:
    """A transformers ``LlamaForCausalLM`` holding the same weights as our ``Target``
    (same device and dtype, eval mode). Our q/k rows already use Hugging Face's RoPE layout,
    so the conversion only splits the fused qkv and gate/up matrices."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = target.cfg
    kw: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:  # >= 5.0
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    else:
        kw["rope_theta"] = float(cfg.rope_theta)
    hf_cfg = LlamaConfig(**kw)
    src = {k: v.detach() for k, v in target.state_dict().items()}
    sd: dict[str, Any] = {
        "model.embed_tokens.weight": src["tok_embeddings.weight"],
        "model.norm.weight": src["norm.weight"],
    }
    sd["lm_head.weight"] = src["tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"]
    for i in range(cfg.num_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = src[p + "attn.wqkv.weight"].split((cfg.hidden_size, cfg.kv_dim, cfg.kv_dim))
        gate, up = src[p + "mlp.w_gate_up.weight"].chunk(2)
        sd.update({
            h + "self_attn.q_proj.weight": q,
            h + "self_attn.k_proj.weight": k,
            h + "self_attn.v_proj.weight": v,
            h + "self_attn.o_proj.weight": src[p + "attn.wo.weight"],
            h + "input_layernorm.weight": src[p + "attn_norm.weight"],
            h + "post_attention_layernorm.weight": src[p + "mlp_norm.weight"],
            h + "mlp.gate_proj.weight": gate,
            h + "mlp.up_proj.weight": up,
            h + "mlp.down_proj.weight": src[p + "mlp.w_down.weight"],
        })
    with torch.device(target.device):
        model = LlamaForCausalLM(hf_cfg)
    model = model.to(dtype=target.dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF conversion: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:
        model.tie_weights()
    return model.eval().requires_grad_(False)
