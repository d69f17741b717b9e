"""Serving commands: ``bench`` (latency/throughput of one server) and ``gate`` (the A/B gate).

Both speak SGLang's ``/generate`` and OpenAI's ``/v1/chat/completions`` over HTTP, so they
work against a real SGLang DSpark server, any OpenAI-compatible server, and
``dspark-obs engine-server``. Errors print one line on stderr, never a traceback.
"""

from __future__ import annotations

import json
import math
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from dspark_obs.cli.store import StoreOpt
from dspark_obs.serving.bench_records import BenchRunError
from dspark_obs.serving.bench_requests import BENCH_WORKLOADS, build_requests
from dspark_obs.serving.bench_stats import PEAK_CAVEAT, BenchSummary
from dspark_obs.serving.client import ClientError, ServingClient
from dspark_obs.serving.gate import GateReport
from dspark_obs.serving.loadgen import LoadPlan
from dspark_obs.serving.runner import GateOptions, gate_servers, gate_stored, run_bench


class Api(StrEnum):
    sglang = "sglang"
    openai = "openai"


def _fail(message: str, code: int = 1) -> typer.Exit:
    Console(stderr=True).print(Text.assemble(("error: ", "bold red"), message))
    return typer.Exit(code)


def _progress(total: int, label: str) -> Progress:
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=False)


def _check_workload(workload: str) -> None:
    if workload not in BENCH_WORKLOADS:
        raise _fail(f"unknown workload {workload!r}; expected one of {', '.join(BENCH_WORKLOADS)}")


def _summary_lines(s: BenchSummary) -> list[str]:
    def dist(name: str, d) -> str:
        return f"{name:<22} mean {d.mean:9.2f}  median {d.median:9.2f}  p99 {d.p99:9.2f}"
    return [
        f"requests               {s.completed} ok, {s.failed} failed, {s.duration_s:.2f} s wall",
        f"output tokens          {s.output_tokens}",
        f"output throughput      {s.output_throughput:.2f} tok/s (all output tokens / wall time)",
        f"peak throughput        {s.peak_output_throughput:.2f} tok/s  phase band "
        f"[{s.peak_phase_band[0]:.2f}, {s.peak_phase_band[1]:.2f}]",
        f"  note: {PEAK_CAVEAT}",
        dist("TTFT (ms)", s.ttft_ms),
        dist("TPOT (ms, excl. TTFT)", s.tpot_ms),
        dist("E2E (ms)", s.e2e_ms),
        dist("accept length", s.accept_length),
        f"accept length, pooled  {s.accept_length_pooled:.3f} (all tokens / all verify steps)",
        f"derived step time      {s.derived_step_ms:.2f} ms (mean TPOT x mean accept length)"
        if math.isfinite(s.derived_step_ms) else
        "derived step time      n/a (the server reported no spec meta_info)",
    ]


