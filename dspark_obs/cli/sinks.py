"""``dspark-obs serve``: Prometheus /metrics from a store, live or replayed."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Annotated

import typer

from dspark_obs.cli.store import StoreOpt

DEFAULT_PORT = 9464  # the port OpenTelemetry's Prometheus exporter uses by default


def serve_command(
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            help="Follow the store: every row already there, then new segments of any run "
            "(whoever writes them) within --interval seconds.",
        ),
    ] = False,
    replay_run: Annotated[
        str | None,
        typer.Option("--replay", metavar="RUN", help="Re-play one stored run instead."),
    ] = None,
    speed: Annotated[
        float,
        typer.Option(help="Replay pace: 1 = as recorded, 10 = ten times faster, 0 = at once."),
    ] = 1.0,
    store: StoreOpt = Path("store"),
    port: Annotated[int, typer.Option(help="HTTP port for /metrics and /healthz.")] = DEFAULT_PORT,
    host: Annotated[
        str, typer.Option(help="Bind address (loopback by default; 0.0.0.0 exposes it).")
    ] = "127.0.0.1",
    interval: Annotated[float, typer.Option(help="Seconds between store polls.")] = 1.0,
    otlp_endpoint: Annotated[
        str | None,
        typer.Option(
            help="Also export over OTLP/HTTP to this base URL (or set OTEL_EXPORTER_OTLP_ENDPOINT)."
        ),
    ] = None,
) -> None:
    """Serve /metrics and /healthz for Prometheus, fed by a store (--follow) or a replayed run.

    Counters restart from what the store holds, so a restart of serve never makes them go
    backwards under --follow. Stop with Ctrl-C.
    """
    from rich.console import Console

    from dspark_obs.sinks.otel import OtelSink, otlp_configured
    from dspark_obs.sinks.prometheus import PrometheusSink
    from dspark_obs.sinks.serve import StoreFollower, replay, start_http

    console = Console(stderr=True)
    if follow == (replay_run is not None):
        console.print("[red]error:[/red] choose one feed: --follow, or --replay RUN")
        raise typer.Exit(2)
    if speed < 0 or interval <= 0:
        console.print("[red]error:[/red] --speed must be >= 0 and --interval > 0")
        raise typer.Exit(2)
    if not store.is_dir():
        console.print(f"[red]error:[/red] no store at {store} (set --store or $DSPARK_OBS_STORE)")
        raise typer.Exit(2)

    prom = PrometheusSink(background=False, resuming=follow)  # see adopt_current below
    sinks = [prom]
    if otlp_configured(otlp_endpoint):
        sinks.append(OtelSink(otlp_endpoint, aggregator=prom.aggregator))
    feed = FanIn(sinks)
    stop = threading.Event()
    state: dict = {"feed": "replay", "run": replay_run, "rows": 0, "done": False}
    follower = StoreFollower(store, feed, interval) if follow else None
    health = follower.health if follower else (lambda: dict(state))
    try:
        server = start_http(prom.registry, port, host, health)
    except OSError as exc:
        console.print(f"[red]error:[/red] cannot listen on {host}:{port}: {exc}")
        raise typer.Exit(2) from exc
    console.print(f"serving {server.url}/metrics and {server.url}/healthz (Ctrl-C stops)")
    try:
        if follower is not None:
            try:  # the store's totals so far: resumed series, not new ones born at 0
                follower.poll()
            except Exception as exc:  # noqa: BLE001 - as in follower.run: report, keep serving
                follower.problems.append(f"{type(exc).__name__}: {exc}")
            prom.adopt_current()
            follower.run(stop)
        else:
            try:
                state["rows"] = replay(store, replay_run, feed, speed, stop)
            except ValueError as exc:
                console.print(f"[red]error:[/red] {exc}")
                raise typer.Exit(2) from exc
            state["done"] = True
            console.print(f"replayed {state['rows']} rows of {replay_run}; still serving")
            stop.wait()
    except KeyboardInterrupt:
        stop.set()
    finally:
        server.close()
        feed.close()


class FanIn:
    """Hands stored (already validated) batches to every sink."""

    def __init__(self, sinks: list) -> None:
        self.sinks = sinks

    def write(self, table: str, batch) -> None:
        for sink in self.sinks:
            sink.write(table, batch)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
