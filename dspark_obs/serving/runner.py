"""Putting the parts together: one bench run, a gate over two servers, a gate over two runs."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from dspark_obs.serving.bench_records import bench_records, load_bench_run, server_meta
from dspark_obs.serving.bench_requests import build_requests
from dspark_obs.serving.bench_stats import BenchSummary, request_frame, summarize, token_events
from dspark_obs.serving.client import GenerationRequest, RequestResult, ServingClient
from dspark_obs.serving.gate import (
    GateCheck,
    GateReport,
    check_accept_length,
    check_contamination,
    check_parity,
    perf_verdict,
)
from dspark_obs.serving.loadgen import LoadPlan, LoadResult, run_load

__all__ = ["BenchRun", "GateOptions", "gate_servers", "gate_stored", "run_bench"]

Progress = Callable[[RequestResult], None]


@dataclass
class BenchRun:
    """One benchmark: its requests, what came back, the frame and the summary."""

    requests: list[GenerationRequest]
    load: LoadResult
    frame: pd.DataFrame
    summary: BenchSummary
    server: dict[str, Any]

    def records(self, run_id: str, config: dict[str, Any]) -> tuple[dict, list[dict]]:
        return bench_records(run_id, self.requests, self.load.results, self.summary,
                             config, self.server)


def run_bench(
    client: ServingClient,
    requests: Sequence[GenerationRequest],
    plan: LoadPlan | None = None,
    on_done: Progress | None = None,
) -> BenchRun:
    """Warm up, run ``requests`` under load (``plan``; None: one at a time), summarize."""
    server = server_meta(client.server_info())
    load = run_load(client, requests, **asdict(plan or LoadPlan()), on_done=on_done)
    frame = request_frame(load.results, load.start_clock)
    summary = summarize(frame, load.duration, token_events(load.results, load.start_clock))
    return BenchRun(list(requests), load, frame, summary, server)


@dataclass(frozen=True)
class GateOptions:
    """Knobs of the gate; the defaults are the seed campaign's (256-token parity, 0.05)."""

    prompts: int = 8
    parity_tokens: int = 256
    parity_workload: str = "mixed"
    accept_tol: float = 0.05
    contamination_temperature: float = 1.0
    bench_workload: str = "mixed"
    bench_requests: int = 16
    bench_input_len: int = 256
    bench_output_len: int = 64
    concurrency: int = 1
    request_rate: float = math.inf
    rounds: int = 1
    warmup: int = 1
    max_regression: float = 0.03
    seed: int = 0
    vocab_size: int = 32000


def gate_servers(base: ServingClient, new: ServingClient, opts: GateOptions = GateOptions(),
                 on_done: Progress | None = None) -> GateReport:
    """Run every gate check against two live servers."""
    parity = build_requests(opts.parity_workload, opts.prompts, input_len=opts.bench_input_len,
                            output_len=opts.parity_tokens, seed=opts.seed,
                            vocab_size=opts.vocab_size)
    parity = [replace(r, temperature=0.0, ignore_eos=True) for r in parity]

    def greedy(client: ServingClient) -> list[RequestResult]:
        out = []
        for r in parity:
            out.append(client.generate(r))
            if on_done is not None:
                on_done(out[-1])
        return out

    base_out, new_out = greedy(base), greedy(new)
    checks = [check_parity(base_out, new_out), check_accept_length(base_out, new_out,
                                                                   opts.accept_tol)]
    if all(r.ok for r in new_out):
        checks.append(check_contamination(new, parity, new_out, seed=opts.seed,
                                          temperature=opts.contamination_temperature,
                                          on_done=on_done))
    else:
        checks.append(GateCheck("contamination", False, "NEW failed its greedy requests"))

    requests = build_requests(opts.bench_workload, opts.bench_requests,
                              input_len=opts.bench_input_len, output_len=opts.bench_output_len,
                              seed=opts.seed + 1, vocab_size=opts.vocab_size)
    plan = LoadPlan(opts.concurrency, opts.request_rate, opts.warmup, opts.seed)
    runs: dict[str, list[BenchRun]] = {"base": [], "new": []}
    for _ in range(opts.rounds):  # alternate, so slow drift of a shared machine hits both
        for side, client in (("base", base), ("new", new)):
            runs[side].append(run_bench(client, requests, plan, on_done))
    (base_frame, base_summary), (new_frame, new_summary) = map(_pooled, runs.values())
    perf, ratio = perf_verdict(base_frame, new_frame, max_regression=opts.max_regression,
                               seed=opts.seed)
    checks.append(perf)
    return GateReport(base.url, new.url, checks, base_summary, new_summary, ratio)


def _pooled(runs: Sequence[BenchRun]) -> tuple[pd.DataFrame, BenchSummary]:
    """All rounds of one side as one frame and summary: wall times add up, and each round's
    token events are shifted by the whole seconds before it, so windows stay aligned to
    each round's start."""
    if len(runs) == 1:
        return runs[0].frame, runs[0].summary
    frame = pd.concat([r.frame for r in runs], ignore_index=True)
    events, shift = [], 0.0
    for r in runs:
        e = token_events(r.load.results, r.load.start_clock)
        events.append(e + [shift, 0.0])
        shift += math.ceil(r.load.duration)
    return frame, summarize(frame, sum(r.load.duration for r in runs), np.concatenate(events))


def gate_stored(store, base_run: str, new_run: str,
                opts: GateOptions = GateOptions()) -> GateReport:
    """The gate over two stored bench runs: parity on shared greedy rids, accept, perf."""
    base_frame, base_cfg, base_rows = load_bench_run(store, base_run)
    new_frame, new_cfg, new_rows = load_bench_run(store, new_run)
    a, b = _greedy_rows(base_rows), _greedy_rows(new_rows)
    shared = sorted(set(a) & set(b))
    if not shared:
        parity = GateCheck("greedy parity", None, "no greedy request shared by both runs")
    else:
        def result(row) -> RequestResult:
            ids = None if row.output_tokens is None else [int(t) for t in row.output_tokens]
            return RequestResult(row.rid, 0.0, ok=True, output_ids=ids,
                                 completion_tokens=int(row.completion_tokens))
        pairs = [(result(a[rid]), result(b[rid])) for rid in shared]
        if any(x.output_ids is None or y.output_ids is None for x, y in pairs):
            parity = GateCheck("greedy parity", None, "stored runs hold no output token ids")
        else:
            parity = check_parity([x for x, _ in pairs], [y for _, y in pairs])
    accept = check_accept_length(float(base_frame["accept_length"].mean()),
                                 float(new_frame["accept_length"].mean()), opts.accept_tol)
    contamination = GateCheck("contamination", None, "needs live servers (gate BASE_URL NEW_URL)")
    perf, ratio = perf_verdict(base_frame, new_frame, max_regression=opts.max_regression,
                               seed=opts.seed)
    return GateReport(base_run, new_run, [parity, accept, contamination, perf],
                      BenchSummary.from_dict(base_cfg["summary"]),
                      BenchSummary.from_dict(new_cfg["summary"]), ratio)


def _greedy_rows(rows: pd.DataFrame) -> dict[str, Any]:
    """Stored greedy requests that finished, by rid."""
    return {r.rid: r for r in rows.itertuples()
            if r.temperature == 0 and r.finish_reason != "abort"}
