"""The A/B gate: correctness first (parity, accept length, contamination), then performance.

A change to a DSpark server (drafter, STS, cost table, verify mode, kernels) passes when

1. **parity**: greedy generations of N fixed prompts (256 tokens, ``ignore_eos``) are
   byte-exact between BASE and NEW (token ids where the server returns them, else the text's
   UTF-8 bytes); a failure names the prompt, the first differing token and its context;
2. **accept length**: NEW's mean accept length on those prompts is within ``accept_tol``
   (0.05) of BASE's (skipped, and said so, when a server reports no spec meta_info);
3. **contamination**: on NEW, each greedy prompt rerun right after a temperature-sampled
   request reproduces its first greedy output exactly (state leaking from sampled requests
   into later greedy ones shows up here);
4. **performance**: derived step time (mean TPOT x mean accept length) NEW / BASE with a
   request bootstrap interval; the gate fails only when the whole interval lies above
   ``1 + max_regression``. TPOT and throughput are shown side by side.

The same report comes from two stored bench runs (parity on their greedy requests of the
same rid, no contamination check: that needs live servers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from dspark_obs.serving.bench_stats import PEAK_CAVEAT, BenchSummary, bootstrap_step_ratio
from dspark_obs.serving.client import GenerationRequest, RequestResult, ServingClient

__all__ = [
    "Difference",
    "GateCheck",
    "GateReport",
    "check_accept_length",
    "check_contamination",
    "check_parity",
    "first_difference",
    "perf_verdict",
]

CONTEXT = 8  # tokens (or bytes x 4) shown either side of a difference
SAMPLED_TOKENS = 32  # length of the interleaved sampled requests: enough to set any state


@dataclass(frozen=True)
class Difference:
    """Where two generations of one prompt first differ."""

    rid: str
    index: int  # token index (or byte offset when compared as text)
    unit: str  # "token" | "byte"
    base: str  # the differing element and its context, rendered
    new: str

    def __str__(self) -> str:
        return (f"{self.rid}: first difference at {self.unit} {self.index}\n"
                f"  base: {self.base}\n  new:  {self.new}")


@dataclass
class GateCheck:
    name: str
    passed: bool | None  # None: not run (the reason is in detail)
    detail: str
    differences: list[Difference] = field(default_factory=list)


@dataclass
class GateReport:
    base: str
    new: str
    checks: list[GateCheck]
    base_summary: BenchSummary | None = None
    new_summary: BenchSummary | None = None
    step_ratio: tuple[float, float, float] | None = None

    @property
    def passed(self) -> bool:
        return all(c.passed is not False for c in self.checks)

    def to_dict(self) -> dict:
        """JSON-ready: verdict, checks (with differences), both summaries, the step ratio."""
        return {
            "passed": self.passed, "base": self.base, "new": self.new,
            "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail,
                        "differences": [vars(d) for d in c.differences]} for c in self.checks],
            "base_summary": self.base_summary.to_dict() if self.base_summary else None,
            "new_summary": self.new_summary.to_dict() if self.new_summary else None,
            "step_ratio": None if self.step_ratio is None else dict(
                zip(("point", "lo", "hi"), self.step_ratio, strict=True)),
        }

    def to_markdown(self) -> str:
        mark = {True: "pass", False: "**FAIL**", None: "not run"}
        lines = [f"# dspark-obs gate: {'PASS' if self.passed else 'FAIL'}", "",
                 f"- BASE: `{self.base}`", f"- NEW: `{self.new}`", "",
                 "| check | result | detail |", "|---|---|---|"]
        lines += [f"| {c.name} | {mark[c.passed]} | {c.detail} |" for c in self.checks]
        for c in self.checks:
            if c.differences:
                lines += ["", f"## {c.name}: first differences", "", "```"]
                lines += [str(d) for d in c.differences]
                lines += ["```"]
        if self.base_summary and self.new_summary:
            lines += ["", "## performance, side by side", "", _perf_table(
                self.base_summary, self.new_summary, self.step_ratio), "", f"Note: {PEAK_CAVEAT}."]
        return "\n".join(lines) + "\n"


def _render_tokens(ids: Sequence[int], i: int) -> str:
    lo, hi = max(0, i - CONTEXT), min(len(ids), i + CONTEXT + 1)
    at = ids[i] if i < len(ids) else "<end>"
    before = " ".join(map(str, ids[lo:i]))
    after = " ".join(map(str, ids[i + 1:hi]))
    return f"... {before} [{at}] {after} ..."


def _render_bytes(data: bytes, i: int) -> str:
    lo, hi = max(0, i - 4 * CONTEXT), i + 4 * CONTEXT
    at = data[i:i + 1] or b"<end>"
    return f"...{data[lo:i]!r} [{at!r}] {data[i + 1:hi]!r}..."


def first_difference(rid: str, base: RequestResult, new: RequestResult) -> Difference | None:
    """None when byte-exact; token ids compared when both sides have them, else UTF-8 text."""
    if base.output_ids is not None and new.output_ids is not None:
        a, b = base.output_ids, new.output_ids
        if a == b:
            return None
        i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        return Difference(rid, i, "token", _render_tokens(a, i), _render_tokens(b, i))
    a, b = base.text.encode(), new.text.encode()
    if a == b:
        return None
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
             min(len(a), len(b)))
    return Difference(rid, i, "byte", _render_bytes(a, i), _render_bytes(b, i))


def check_parity(base: Sequence[RequestResult], new: Sequence[RequestResult],
                 name: str = "greedy parity") -> GateCheck:
    """Byte-exact equality of each pair of generations (same order = same prompt)."""
    failed = [f"{b.rid}: {b.error or n.error}" for b, n in zip(base, new, strict=True)
              if not (b.ok and n.ok)]
    if failed:
        return GateCheck(name, False, f"requests failed: {'; '.join(failed[:3])}")
    diffs = [d for b, n in zip(base, new, strict=True)
             if (d := first_difference(b.rid, b, n)) is not None]
    tokens = sum(b.completion_tokens for b in base)
    unit = "token ids" if all(r.output_ids is not None for r in (*base, *new)) else "text bytes"
    if diffs:
        first = diffs[0]
        return GateCheck(name, False, f"{len(diffs)}/{len(base)} prompts differ ({unit}); "
                         f"first: {first.rid} at {first.unit} {first.index}", diffs)
    return GateCheck(name, True, f"{len(base)} prompts, {tokens} tokens identical ({unit})")


def _mean_accept(results: Sequence[RequestResult]) -> float:
    values = [r.accept_length for r in results if r.ok and r.accept_length is not None]
    return float(np.mean(values)) if values else math.nan


def check_accept_length(base: Sequence[RequestResult] | float, new: Sequence[RequestResult] |
                        float, tol: float = 0.05) -> GateCheck:
    """Mean accept length of NEW within ``tol`` of BASE's."""
    a = base if isinstance(base, float) else _mean_accept(base)
    b = new if isinstance(new, float) else _mean_accept(new)
    name = "accept length"
    if not (math.isfinite(a) and math.isfinite(b)):
        return GateCheck(name, None, "a server reported no spec meta_info (spec_verify_ct)")
    ok = abs(b - a) <= tol
    return GateCheck(name, ok, f"base {a:.3f}, new {b:.3f}, abs diff {abs(b - a):.3f} "
                     f"{'<=' if ok else '>'} {tol}")


