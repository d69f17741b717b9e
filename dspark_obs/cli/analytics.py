"""``dspark-obs report | fit-sts | ingest-estimator``: analytics over the store and SGLang files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dspark_obs.cli.store import StoreOpt


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _run_tables(store: Path, run_id: str):
    """The run's rows plus those of its cap-accept companion, if any."""
    from dspark_obs.store import Store

    st = Store(store)
    quoted = run_id.replace("'", "''")
    runs = st.query(f"SELECT * FROM runs WHERE run_id = '{quoted}' OR companion_of = '{quoted}'")
    if runs.num_rows == 0:
        known = [
            r["run_id"] for r in st.query("SELECT run_id FROM runs ORDER BY started_at").to_pylist()
        ]
        raise _fail(f"no run {run_id!r} in {store}; runs there: {known[-10:] or 'none'}")
    ids = ", ".join("'" + r.replace("'", "''") + "'" for r in runs.column("run_id").to_pylist())
    rs = st.query(f"SELECT * FROM req_steps WHERE run_id IN ({ids})")
    rq = st.query(f"SELECT * FROM requests WHERE run_id IN ({ids})")
    steps = st.query(f"SELECT * FROM steps WHERE run_id IN ({ids})")
    return runs, rs, rq, steps


def report_command(
    run_id: Annotated[str, typer.Argument(help="The run to report on (its companion is found).")],
    store: StoreOpt = Path("store"),
    out: Annotated[
        Path | None, typer.Option(help="Write REPORT.json and REPORT.md under this dir.")
    ] = None,
    sts: Annotated[
        Path | None, typer.Option(help="Judge these STS temperatures instead of fitting.")
    ] = None,
    boot: Annotated[int, typer.Option(help="Bootstrap resamples (over requests).")] = 200,
    seed: Annotated[int, typer.Option(help="Bootstrap / held-out split seed.")] = 0,
) -> None:
    """Per-workload windows, committed vs ceiling, utilization, estimator vs truth, ECE."""
    from dspark_obs.analytics import build_report
    from dspark_obs.sts_file import StsCalibration, StsFileError

    runs, rs, rq, steps = _run_tables(store, run_id)
    try:
        temps = StsCalibration.load(sts) if sts else None
    except StsFileError as exc:
        raise _fail(str(exc)) from exc
    rep = build_report(rs, rq, runs, steps=steps, sts=temps, n_boot=boot, seed=seed)
    from rich.console import Console

    console = Console()
    rep.print_rich(Console(width=max(console.width, 132)) if not console.is_terminal else console)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "REPORT.json").write_text(rep.to_json())
        (out / "REPORT.md").write_text(rep.to_markdown())
        typer.echo(f"wrote {out / 'REPORT.json'} and {out / 'REPORT.md'}", err=True)


def fit_sts_command(
    out: Annotated[Path, typer.Option(help="Where to write SGLang's STS JSON.")],
    run_id: Annotated[
        str | None, typer.Option("--run", help="Fit on this stored run's requests.")
    ] = None,
    shards: Annotated[
        str | None, typer.Option(help="Or: SGLang STS shards glob (stem.*.pt).")
    ] = None,
    store: StoreOpt = Path("store"),
    heldout: Annotated[
        float, typer.Option(help="Share of requests held out to judge the fit.")
    ] = 0.3,
    seed: Annotated[int, typer.Option(help="Held-out split seed.")] = 0,
) -> None:
    """Fit sequential temperature scaling (SGLang's fitter) and write its STS JSON."""
    import pyarrow.compute as pc

    from dspark_obs.analytics import (
        fit_sts,
        fit_sts_heldout,
        load_sts_shards,
        sts_data_from_req_steps,
    )
    from dspark_obs.sts_file import StsFileError

    if (run_id is None) == (shards is None):
        raise _fail("give exactly one of --run or --shards")
    try:
        if shards is not None:
            data = load_sts_shards(shards)
            cal = fit_sts(data.logits, data.prefix_mask, data.observed)
            cal.dataset = shards
            cal.save(out)
            typer.echo(
                f"T = {[round(t, 3) for t in cal.temperatures]}; ECE before {cal.ece_before} "
                f"after {cal.ece_after} (in-sample)"
            )
            return
        runs, rs, _, _ = _run_tables(store, run_id)
        main = rs.filter(pc.equal(rs.column("run_id"), run_id))
        data = sts_data_from_req_steps(main, runs)
        res = fit_sts_heldout(data, heldout_frac=heldout, seed=seed)
    except (StsFileError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    cal = res.calibration
    cal.dataset = f"run:{run_id}"
    cal.save(out)
    typer.echo(f"T = {[round(t, 3) for t in cal.temperatures]}")
    lo, hi = res.after_ci
    typer.echo(
        f"held-out ECE (pooled): {res.pooled_before:.4f} -> {res.pooled_after:.4f} "
        f"[95%: {lo:.4f}, {hi:.4f}] ({res.fit_requests} fit / {res.heldout_requests} "
        "held-out requests)"
    )
    verdict = res.verdict()
    typer.echo(f"verdict: {verdict.status}")
    for caveat in verdict.reasons:
        typer.echo(f"CAVEAT: {caveat}", err=True)
    typer.echo(f"wrote {out}", err=True)


def ingest_estimator_command(
    path: Annotated[Path, typer.Argument(help="SGLang block-accept estimator JSONL.")],
    gamma: Annotated[int | None, typer.Option(help="Block size (inferred when absent).")] = None,
    boot: Annotated[int, typer.Option(help="Bootstrap resamples (over requests).")] = 200,
    out: Annotated[
        Path | None, typer.Option(help="Also write the per-block frame as Parquet.")
    ] = None,
) -> None:
    """Summarize SGLang's estimator JSONL (its offline analyzer is not shipped): brackets,
    block categories and a point estimate with a bootstrap interval, per workload."""
    from rich.console import Console
    from rich.table import Table

    from dspark_obs.analytics import EstimatorFileError, estimate_blocks, read_estimator_jsonl

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 132))
    if not path.is_file():
        raise _fail(f"{path}: no such file")
    try:
        frame, errors = read_estimator_jsonl(path, gamma=gamma)
    except (EstimatorFileError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    for err in errors[:20]:
        console.print(f"{path}:{err.line}: {err.reason} (skipped)", style="yellow", markup=False)
    if len(errors) > 20:
        console.print(f"... {len(errors) - 20} more malformed lines skipped", style="yellow")
    if len(frame) == 0:
        raise _fail(f"{path}: no valid estimator line")
    est = estimate_blocks(frame, gamma=gamma)
    summary = est.summary(("workload",), n_boot=boot)
    title = f"block-accept estimate: {path.name} ({len(frame)} steps, {len(errors)} bad lines)"
    table = Table(title=title)
    cols = {
        "blocks": "blocks",
        "requests": "requests",
        "censored_share": "censored",
        "mean_committed": "committed",
        "mean_lo": "lo",
        "mean_mid": "mid",
        "mean_hi": "hi",
        "mean_point": "point",
        "point_ci_lo": "ci lo",
        "point_ci_hi": "ci hi",
    }
    table.add_column("workload")
    for header in cols.values():
        table.add_column(header, justify="right")
    for _, row in summary.iterrows():
        cells = [f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        table.add_row(str(row.get("workload", "")), *cells)
    console.print(table)
    if out is not None:
        est.blocks.to_parquet(out)
        console.print(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.command("report")(report_command)
    app.command("fit-sts")(fit_sts_command)
    app.command("ingest-estimator")(ingest_estimator_command)
