"""``dspark-obs engine-server | collect | drive | sglang launch``: SGLang integration."""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dspark_obs.cli.run import DraftVocabOpt
from dspark_obs.cli.store import StoreOpt

if TYPE_CHECKING:  # torch-backed: imported only when a command needs it
    from dspark_obs.engine.session import Models

sglang_app = typer.Typer(
    help="SGLang DSpark servers: launch profiles (compact + cap-accept companion).",
    no_args_is_help=True,
)


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(1)


def _tiny_models(seed: int, gamma: int) -> Models:
    """``--tiny``'s random byte-vocabulary models (from the testing package: test serving)."""
    from dspark_obs.testing.tiny_models import byte_models

    return byte_models(seed, gamma_max=max(gamma, 5))


def engine_server_command(
    port: Annotated[int, typer.Option(help="Port (0: a free one, printed).")] = 30000,
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    mode: Annotated[
        str | None,
        typer.Option(
            help="static | compact | cap-accept (default: $SGLANG_RAGGED_VERIFY_MODE, "
            "else static, as SGLang)."
        ),
    ] = None,
    gamma: Annotated[int, typer.Option(help="Draft block size.")] = 5,
    lag: Annotated[
        int | None,
        typer.Option(help="Relay lag (default: $SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS or 2)."),
    ] = None,
    max_batch: Annotated[int, typer.Option(help="Continuous-batching capacity.")] = 16,
    cost_table: Annotated[
        Path | None, typer.Option(help="SGLang SPS cost table JSON (CPU default: shipped table).")
    ] = None,
    sts: Annotated[Path | None, typer.Option(help="SGLang STS temperatures JSON.")] = None,
    drafter: Annotated[Path | None, typer.Option(help="Drafter checkpoint directory.")] = None,
    tiny: Annotated[
        bool, typer.Option("--tiny", help="A tiny random model over bytes (fast; for tests).")
    ] = False,
    device: Annotated[str, typer.Option(help="cpu | cuda.")] = "cpu",
    draft_vocab: DraftVocabOpt = None,
    dump: Annotated[
        str | None,
        typer.Option(
            help="Step-dump components, comma list or 'all' (default: "
            "$SGLANG_DSPARK_DEBUG_DUMP, else all)."
        ),
    ] = None,
    max_records: Annotated[int, typer.Option(help="Step-dump ring buffer size.")] = 200_000,
    estimator_path: Annotated[
        Path | None,
        typer.Option(
            help="Block-accept estimator JSONL (default: "
            "$SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH; compact mode writes it)."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the --tiny model's weights.")] = 0,
) -> None:
    """Serve the embedded DSpark engine with SGLang's HTTP API (/generate, OpenAI chat,
    /server_info step dump, /metrics, /set_internal_state), so the collector, the driver and
    any OpenAI client work against it without a GPU."""
    from dspark_obs.cost_table import CostTableError
    from dspark_obs.engine.types import EngineError
    from dspark_obs.sglang.engine_server import (
        EngineServer,
        ServerError,
        ServerOptions,
        build_service,
        server_limits,
    )

    opts = ServerOptions(
        host=host,
        port=port,
        mode=mode,
        gamma=gamma,
        lag=lag,
        max_batch=max_batch,
        cost_table=cost_table,
        sts=sts,
        drafter=drafter,
        device=device,
        draft_vocab=draft_vocab,
        dump=dump,
        max_records=max_records,
        estimator_path=estimator_path,
    )
    try:
        service = build_service(opts, models=_tiny_models(seed, gamma) if tiny else None)
        server = EngineServer(service, host, port, server_limits(service, opts))
    except (ServerError, EngineError, CostTableError, OSError, ValueError) as exc:
        _fail(str(exc))
    cfg = service.engine.cfg
    typer.echo(
        f"engine-server {service.config.model_name} mode={cfg.mode} gamma={cfg.gamma} "
        f"listening on {server.url}",
        err=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.httpd.shutdown).start())
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


def collect_command(
    url: Annotated[
        str | None, typer.Option(help="The (compact) server, e.g. http://127.0.0.1:30000.")
    ] = None,
    companion_url: Annotated[
        str | None, typer.Option(help="Its cap-accept companion server.")
    ] = None,
    targets: Annotated[
        Path | None,
        typer.Option(
            help="A fleet: Prometheus file_sd JSON/YAML ([{targets, labels}]); pair a "
            "companion with labels dspark_pair=<name> + dspark_role=cap-accept."
        ),
    ] = None,
    run_id: Annotated[
        str | None, typer.Option(help="Run id (default: random; with --targets: the prefix).")
    ] = None,
    companion_run_id: Annotated[
        str | None, typer.Option(help="Companion run id (default: RUN-cap).")
    ] = None,
    store: StoreOpt = Path("store"),
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help="Also serve the records (and per-target collector "
            "counters) as Prometheus /metrics here."
        ),
    ] = None,
    otlp_endpoint: Annotated[
        str | None, typer.Option(help="Also export OpenTelemetry metrics (OTLP/HTTP).")
    ] = None,
    estimator_jsonl: Annotated[
        Path | None, typer.Option(help="The server's SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH.")
    ] = None,
    companion_estimator_jsonl: Annotated[
        Path | None, typer.Option(help="The companion's estimator JSONL.")
    ] = None,
    clear: Annotated[
        bool,
        typer.Option(
            "--clear/--dedupe",
            help="Clear the server's ring buffer after each read "
            "(small reads; steps between read and clear are lost, reported) or "
            "de-duplicate.",
        ),
    ] = False,
    interval: Annotated[float, typer.Option(help="Seconds between polls.")] = 1.0,
    duration: Annotated[
        float | None, typer.Option(help="Stop after this many seconds (default: Ctrl-C).")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Bound on one whole poll (s).")] = 30.0,
    workload_file: Annotated[
        Path | None, typer.Option(help="Traffic JSONL the driver sends: labels rids by workload.")
    ] = None,
    ring_size: Annotated[
        int,
        typer.Option(
            help="A hint: the server's ring buffer size (loss is found from "
            "forward_ct whatever it is; this only dates loss before the first read)."
        ),
    ] = 200_000,
    workers: Annotated[int, typer.Option(help="Servers polled at once (fleets).")] = 8,
) -> None:
    """Poll SGLang /server_info step dumps (every DP rank), tail the estimator JSONL, scrape
    /metrics, and store it all (plus a runs row with mode, gamma, model, drafter) through the
    same sinks as the engine. Faults are reported and retried; nothing is stored twice.
    Exits 1 when no poll of some server succeeded."""
    from dspark_obs.engine.session import new_run_id
    from dspark_obs.sglang.collector import CollectError, Collector, CollectorOptions
    from dspark_obs.sglang.fleet import CollectorMetrics, TargetsError, read_targets
    from dspark_obs.store import Store, StoreError

    if (url is None) == (targets is None):
        _fail("give --url (and optionally --companion-url) or --targets FILE")
    workloads = temperature = workload = None
    if workload_file is not None:
        from dspark_obs.workloads import WorkloadFileError, load_traffic

        try:
            traffic = load_traffic(workload_file)
        except (WorkloadFileError, OSError) as exc:
            _fail(str(exc))
        workloads = {t.rid: t.prompt.workload for t in traffic}
        temps = {t.temperature for t in traffic}
        temperature = temps.pop() if len(temps) == 1 else None
        names = set(workloads.values())
        workload = names.pop() if len(names) == 1 else "mixed"
    state_dir = Path(store) / ".collector"
    common = {
        "clear": clear,
        "timeout_s": timeout,
        "workloads": workloads,
        "temperature": temperature,
        "workload": workload,
        "state_dir": state_dir,
        "ring_size": ring_size,
    }
    if targets is not None:
        try:
            fleet = read_targets(targets, run_id or "sglang")
        except TargetsError as exc:
            _fail(str(exc))
        servers = [
            CollectorOptions(
                t.url, t.run_id, companion_of=t.companion_of, labels=t.labels, **common
            )
            for t in fleet
        ]
    else:
        run_id = run_id or new_run_id("sglang")
        servers = [CollectorOptions(url, run_id, estimator_path=estimator_jsonl, **common)]
        if companion_url:
            servers.append(
                CollectorOptions(
                    companion_url,
                    companion_run_id or f"{run_id}-cap",
                    companion_of=run_id,
                    estimator_path=companion_estimator_jsonl,
                    **common,
                )
            )
    try:
        sinks = [Store(store)]
        for o in servers:  # without its state a collector cannot tell stored steps from new
            state = state_dir / f"{_safe_name(o.run_id)}.json"
            if not state.is_file() and stored_step_keys(sinks[0], o.run_id):
                _fail(
                    f"run {o.run_id} already has steps in {store} but no collector state "
                    f"({state}): collect into a new --run-id"
                )
        if metrics_port is not None or otlp_endpoint is not None:
            from dspark_obs.sinks import telemetry_sinks

            sinks += telemetry_sinks(metrics_port, otlp_endpoint)
        col = Collector(
            servers,
            sinks,
            interval_s=interval,
            workers=workers,
            report=lambda run, msg: typer.echo(f"[{run}] {msg}", err=True),
        )
    except (StoreError, ValueError, OSError, CollectError) as exc:
        _fail(str(exc))
    for sink in sinks:
        if getattr(sink, "registry", None) is not None and hasattr(sink, "server"):
            sink.registry.register(CollectorMetrics(col))  # type: ignore[attr-defined]
    typer.echo("collecting " + ", ".join(f"{o.url} -> run {o.run_id}" for o in servers), err=True)
    signal.signal(signal.SIGTERM, lambda *_: col.stop())
    try:
        with contextlib.suppress(KeyboardInterrupt):
            col.run(duration)
        col.finish()
    except (StoreError, OSError) as exc:  # the store refused a write: stop, nothing half-done
        _fail(f"store {store}: {exc}")
    dead = []
    for sc in col.servers:
        t = sc.totals
        typer.echo(
            f"{sc.opts.run_id}: {t.polls} polls ({t.failed_polls} failed), {t.steps} steps and "
            f"{t.req_steps} request-steps stored, {t.rejected} rejected, {t.bad_records} bad "
            f"records left out, {t.restarts} restarts, {t.lost_ranges} lost ranges "
            f"({t.lost_forward_cts} forward_cts), {t.estimator_lines} estimator lines"
            + (f" ({t.late_lines} late)" if t.late_lines else ""),
        )
        for note in t.restart_notes:
            typer.echo(f"  {note}")
        for gap in sc.gaps[:20]:
            typer.echo(f"  {gap}")
        rec = sc.reconcile()
        if rec:
            typer.echo(f"  {rec}")
        if not t.useful:
            dead.append(f"{sc.opts.url}: every poll failed ({t.last_error or 'no poll ran'})")
    if dead:
        for d in dead:
            typer.echo(f"error: {d}", err=True)
        raise typer.Exit(1)


