"""``dspark-obs run``: run a workload through the embedded DSpark engine into the store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dspark_obs.cli.store import StoreOpt

WORKLOAD_CHOICES = ("math", "chat", "poetry", "mixed")


def run_command(
    workload: Annotated[
        str, typer.Option(help="math | chat | poetry | mixed (equal shares).")
    ] = "mixed",
    workload_file: Annotated[
        Path | None,
        typer.Option(
            "--workload-file", help="Replay a traffic JSONL (dspark-obs workloads file) instead."
        ),
    ] = None,
    requests: Annotated[int, typer.Option("--requests", "-n", help="How many requests.")] = 24,
    mode: Annotated[str, typer.Option(help="static | compact | cap-accept.")] = "compact",
    companion: Annotated[
        bool,
        typer.Option(
            "--companion", help="Also run the same requests in cap-accept, linked as the companion."
        ),
    ] = False,
    gamma: Annotated[int, typer.Option(help="Draft block size.")] = 5,
    lag: Annotated[int, typer.Option(help="Confidence relay lag (steps) for the budget.")] = 2,
    max_batch: Annotated[int, typer.Option(help="Continuous-batching capacity.")] = 8,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0 = greedy).")] = 0.0,
    max_new_tokens: Annotated[
        int | None, typer.Option(help="Per-request limit (default: per-workload defaults).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seeds prompt sampling, arrivals and sampling.")] = 0,
    split: Annotated[str, typer.Option(help="Prompt split: eval | train.")] = "eval",
    cost_table: Annotated[
        Path | None,
        typer.Option(
            help="SGLang SPS cost table JSON (CPU default: runtime/cost_tables/smollm2_cpu.json)."
        ),
    ] = None,
    sts: Annotated[
        Path | None, typer.Option(help="SGLang STS temperatures JSON for the drafter.")
    ] = None,
    drafter: Annotated[
        Path | None, typer.Option(help="Drafter checkpoint dir (default: runtime/drafter).")
    ] = None,
    store: StoreOpt = Path("store"),
    run_id: Annotated[str | None, typer.Option(help="Run id (default: random).")] = None,
    device: Annotated[str, typer.Option(help="cpu | cuda.")] = "cpu",
    estimator_rows: Annotated[
        str,
        typer.Option(
            help="Block-accept estimator fields: all (exact under top-k / top-p too) | sglang "
            "(none on greedy or top-k / top-p rows, as SGLang's recorder)."
        ),
    ] = "all",
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Expose the run live at http://127.0.0.1:PORT/metrics (Prometheus)."),
    ] = None,
    otlp_endpoint: Annotated[
        str | None,
        typer.Option(help="Export metrics and one span per request over OTLP/HTTP to this URL."),
    ] = None,
) -> None:
    """Run DSpark on SmolLM2-135M with the shipped drafter and store every step's records."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dspark_obs.analytics.sts import StsCalibration
    from dspark_obs.engine.costs import CostTableError
    from dspark_obs.engine.loop import EngineConfig, EngineError
    from dspark_obs.engine.session import (
        load_cost_table,
        load_models,
        new_run_id,
        run_with_companion,
        traffic_to_requests,
    )
    from dspark_obs.store import Store, StoreError
    from dspark_obs.workloads import WorkloadFileError, load_traffic, mixed_traffic

    console = Console(stderr=True)
    try:
        if workload not in WORKLOAD_CHOICES:
            raise EngineError(
                f"unknown workload {workload!r}; expected one of {list(WORKLOAD_CHOICES)}"
            )
        config = EngineConfig(
            mode=mode,
            gamma=gamma,
            lag_steps=lag,
            max_batch=max_batch,
            cost_table=load_cost_table(cost_table, device),
            estimator_rows=estimator_rows,
        )
        if workload_file is not None:
            traffic = load_traffic(workload_file)
            label = "file"
        else:
            shares = None if workload == "mixed" else {workload: 1.0}
            traffic = mixed_traffic(
                requests,
                shares,
                seed=seed,
                split=split,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
            )
            label = workload
        # every file is read and checked before the model loads and before the first record
        temps = None if sts is None else StsCalibration.load(sts, gamma=gamma).temperatures
        with console.status("loading SmolLM2-135M and the drafter"):
            models = load_models(drafter, device=device, sts=temps)
        reqs = traffic_to_requests(traffic, models.tokenizer)
        rid = run_id or new_run_id(mode)
        sink = Store(store)
        from dspark_obs.sinks.serve import telemetry_sinks

        live = telemetry_sinks(metrics_port, otlp_endpoint)
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as bar:
            tasks: dict[str, int] = {}

            def progress(name: str, done: int, total: int) -> None:
                if name not in tasks:
                    tasks[name] = bar.add_task(f"{name}", total=total)
                bar.update(tasks[name], completed=done)

            main, comp, fan = run_with_companion(
                models,
                reqs,
                config,
                [sink, *live],
                rid,
                companion=companion,
                workload=label,
                seed=seed,
                extra_config={"split": split, "device": device},
                progress=progress,
            )
        for r in (main, comp):
            if r is not None:
                sink.compact(run_id=r.run_id)  # one segment per table: faster queries
        sink.close()
        for live_sink in live:
            live_sink.close()
    except (EngineError, CostTableError, WorkloadFileError, StoreError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    except OSError as exc:  # e.g. a --workload-file that does not exist
        console.print(f"[red]error:[/red] {exc.filename or ''}: {exc.strerror or exc}")
        raise typer.Exit(2) from exc
    for res in (main, comp):
        if res is None:
            continue
        console.print(
            f"{res.run_id}: {res.requests} requests, {res.steps} steps, "
            f"{res.committed_tokens} tokens in {res.seconds:.1f}s "
            f"({res.tokens_per_second:.1f} tok/s), target processed {res.target_tokens}"
        )
    if fan.errors:
        console.print(
            f"[yellow]{len(fan.errors)} records rejected[/yellow]; first: {fan.errors[0]}"
        )
    typer.echo(rid)


def profile_command(
    out: Annotated[Path, typer.Option(help="Where to write the additive cost table JSON.")] = Path(
        "runtime/cost_tables/smollm2_cpu.json"
    ),
    batch_sizes: Annotated[str, typer.Option(help="Comma list of batch sizes.")] = "1,2,4,8,16",
    gamma: Annotated[int, typer.Option(help="Draft block size.")] = 5,
    drafter: Annotated[
        Path | None,
        typer.Option(
            help="Drafter checkpoint (default: runtime/drafter; a random one of the same shape "
            "if none exists: timing does not depend on weights)."
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu | cuda.")] = "cpu",
) -> None:
    """Measure compact step time at pinned budgets and fit SGLang's additive cost table."""
    from rich.console import Console

    from dspark_obs.engine.drafter import Drafter, DrafterConfig
    from dspark_obs.engine.profile import fit_table, profile_steps
    from dspark_obs.engine.session import DEFAULT_DRAFTER
    from dspark_obs.engine.weights import encode_chat, load_smollm2
    from dspark_obs.workloads import load_prompts

    console = Console(stderr=True)
    target, tok = load_smollm2(device=device)
    path = drafter or DEFAULT_DRAFTER
    if (path / "config.json").is_file():
        model = Drafter.load(path, target)
    else:
        console.print(f"no drafter at {path}: timing with a random drafter of the default shape")
        model = Drafter(DrafterConfig.for_target(target), target)
    model = model.to(device).eval()
    prompts = [encode_chat(tok, p.messages) for p in load_prompts("chat", "train", 16, seed=1)]
    sizes = [int(x) for x in batch_sizes.split(",")]
    samples = profile_steps(
        target, model, prompts, gamma=gamma, batch_sizes=sizes, progress=console.print
    )
    table = fit_table(samples)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.save(out)
    console.print(f"{len(samples)} steps; bias {table.bias_seconds * 1000:.1f} ms")
    typer.echo(str(out))


def train_drafter_command(
    out_dir: Annotated[
        Path, typer.Option(help="Checkpoints, generated data and the export.")
    ] = Path("out/drafter"),
    prompts_per_workload: Annotated[int, typer.Option(help="Train prompts per workload.")] = 1000,
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 2000,
    batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 32,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 5e-4,
    gamma: Annotated[
        int, typer.Option(help="Block size trained (the drafter serves any <= it).")
    ] = 7,
    max_new_tokens: Annotated[int, typer.Option(help="Target response length for the data.")] = 256,
    time_budget: Annotated[
        float | None, typer.Option(help="Stop (checkpointed) after seconds.")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the last checkpoint.")
    ] = False,
    device: Annotated[str, typer.Option(help="cpu (smoke runs) | cuda (the real run).")] = "cpu",
    seed: Annotated[int, typer.Option(help="Data and init seed.")] = 0,
) -> None:
    """Train a DSpark drafter for SmolLM2-135M on target-generated responses (DSpark loss)."""
    import torch

    from dspark_obs.engine.train import train_drafter
    from dspark_obs.engine.weights import load_smollm2, stop_token_ids

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target, tok = load_smollm2(device=device, dtype=dtype)
    res = train_drafter(
        target,
        tok,
        out_dir=out_dir,
        prompts_per_workload=prompts_per_workload,
        gamma=gamma,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        resume=resume,
        device=device,
        seed=seed,
        max_new_tokens=max_new_tokens,
        time_budget_s=time_budget,
        eos_ids=stop_token_ids(tok),
        log=lambda m: typer.echo(m, err=True),
    )
    typer.echo(str(res.export_dir))


def eval_drafter_command(
    drafter: Annotated[Path, typer.Option(help="Drafter checkpoint dir.")] = Path(
        "runtime/drafter"
    ),
    n: Annotated[int, typer.Option(help="EVAL prompts per workload.")] = 8,
    gamma: Annotated[int, typer.Option(help="Block size.")] = 5,
    temperatures: Annotated[str, typer.Option(help="Comma list; 0 = greedy.")] = "0,1",
    max_new_tokens: Annotated[int, typer.Option(help="Per prompt.")] = 128,
    device: Annotated[str, typer.Option(help="cpu | cuda.")] = "cpu",
    out: Annotated[Path | None, typer.Option(help="Write the JSON summary here.")] = None,
) -> None:
    """Full-block accept length, conditional acceptance and raw ECE per position (model card)."""
    from dspark_obs.engine.drafter_eval import main as eval_main

    argv = [
        "--drafter",
        str(drafter),
        "--n",
        str(n),
        "--gamma",
        str(gamma),
        "--temperatures",
        temperatures,
        "--max-new-tokens",
        str(max_new_tokens),
        "--device",
        device,
    ]
    if out is not None:
        argv += ["--out", str(out)]
    eval_main(argv)


def register(app: typer.Typer) -> None:
    app.command("run")(run_command)
    app.command("profile")(profile_command)
    app.command("train-drafter")(train_drafter_command)
    app.command("eval-drafter")(eval_drafter_command)
