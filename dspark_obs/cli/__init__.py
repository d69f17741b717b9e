"""The ``dspark-obs`` command: ``app`` (the Typer application) and ``main`` (its entry point).

Each area registers its own sub-commands from its module here; a command imports what it
runs when it runs, so ``dspark-obs --help`` does not load torch.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="dspark-obs",
    help="Observe DSpark speculative decoding: run it, store per-step records, recover the "
    "acceptance ceiling that compact verification hides, and report calibration and windows.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

# One module per area; each defines register(app). Kept in data-flow order for --help.
_AREAS = ("store", "engine", "run", "analytics", "sinks", "sglang", "bench", "dashboard")

for _area in _AREAS:
    try:
        _module = importlib.import_module(f"dspark_obs.cli.{_area}")
    except ModuleNotFoundError as exc:
        if exc.name != f"dspark_obs.cli.{_area}":
            raise
        continue
    _module.register(app)


def main() -> None:
    app()


__all__ = ["app", "main"]