def drive_command(
    url: Annotated[str, typer.Option(help="The (compact) server.")],
    run_id: Annotated[str, typer.Option(help="The run its requests belong to (as collected).")],
    companion_url: Annotated[str | None, typer.Option(help="Its cap-accept companion.")] = None,
    companion_run_id: Annotated[
        str | None, typer.Option(help="Companion run id (default: RUN-cap).")
    ] = None,
    workload: Annotated[str, typer.Option(help="math | chat | poetry | mixed | random.")] = "mixed",
    workload_file: Annotated[
        Path | None, typer.Option(help="Send this traffic JSONL instead (dspark_obs.workloads).")
    ] = None,
    requests: Annotated[int, typer.Option("--requests", "-n", help="How many requests.")] = 24,
    max_new_tokens: Annotated[int, typer.Option(help="Per-request output limit.")] = 64,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0 = greedy).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seeds prompts, order, per-request sampling.")] = 0,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at most.")] = 4,
    request_rate: Annotated[
        float, typer.Option(help="Poisson arrivals per second (inf: all at once).")
    ] = math.inf,
    api: Annotated[str, typer.Option(help="sglang (/generate) | openai (chat completions).")] = (
        "openai"
    ),
    store: StoreOpt = Path("store"),
) -> None:
    """Send the same seeded mixed workload to a server and its companion, one after the other,
    and store each request's meta_info and timings (TTFT, TPOT) as requests rows."""
    from dspark_obs.serving.bench_requests import build_requests, requests_from_traffic
    from dspark_obs.serving.client import ClientError
    from dspark_obs.sglang.drive import DriveTarget, drive
    from dspark_obs.store import Store, StoreError

    try:
        if workload_file is not None:
            from dspark_obs.workloads import load_traffic

            reqs = requests_from_traffic(load_traffic(workload_file))
        else:
            reqs = build_requests(
                workload, requests, output_len=max_new_tokens, seed=seed, temperature=temperature
            )
        targets = [DriveTarget(url, run_id)]
        if companion_url:
            targets.append(DriveTarget(companion_url, companion_run_id or f"{run_id}-cap"))
        out = drive(
            targets,
            reqs,
            [Store(store)],
            api=api,
            concurrency=concurrency,
            request_rate=request_rate,
            seed=seed,
        )
    except (ClientError, StoreError, ValueError, OSError) as exc:
        _fail(str(exc))
    failed = []
    for run, results in out.items():
        ok = [r for r in results if r.ok]
        typer.echo(
            f"{run}: {len(ok)}/{len(results)} ok, {sum(r.completion_tokens for r in ok)} tokens"
        )
        for r in results:
            if not r.ok:
                typer.echo(f"  {r.rid}: {r.error}", err=True)
        if not ok:
            first = next((r.error for r in results if r.error), "no requests sent")
            failed.append(f"{run}: no request succeeded (first error: {first})")
    if failed:
        for f in failed:
            typer.echo(f"error: {f}", err=True)
        raise typer.Exit(1)


