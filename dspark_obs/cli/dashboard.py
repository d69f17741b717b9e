"""``dspark-obs dashboard``: the Streamlit analysis app over a store, on 127.0.0.1.

The app lives in the repository's top-level ``dashboards/streamlit/`` (not inside the
package). It is found, in order: $DSPARK_OBS_DASHBOARDS, the checkout this package was
installed from (editable installs), the current directory's ``dashboards/``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from dspark_obs.cli.store import StoreOpt

DASHBOARDS_ENV = "DSPARK_OBS_DASHBOARDS"
ENTRY = Path("streamlit") / "Overview.py"
DEFAULT_PORT = 8501


def dashboards_dir() -> Path:
    """The dashboards/ folder holding streamlit/Overview.py; a clear error when none is found."""
    candidates = []
    if os.environ.get(DASHBOARDS_ENV):
        candidates.append(Path(os.environ[DASHBOARDS_ENV]))
    candidates.append(Path(__file__).resolve().parents[2] / "dashboards")
    candidates.append(Path.cwd() / "dashboards")
    for c in candidates:
        if (c / ENTRY).is_file():
            return c.resolve()
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"the Streamlit app ({ENTRY}) is not in any of: {tried}; "
        f"set ${DASHBOARDS_ENV} to the repository's dashboards/ folder"
    )


def streamlit_command(entry: Path, host: str, port: int) -> list[str]:
    """The streamlit command line (headless, no usage statistics, no file watcher)."""
    return [
        sys.executable, "-m", "streamlit", "run", str(entry),
        "--server.address", host,
        "--server.port", str(port),
        "--server.headless", "true",
        "--server.fileWatcherType", "none",
        "--browser.gatherUsageStats", "false",
        "--client.toolbarMode", "minimal",
    ]  # fmt: skip


def dashboard_command(
    store: StoreOpt = Path("store"),
    port: Annotated[int, typer.Option(help="HTTP port of the app.")] = DEFAULT_PORT,
    host: Annotated[
        str, typer.Option(help="Bind address (loopback by default; 0.0.0.0 exposes it).")
    ] = "127.0.0.1",
) -> None:
    """Open the analysis app (Overview, Windows, Ceiling, Calibration, Cost model, Requests,
    Compare) over the store, read-only; it keeps working while a run is being ingested.

    Stop with Ctrl-C.
    """
    try:
        entry = dashboards_dir() / ENTRY
    except FileNotFoundError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if not store.exists():
        typer.echo(f"note: no store at {store} yet; the pages say which command fills it", err=True)
    # The pages import ``dashboards.streamlit...`` as a package: the checkout root goes on
    # the path, so the app starts from any working directory.
    root = entry.parents[2]
    paths = (str(root), os.environ.get("PYTHONPATH", ""))
    env = {
        **os.environ,
        "DSPARK_OBS_STORE": str(store.resolve()),
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
    }
    typer.echo(f"dashboard: http://{host}:{port}/  (store {store.resolve()}; Ctrl-C stops)")
    cmd = streamlit_command(entry, host, port)
    sys.stdout.flush()
    # Become the Streamlit server (exec, no child process): a signal to this process
    # (Ctrl-C, SIGTERM from a supervisor or a test) reaches the server itself.
    os.execve(cmd[0], cmd, env)


def register(app: typer.Typer) -> None:
    app.command("dashboard")(dashboard_command)