def bench_command(
    url: Annotated[str, typer.Option("--url", help="Server base URL, e.g. "
                                     "http://127.0.0.1:30000 (SGLang or OpenAI-compatible).")],
    api: Annotated[Api, typer.Option(help="sglang: token/text prompts via /generate; openai: "
                                     "/v1/completions. Chat prompts always use "
                                     "/v1/chat/completions.")] = Api.sglang,
    workload: Annotated[str, typer.Option(help="random (fixed-length random-token prompts) or "
                                          "a built-in source: math, chat, poetry, mixed.")]
    = "random",
    n: Annotated[int, typer.Option("-n", "--num-requests", help="Measured requests.")] = 32,
    input_len: Annotated[int, typer.Option(help="Prompt tokens (random workload).")] = 256,
    output_len: Annotated[int, typer.Option(help="Output tokens (random: exact, ignore_eos; "
                                            "sources: at most).")] = 64,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at most.")] = 1,
    request_rate: Annotated[float, typer.Option(help="Poisson arrivals per second "
                                                "(inf: all at once).")] = math.inf,
    warmup: Annotated[int, typer.Option(help="Warm-up requests, excluded.")] = 2,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0 greedy).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Fixes prompts, arrivals, sampling seeds.")] = 0,
    vocab_size: Annotated[int, typer.Option(help="Random ids are drawn below this "
                                            "(match the target's vocabulary).")] = 32000,
    model: Annotated[str, typer.Option(help="'model' field of OpenAI requests.")] = "default",
    run_id: Annotated[str | None, typer.Option(help="Store the run under this id "
                                               "(default: bench-<time>).")] = None,
    store: StoreOpt = Path("store"),
    no_store: Annotated[bool, typer.Option("--no-store", help="Do not write the store.")]
    = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the summary and "
                                                  "per-request figures here.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds per request.")] = 600.0,
) -> None:
    """Benchmark one server: TTFT, TPOT (TTFT excluded), E2E, throughput, accept length.

    Warm-up requests are excluded; the summary gives mean/median/p99, output throughput (all
    output tokens / wall time), the peak over fixed 1-s windows with its phase band, the
    accept length from SGLang's meta_info and the derived step time (mean TPOT x mean
    accept length). The run goes to the store (runs row of source 'bench' + requests).
    """
    _check_workload(workload)
    try:
        client = ServingClient(url, api=api.value, model=model, timeout=timeout)
        requests = build_requests(workload, n, input_len=input_len, output_len=output_len,
                                  seed=seed, temperature=temperature, vocab_size=vocab_size)
    except (ClientError, ValueError) as exc:
        raise _fail(str(exc)) from None
    with _progress(n, f"bench {url}") as bar:
        task = bar.add_task("bench", total=n)
        try:
            plan = LoadPlan(concurrency, request_rate, warmup, seed)
            result = run_bench(client, requests, plan, on_done=lambda _r: bar.advance(task))
        except (ClientError, ValueError) as exc:
            raise _fail(str(exc)) from None
    s = result.summary
    for line in _summary_lines(s):
        print(line)
    errors = [r for r in result.load.results if not r.ok]
    for r in errors[:3]:
        Console(stderr=True).print(f"failed {r.rid}: {r.error}")
    config = {"url": client.url, "api": api.value, "workload": workload, "n": n,
              "input_len": input_len, "output_len": output_len, "concurrency": concurrency,
              "request_rate": request_rate, "warmup": warmup, "seed": seed,
              "temperature": temperature}
    run_id = run_id or _default_run_id(result.load.start_time)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"run_id": run_id, "config": config, "server": result.server,
                   "summary": s.to_dict(), "requests": result.frame.to_dict(orient="records")}
        json_out.write_text(json.dumps(payload, indent=1, default=str))
    if not no_store:
        from dspark_obs.fanout import FanOut
        from dspark_obs.store import Store

        run_row, rows = result.records(run_id, config)
        fan = FanOut([Store(store)])
        fan.emit("runs", [run_row])
        fan.emit("requests", rows)
        fan.close()
        for err in fan.errors:
            Console(stderr=True).print(f"rejected: {err}")
        print(f"stored as run {run_id} in {store}")
    print("rerun: " + _rerun_line("bench", {"url": client.url, "api": api.value, **config,
                                             "vocab-size": vocab_size, "run-id": run_id}))
    if errors:
        raise typer.Exit(1)


def _default_run_id(start: float) -> str:
    import datetime as dt

    return "bench-" + dt.datetime.fromtimestamp(start, tz=dt.UTC).strftime("%Y%m%dT%H%M%S")


def _rerun_line(command: str, options: dict) -> str:
    """The command line that reruns this benchmark (same workload, seed and settings)."""
    flags = [f"-n {v}" if k == "n" else f"--{k.replace('_', '-')} {v}"
             for k, v in options.items()]
    return " ".join([f"dspark-obs {command}", *flags])


_URL = re.compile(r"^(https?://|[\w.-]+:\d+)")