def check_contamination(
    client: ServingClient,
    greedy: Sequence[GenerationRequest],
    reference: Sequence[RequestResult],
    *,
    temperature: float = 1.0,
    seed: int = 0,
    on_done: Callable[[RequestResult], None] | None = None,
) -> GateCheck:
    """Rerun each greedy prompt right after a sampled request; compare with ``reference``."""
    reruns = []
    for i, req in enumerate(greedy):
        donor = greedy[(i + 1) % len(greedy)]
        sampled = replace(donor, rid=f"{donor.rid}-sampled{i}", temperature=temperature,
                          seed=seed + i, ignore_eos=False,
                          max_new_tokens=min(donor.max_new_tokens, SAMPLED_TOKENS))
        for r in (sampled, replace(req, rid=f"{req.rid}-rerun")):
            res = client.generate(r)
            if on_done is not None:
                on_done(res)
            if not res.ok:
                return GateCheck("contamination", False, f"{r.rid} failed: {res.error}")
        reruns.append(replace(res, rid=req.rid))
    check = check_parity(reference, reruns, name="contamination")
    if check.passed:
        check.detail = (f"{len(greedy)} greedy reruns after T={temperature} sampled requests "
                        "reproduce the first greedy outputs")
    return check


def perf_verdict(base: pd.DataFrame, new: pd.DataFrame, *, max_regression: float = 0.03,
                 reps: int = 2000, seed: int = 0) -> tuple[GateCheck, tuple[float, float, float]]:
    """Derived step time NEW / BASE with a 95% request bootstrap; fail if surely slower."""
    point, lo, hi = bootstrap_step_ratio(base, new, reps=reps, seed=seed)
    if lo > 1.0 + max_regression:
        verdict, ok = f"slower beyond {max_regression:.0%}", False
    elif hi < 1.0:
        verdict, ok = "faster", True
    elif lo > 1.0:
        verdict, ok = f"slower, within the {max_regression:.0%} allowance", True
    else:
        verdict, ok = "no significant difference", True
    detail = f"derived step time NEW/BASE {point:.3f} [95% CI {lo:.3f}, {hi:.3f}]: {verdict}"
    return GateCheck("performance", ok, detail), (point, lo, hi)


def _perf_table(a: BenchSummary, b: BenchSummary,
                ratio: tuple[float, float, float] | None) -> str:
    rows = [
        ("derived step time (ms) = mean TPOT x mean accept length",
         a.derived_step_ms, b.derived_step_ms),
        ("TPOT mean (ms, TTFT excluded)", a.tpot_ms.mean, b.tpot_ms.mean),
        ("TPOT median (ms)", a.tpot_ms.median, b.tpot_ms.median),
        ("TPOT p99 (ms)", a.tpot_ms.p99, b.tpot_ms.p99),
        ("TTFT mean (ms)", a.ttft_ms.mean, b.ttft_ms.mean),
        ("E2E mean (ms)", a.e2e_ms.mean, b.e2e_ms.mean),
        ("accept length mean", a.accept_length.mean, b.accept_length.mean),
        ("output throughput (tok/s, all tokens / wall time)",
         a.output_throughput, b.output_throughput),
        ("peak throughput (tok/s, 1-s windows)", a.peak_output_throughput,
         b.peak_output_throughput),
        ("requests", a.completed, b.completed),
    ]
    out = ["| figure | BASE | NEW | NEW/BASE |", "|---|---|---|---|"]
    for label, x, y in rows:
        r = y / x if x and math.isfinite(x) and math.isfinite(y) else math.nan
        out.append(f"| {label} | {x:.4g} | {y:.4g} | {r:.3f} |")
    out.append(f"| peak phase band (tok/s) | {a.peak_phase_band[0]:.4g}-"
               f"{a.peak_phase_band[1]:.4g} | {b.peak_phase_band[0]:.4g}-"
               f"{b.peak_phase_band[1]:.4g} | |")
    if ratio is not None:
        out.append(f"| derived step ratio, 95% bootstrap CI | | | {ratio[0]:.3f} "
                   f"[{ratio[1]:.3f}, {ratio[2]:.3f}] |")
    return "\n".join(out)