def ingest_dump_command(
    path: Annotated[Path, typer.Argument(help="A saved /server_info body or dspark_info_record.")],
    run_id: Annotated[str, typer.Option(help="The run to store it as.")],
    companion_of: Annotated[
        str | None, typer.Option(help="For a cap-accept dump: the compact run it shadows.")
    ] = None,
    sps_records: Annotated[
        Path | None, typer.Option(help="Also the SPS profiler's <stem>.records.jsonl.")
    ] = None,
    store: StoreOpt = Path("store"),
) -> None:
    """Store a saved SGLang step dump (with its runs row: mode, gamma, model, drafter)."""
    from dspark_obs.fanout import FanOut
    from dspark_obs.sglang import DumpError, ingest_dump
    from dspark_obs.sglang.files import read_sps_records
    from dspark_obs.store import Store, StoreError

    try:
        st = Store(store)
        fan = FanOut([st])
        res = ingest_dump(
            path.read_bytes(),
            run_id,
            fan,
            companion_of=companion_of,
            stored=lambda run: stored_step_keys(st, run),
        )
        typer.echo(
            f"{run_id}: {res.steps} steps and {res.req_steps} request-steps newly "
            f"stored, {res.already_stored} steps already stored, {res.rejected} "
            f"rejected, {len(res.errors)} bad records left out"
        )
        for e in res.errors[:10]:
            typer.echo(f"  {path}: {e}", err=True)
        if sps_records is not None:
            table, errors = read_sps_records(sps_records, f"{run_id}-sps")
            fan.emit(
                "runs",
                [{**res.run, "run_id": f"{run_id}-sps", "mode": "static", "companion_of": None}],
            )
            fan.emit("steps", table)
            typer.echo(f"{run_id}-sps: {table.num_rows} profiler steps, {len(errors)} bad lines")
            for e in errors[:10]:
                typer.echo(f"  {sps_records}: {e}", err=True)
        for e in fan.errors[:10]:
            typer.echo(f"  rejected {e}", err=True)
        fan.close()
    except (DumpError, StoreError, OSError) as exc:
        _fail(f"{path}: {exc}")
    if res.steps == 0 and res.already_stored == 0:
        _fail(f"{path}: nothing stored: no valid step record in the dump")