def gate_command(
    base: Annotated[str, typer.Argument(help="BASE: a server URL or a stored bench run id.")],
    new: Annotated[str, typer.Argument(help="NEW: a server URL or a stored bench run id.")],
    prompts: Annotated[int, typer.Option(help="Greedy parity prompts.")] = 8,
    parity_tokens: Annotated[int, typer.Option(help="Tokens per parity generation.")] = 256,
    parity_workload: Annotated[str, typer.Option(help="Prompts for parity and "
                                                 "contamination.")] = "mixed",
    accept_tol: Annotated[float, typer.Option(help="Allowed |accept length NEW - BASE|.")]
    = 0.05,
    bench_workload: Annotated[str, typer.Option(help="Workload of the performance "
                                                "comparison.")] = "mixed",
    bench_requests: Annotated[int, typer.Option(help="Measured requests per side and "
                                                "round.")] = 16,
    input_len: Annotated[int, typer.Option(help="Prompt tokens (random workloads).")] = 256,
    output_len: Annotated[int, typer.Option(help="Output tokens per bench request.")] = 64,
    concurrency: Annotated[int, typer.Option(help="Bench concurrency (1: batch-1 decode).")]
    = 1,
    rounds: Annotated[int, typer.Option(help="BASE/NEW bench rounds, alternated.")] = 1,
    warmup: Annotated[int, typer.Option(help="Warm-up requests per bench, excluded.")] = 1,
    max_regression: Annotated[float, typer.Option(help="Fail only when the derived step "
                                                  "time ratio's whole 95% interval lies above "
                                                  "1 + this.")] = 0.03,
    seed: Annotated[int, typer.Option(help="Fixes prompts and sampling seeds.")] = 0,
    vocab_size: Annotated[int, typer.Option(help="Random ids are drawn below this.")] = 32000,
    api: Annotated[Api, typer.Option(help="sglang or openai (token prompts).")] = Api.sglang,
    report: Annotated[Path | None, typer.Option(help="Write the Markdown report here.")]
    = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the verdict, checks "
                                                  "and both summaries as JSON here.")] = None,
    store: StoreOpt = Path("store"),
    timeout: Annotated[float, typer.Option(help="Seconds per request.")] = 600.0,
) -> None:
    """A/B gate of two DSpark servers (or two stored bench runs); exit 0 pass, 1 fail.

    Correctness first: byte-exact greedy parity of N prompts x 256 tokens (first differing
    token and context on failure), accept length within 0.05, and a contamination check
    (NEW reruns each greedy prompt after a temperature-sampled request). Then performance:
    derived step time NEW/BASE with a bootstrap interval over requests, TPOT and
    throughput side by side. Prints (and writes with --report) a Markdown report.
    """
    _check_workload(parity_workload)
    _check_workload(bench_workload)
    opts = GateOptions(prompts=prompts, parity_tokens=parity_tokens,
                       parity_workload=parity_workload, accept_tol=accept_tol,
                       bench_workload=bench_workload, bench_requests=bench_requests,
                       bench_input_len=input_len, bench_output_len=output_len,
                       concurrency=concurrency, rounds=rounds, warmup=warmup,
                       max_regression=max_regression, seed=seed, vocab_size=vocab_size)
    urls = [bool(_URL.match(x)) for x in (base, new)]
    if urls[0] != urls[1]:
        raise _fail("give two server URLs or two stored run ids, not one of each")
    try:
        if urls[0]:
            clients = [ServingClient(u, api=api.value, timeout=timeout) for u in (base, new)]
            for c in clients:
                if not c.health():
                    raise ClientError(f"{c.url}/health does not answer")
            total = prompts * 4 + 2 * rounds * bench_requests
            with _progress(total, "gate") as bar:
                task = bar.add_task("gate", total=total)
                result = gate_servers(*clients, opts, on_done=lambda _r: bar.advance(task))
        else:
            from dspark_obs.store import Store

            result = gate_stored(Store(store), base, new, opts)
    except (ClientError, BenchRunError, ValueError) as exc:
        raise _fail(str(exc)) from None
    _finish(result, report, json_out)


def _finish(result: GateReport, report: Path | None, json_out: Path | None) -> None:
    text = result.to_markdown()
    print(text)
    for path, data in ((report, text), (json_out, None)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(data if data is not None else json.dumps(
                result.to_dict(), indent=1, default=str))
    raise typer.Exit(0 if result.passed else 1)


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_command)
    app.command("gate")(gate_command)
