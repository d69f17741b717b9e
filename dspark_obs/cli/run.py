"""``dspark-obs run``: run a workload through the embedded DSpark engine into the store."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from dspark_obs.cli.store import StoreOpt

CompileOpt = Annotated[
    bool | None,
    typer.Option(
        "--compile/--no-compile",
        help="Fuse each layer's dense pieces with torch.compile (default: on for cuda).",
    ),
]

DraftVocabOpt = Annotated[
    int | None,
    typer.Option(
        help="Draft from the top-N training tokens only (runtime/drafter/draft_vocab.json; "
        "lossless, only acceptance can drop; 0: the whole vocabulary; default: 16384 on cpu, "
        "where the drafter's head costs about a target step, and 0 on cuda).",
        show_default=False,
    ),
]

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
            help="SGLang SPS cost table JSON. Default on the CPU: this host's table (dspark-obs "
            "profile --for-this-host), else the shipped runtime/cost_tables/smollm2_cpu_batched"
            ".json (smollm2_cpu.json for --backend reference), profiled on another machine "
            "(a warning says so); on cuda the shipped smollm2_h200.json.",
            show_default=False,
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
        typer.Option(
            help="Expose the run live at http://127.0.0.1:PORT/metrics (Prometheus), served by "
            "the child process that also writes the store and the OTLP export, so their work "
            "never slows the decode loop."
        ),
    ] = None,
    otlp_endpoint: Annotated[
        str | None,
        typer.Option(help="Export metrics and one span per request over OTLP/HTTP to this URL."),
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            help="auto (= batched) | batched (slot pool, one attention call per layer, CUDA "
            "graphs on a GPU) | reference (per-request caches, the readable model)."
        ),
    ] = "auto",
    compile: CompileOpt = None,
    draft_vocab: DraftVocabOpt = None,
) -> None:
    """Run DSpark on SmolLM2-135M with the shipped drafter and store every step's records."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    from dspark_obs.cost_table import CostTableError
    from dspark_obs.engine.draft_vocab import resolve_draft_vocab
    from dspark_obs.engine.session import (
        load_models,
        new_run_id,
        resolve_cost_table,
        run_with_companion,
        traffic_to_requests,
    )
    from dspark_obs.engine.types import EngineConfig, EngineError
    from dspark_obs.fanout import SinkError
    from dspark_obs.store import Store, StoreError
    from dspark_obs.sts_file import StsCalibration
    from dspark_obs.workloads import WorkloadFileError, load_traffic, mixed_traffic

    console = Console(stderr=True)
    try:
        # refused before any work: nothing is loaded, run or stored
        if workload not in WORKLOAD_CHOICES:
            raise EngineError(
                f"unknown workload {workload!r}; expected one of {list(WORKLOAD_CHOICES)}"
            )
        if workload_file is None and requests < 1:
            raise ValueError(f"--requests must be >= 1, got {requests}: nothing to run")
        rid = run_id or new_run_id(mode)
        check_run_ids(rid, companion, store)
        draft_vocab = resolve_draft_vocab(draft_vocab, device)
        table = resolve_cost_table(cost_table, device, backend, draft_vocab)
        plans_windows = mode != "static"  # static verifies every block: no table is read
        if plans_windows and table.warning:
            console.print(Text.assemble(("warning: ", "yellow"), table.warning), soft_wrap=True)
        config = EngineConfig(
            mode=mode,
            gamma=gamma,
            lag_steps=lag,
            max_batch=max_batch,
            cost_table=table.table,
            estimator_rows=estimator_rows,
            backend=backend,
            compile=device.startswith("cuda") if compile is None else compile,
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
        if not traffic:
            raise ValueError(f"{workload_file}: no requests in the workload file: nothing to run")
        # every file is read and checked before the model loads and before the first record
        temps = None if sts is None else StsCalibration.load(sts, gamma=gamma).temperatures
        with console.status("loading SmolLM2-135M and the drafter"):
            models = load_models(drafter, device=device, sts=temps, draft_vocab=draft_vocab)
        reqs = traffic_to_requests(traffic, models.tokenizer)
        from dspark_obs.sinks.backpressure import expose_backpressure
        from dspark_obs.sinks.process import SinkProcess

        # the store and the live telemetry in a child: their work never holds this
        # process's interpreter lock, which the decode loop needs
        sinks = SinkProcess(store, metrics_port, otlp_endpoint)
        try:
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
                    [sinks],
                    rid,
                    companion=companion,
                    workload=label,
                    seed=seed,
                    extra_config={
                        "split": split,
                        "device": device,
                        "cost_table_file": None if table.path is None else str(table.path),
                        "cost_table_profiled_here": table.profiled_here,
                    },
                    progress=progress,
                    on_fan=lambda fan: expose_backpressure(fan, [sinks]),
                )
        finally:
            sinks.close()  # everything stored; the child released the store
        stored = Store(store)
        for r in (main, comp):
            if r is not None:
                stored.compact(run_id=r.run_id)  # one segment per table: faster queries
        stored.close()
    except (EngineError, CostTableError, WorkloadFileError, StoreError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    except SinkError as exc:  # a sink's write failed on its thread: what it acknowledged stays
        console.print(f"[red]error:[/red] a record sink failed, run not complete: {exc}")
        raise typer.Exit(3) from exc
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
    if plans_windows:
        console.print(table.summary(), markup=False, highlight=False, soft_wrap=True)
    queues = [f"{r.run_id} {r.records.line()}" for r in (main, comp) if r and r.records]
    if fan.summary():
        queues.append(fan.summary())
    if queues:
        console.print("record and sink queues (backpressure):\n" + "\n".join(queues))
    if fan.errors:
        console.print(
            f"[yellow]{len(fan.errors)} records rejected[/yellow]; first: {fan.errors[0]}"
        )
    telemetry_errors = sinks.errors
    if telemetry_errors:  # the store has every row; only the live view missed some
        console.print(
            f"[yellow]live telemetry: {len(telemetry_errors)} error(s)[/yellow]; "
            f"first: {telemetry_errors[0]}"
        )
    typer.echo(rid)


def check_run_ids(run_id: str, companion: bool, store: Path) -> None:
    """Refuse a run id the store cannot hold (and its companion's, ``<id>-cap``), judged
    against the store's own filesystem (its longest file name), before any work."""
    from dspark_obs.validation import run_id_problem

    probe = store.resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        name_max = os.pathconf(probe, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    for rid in (run_id, f"{run_id}-cap") if companion else (run_id,):
        problem = run_id_problem(rid, name_max)
        if problem is not None:
            what = "--run-id" if rid == run_id else f"the companion's run id {rid[:40]!r}..."
            raise ValueError(f"{what}: {problem}")


def profile_command(
    batch_sizes: Annotated[
        str | None,
        typer.Option(help="Comma list of batch sizes (default 1,2,4,8,16; 1,...,64 on cuda)."),
    ] = None,
    fractions: Annotated[
        str, typer.Option(help="Comma list of forced budget fractions of bs * gamma, in [0, 1].")
    ] = "0,0.25,0.5,0.75,1",
    new_tokens: Annotated[
        int | None,
        typer.Option(
            help="New tokens per request in each (bs, fraction) cell (default 24; 64 on cuda, "
            "where a cell otherwise has only a few full-batch steps to time)."
        ),
    ] = None,
    gamma: Annotated[int, typer.Option(help="Draft block size.")] = 5,
    drafter: Annotated[
        Path | None,
        typer.Option(
            help="Drafter checkpoint (default: runtime/drafter; a random one of the same shape "
            "if none exists: timing does not depend on weights)."
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu | cuda.")] = "cpu",
    out_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where the tables and the fit report go (default: runtime/cost_tables).",
            show_default=False,
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(help="File stem (default smollm2_cpu, or smollm2_h200 on cuda)."),
    ] = None,
    for_this_host: Annotated[
        bool,
        typer.Option(
            "--for-this-host",
            help="CPU only: keep the table as this host's, in $DSPARK_OBS_COST_TABLES (default "
            "~/.cache/dspark-obs/cost_tables, under $DSPARK_OBS_CACHE if set), named for the "
            "host, --backend and --draft-vocab. `run` and the benches then plan with it "
            "instead of the shipped CPU table (profiled on another machine) whenever they run "
            "here with that runtime and draft vocabulary and no --cost-table. Picks the file "
            "name itself: not with --out-dir or --name.",
        ),
    ] = False,
    holdout: Annotated[
        float, typer.Option(help="Share of (bs, fraction) cells held out to judge the fits.")
    ] = 0.25,
    seed: Annotated[int, typer.Option(help="Seeds the held-out split of cells.")] = 0,
    compile: CompileOpt = None,
    queue_file: Annotated[
        Path | None,
        typer.Option(help="Prompts from this workload file (JSONL) instead of the chat pool."),
    ] = None,
    draft_vocab: DraftVocabOpt = None,
    backend: Annotated[
        str,
        typer.Option(
            help="Runtime to time: auto (what `run` and bench_throughput.py use: the batched "
            "one), batched or reference. A table predicts the runtime it was profiled on."
        ),
    ] = "auto",
) -> None:
    """Measure compact step time over batch sizes x pinned budgets; fit SGLang's two tables.

    Writes NAME.json (additive, what the scheduler loads), NAME_1d.json (steps-per-sec),
    NAME_fit.json (samples, cells, held-out and in-sample fit metrics) and NAME_fit.png.

    Each table records the host it was profiled on (its "host" block). A CPU table predicts
    that machine only: --for-this-host keeps it where `run` and the benches pick it up on
    this host (with --batch-sizes 1,2,4,8 --new-tokens 16: 78 s on a 2-core AMD EPYC).
    """
    import shlex
    from datetime import UTC, datetime

    import torch
    from rich.console import Console
    from rich.table import Table

    from dspark_obs.cost_table import CostTableError
    from dspark_obs.engine.drafter import Drafter, missing_checkpoint_files
    from dspark_obs.engine.drafter_config import DrafterConfig
    from dspark_obs.engine.host_tables import host_table_dir, host_table_stem, this_host
    from dspark_obs.engine.profile import parse_batch_sizes, parse_fractions, profile_steps
    from dspark_obs.engine.profile_report import (
        evaluate_fits,
        metrics_rows,
        poor_fit_warning,
        save_profile,
        save_samples,
    )
    from dspark_obs.engine.session import DEFAULT_DRAFTER, shipped_cost_table
    from dspark_obs.engine.slots import BATCH_TIERS, TOKEN_TIERS
    from dspark_obs.engine.types import BACKENDS, EngineError
    from dspark_obs.engine.weights import encode_chat, load_smollm2
    from dspark_obs.workloads import load_prompts

    console = Console(stderr=True)
    cuda = device.startswith("cuda")
    try:
        sizes = parse_batch_sizes(batch_sizes or ("1,2,4,8,16,32,64" if cuda else "1,2,4,8,16"))
        fracs = parse_fractions(fractions)
        if new_tokens is None:
            new_tokens = 64 if cuda else 24
        if new_tokens < 2:
            raise ValueError("--new-tokens must be >= 2 (each cell's first step is dropped)")
        if not 0.0 <= holdout < 1.0:
            raise ValueError(f"--holdout must be in [0, 1), got {holdout}")
        from dspark_obs.engine.draft_vocab import resolve_draft_vocab

        draft_vocab = resolve_draft_vocab(draft_vocab, device)
        if backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if for_this_host and device != "cpu":
            raise ValueError(
                "--for-this-host is for --device cpu (a GPU run uses the shipped H200 table "
                "or --cost-table)"
            )
        if for_this_host and (out_dir is not None or name is not None):
            raise ValueError("--for-this-host names the file itself: drop --out-dir / --name")
        if cuda and not torch.cuda.is_available():
            raise ValueError(f"--device {device}: this torch ({torch.__version__}) sees no GPU")
        host = this_host(device, backend, draft_vocab)
        if for_this_host:
            out_dir = host_table_dir()
            stem = host_table_stem(shipped_cost_table(device, backend).stem, host)
        else:
            out_dir = Path("runtime/cost_tables") if out_dir is None else out_dir
            stem = name or ("smollm2_h200" if cuda else f"smollm2_{device}")
        path = drafter or DEFAULT_DRAFTER
        missing = missing_checkpoint_files(path)
        if len(missing) == 1:  # half a checkpoint is a mistake, not "no drafter"
            raise ValueError(f"drafter checkpoint {path} is incomplete: missing {missing[0]}")
        target, tok = load_smollm2(device=device, dtype=torch.bfloat16 if cuda else torch.float32)
        if not missing:
            model, drafter_name = Drafter.load(path, target), str(path)
        else:
            console.print(
                f"no drafter at {path}: timing with a random drafter of the default shape"
            )
            model, drafter_name = Drafter(DrafterConfig.for_target(target), target), "random"
        model = model.to(device=device, dtype=target.dtype).eval()
        if draft_vocab:
            from dspark_obs.engine.draft_vocab import shipped_draft_vocab
            from dspark_obs.engine.weights import stop_token_ids

            model.set_draft_vocab(shipped_draft_vocab(draft_vocab, stop_token_ids(tok)))
        if queue_file is not None:
            from dspark_obs.workloads.traffic import load_traffic

            pool = [t.prompt for t in load_traffic(queue_file)][:16]
        else:
            pool = list(load_prompts("chat", "train", 16, seed=1))
        prompts = [encode_chat(tok, p.messages) for p in pool]
        if cuda and (past := [b for b in sizes if b > max(BATCH_TIERS)]):
            console.print(
                f"batch sizes {past} are past the largest batch tier ({max(BATCH_TIERS)}): "
                f"steps of more than {max(TOKEN_TIERS)} tokens run eager there, as in a run "
                "at that batch"
            )
        samples = profile_steps(
            target,
            model,
            prompts,
            gamma=gamma,
            batch_sizes=sizes,
            fractions=fracs,
            compile=cuda if compile is None else compile,
            new_tokens=new_tokens,
            backend=backend,
            progress=lambda line: console.print(line, markup=False, highlight=False),
        )
        try:
            report = evaluate_fits(samples, holdout=holdout, seed=seed)
        except CostTableError as exc:  # keep the measurements: a GPU profile is not free
            dump = save_samples(samples, out_dir / f"{stem}_samples.json")
            raise CostTableError(f"{exc} (the {len(samples)} steps are in {dump})") from exc
        command = [
            "dspark-obs", "profile", "--device", device,
            "--batch-sizes", ",".join(map(str, sizes)), "--fractions", ",".join(map(str, fracs)),
            "--new-tokens", str(new_tokens), "--gamma", str(gamma), "--drafter", str(path),
            *(["--for-this-host"] if for_this_host else
              ["--out-dir", str(out_dir), "--name", stem]),
            "--holdout", str(holdout), "--seed", str(seed),
            "--draft-vocab", str(draft_vocab),
            *(["--backend", backend] if backend != "auto" else []),
        ]  # fmt: skip
        meta = {
            "name": stem,
            "device": device,
            "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__,
            "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": shlex.join(command),
            "model": "SmolLM2-135M-Instruct",
            "drafter": drafter_name,
            "gamma": gamma,
            "new_tokens": new_tokens,
            "batch_sizes": sizes,
            "fractions": fracs,
            "draft_vocab": draft_vocab or None,
            "backend": backend,
            "host": host.to_block(),
        }
        paths = save_profile(report, out_dir, stem, meta)
    except (EngineError, CostTableError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    grid = Table("table", "cells", "n", "RMS ms", "R^2", "median rel err", title="fit quality")
    for row in metrics_rows(report):
        grid.add_row(*row)
    console.print(grid)
    console.print(f"{len(samples)} steps in {len(report.cells)} cells")
    if (warning := poor_fit_warning(report)) is not None:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
    if paths["plot"] is None:
        console.print("[yellow]matplotlib is not installed: no fit plot written[/yellow]")
    for key in ("additive", "steps_per_sec", "report", "plot"):
        if paths.get(key) is not None:
            typer.echo(str(paths[key]))


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