def _safe_name(run_id: str) -> str:
    from dspark_obs.sglang.collector import state_name

    return state_name(run_id)


def stored_step_keys(store: object, run_id: str) -> set[tuple[int, int]]:
    """The (dp_rank, forward_ct) keys of ``run_id`` already in the store."""
    quoted = run_id.replace("'", "''")
    rows = store.query(  # type: ignore[attr-defined]
        f"SELECT dp_rank, forward_ct FROM steps WHERE run_id = '{quoted}'"
    ).to_pylist()
    return {(int(r["dp_rank"]), int(r["forward_ct"])) for r in rows}


def launch_command(
    target: Annotated[str, typer.Option(help="Target model path or HF id.")],
    drafter: Annotated[str, typer.Option(help="DSpark drafter path (with a confidence head).")],
    gamma: Annotated[int, typer.Option(help="Draft block size.")] = 5,
    port: Annotated[int, typer.Option(help="Compact server port.")] = 30000,
    companion_port: Annotated[int, typer.Option(help="Cap-accept companion port.")] = 30001,
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    sps_table: Annotated[str | None, typer.Option(help="SPS cost table JSON.")] = None,
    sts: Annotated[str | None, typer.Option(help="STS temperatures JSON.")] = None,
    lag: Annotated[int, typer.Option(help="Confidence relay lag (steps).")] = 2,
    out_dir: Annotated[str, typer.Option(help="Where estimator JSONL and STS shards go.")] = (
        "sglang-out"
    ),
    run: Annotated[
        bool, typer.Option("--run/--print", help="Start both servers, or print the commands.")
    ] = False,
) -> None:
    """The command lines and environments of a compact DSpark server and its cap-accept
    companion (step dump with reqs, estimator JSONL, STS shards, SPS table, relay lag)."""
    from dspark_obs.sglang.profiles import LaunchError, launch, server_profiles

    try:
        profiles = server_profiles(
            target,
            drafter,
            gamma=gamma,
            host=host,
            port=port,
            companion_port=companion_port,
            sps_table=sps_table,
            sts=sts,
            lag=lag,
            out_dir=out_dir,
        )
        if not run:
            for p in profiles:
                typer.echo(f"# {p.role}: {p.url}\n{p.shell()}\n")
            est = profiles[0].env["SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH"]
            typer.echo(
                f"# then: dspark-obs collect --url {profiles[0].url} "
                f"--companion-url {profiles[1].url} --estimator-jsonl {est}"
            )
            return
        procs = launch(profiles)
    except LaunchError as exc:
        _fail(str(exc))
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        codes = [p.wait() for p in procs]
    sys.exit(max(codes))


def register(app: typer.Typer) -> None:
    app.command("engine-server")(engine_server_command)
    app.command("collect")(collect_command)
    app.command("drive")(drive_command)
    app.command("ingest-dump")(ingest_dump_command)
    sglang_app.command("launch")(launch_command)
    app.add_typer(sglang_app, name="sglang")
