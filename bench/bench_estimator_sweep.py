"""The block-accept estimator under heavy trimming: a sweep judged against cap-accept truth.

Cells: forced budget fraction (1.0 / 0.75 / 0.5 / 0.33 / 0.2 of ``bs * gamma``, the engine's
``forced_budget_frac``, SGLang's ``dspark_force_budget_frac``) x sampling (greedy, T = 1,
T = 0.7 + top-p 0.9, T = 1 + top-k 20), seeded replicates per cell, each one batch of short
requests on SmolLM2-135M with the shipped drafter: ``--per-workload`` eval prompts of each
workload (math / chat / poetry), so every replicate also gives a per-workload sub-cell.
Sized for a shared 2-core CPU: a replicate is 3 requests (one per workload) x 16 new tokens
by default (about 20 blocks), and ``--pack 4`` replicates share one engine batch of 12 (the
forced budget is a fraction of the whole batch's ``bs * gamma``; each replicate's rows are
judged on their own, under their own run_id). The 0.2 cells are the steep end: 60-90% of
blocks censored, most windows cut to 1-2 of 6.

Two steps, kept apart so any estimator can be re-judged on the same rows without decoding:

    python bench/bench_estimator_sweep.py collect [--replicates 20] [--per-workload 1] [--pack 4]
        [--new-tokens 16] [--rows out/estimator_sweep]       # resumable, one file per run
    python bench/bench_estimator_sweep.py evaluate [--rows out/estimator_sweep]
        [--out runtime/bench/estimator_sweep.json] [--plot docs/bench/estimator_sweep.png]

One run per replicate gives both sides. A cap-accept companion commits bitwise what its
compact run commits (same windows, coins, head forward: see engine/acceptance.py and
Engine._verify), so its rows *are* the compact run's rows plus ``cap_trim``. The collector
runs cap-accept with the compact estimator fields switched on (``trimmed_tokens`` / ``q_lp``
/ ``pg``, which a compact run would write); ``evaluate`` hands the estimator those rows with
``cap_trim`` removed and the mode set to compact, and takes the truth (acc_len + cap_trim)
from the same rows. tests/test_engine_estimator.py checks the equivalence: a compact run's
rows equal these rows field for field.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

FRACTIONS = (1.0, 0.75, 0.5, 0.33, 0.2)
SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "T1": {"temperature": 1.0},
    "T0.7-p0.9": {"temperature": 0.7, "top_p": 0.9},
    "T1-k20": {"temperature": 1.0, "top_k": 20},
}
WORKLOADS = ("math", "chat", "poetry")
GAMMA = 5
ROWS_DIR = Path("out/estimator_sweep")


@dataclass(frozen=True)
class Cell:
    frac: float
    sampling: str

    @property
    def name(self) -> str:
        return f"f{self.frac:g}_{self.sampling}"


def cells(fracs: tuple[float, ...], samplings: tuple[str, ...]) -> list[Cell]:
    return [Cell(f, s) for f in fracs for s in samplings]


def companion_engine_class() -> type:
    """Engine whose cap-accept rows also carry compact's estimator fields.

    Only :meth:`Engine._censors` differs: a cap-accept step whose *window* was fully
    accepted with drafts past it opens a censored block, exactly as the compact step would.
    """
    from dspark_obs.engine.loop import Engine

    class CompanionWithEstimatorFields(Engine):
        def _censors(self, live: Any, correct_drafts: int, w: int, *rest: Any) -> bool:
            if self.cfg.mode != "cap-accept":
                return super()._censors(live, correct_drafts, w, *rest)
            return correct_drafts == w - 1 and w - 1 < self.cfg.gamma

    return CompanionWithEstimatorFields


def build_requests(
    cell: Cell, reps: Sequence[int], n: int, new_tokens: int, tokenizer: Any
) -> list[Any]:
    """``n`` eval prompts of each workload per replicate (seeded by the replicate) as requests;
    rids name the replicate (``-r{rep}-``)."""
    from dspark_obs.engine.types import GenRequest
    from dspark_obs.engine.weights import encode_chat
    from dspark_obs.workloads import load_prompts

    out = []
    for rep in reps:
        prompts = [p for w in WORKLOADS for p in load_prompts(w, split="eval", n=n, seed=rep)]
        out += [
            GenRequest(
                rid=f"{cell.name}-r{rep}-{p.workload}{i}",
                prompt_ids=encode_chat(tokenizer, p.messages),
                max_new_tokens=new_tokens,
                workload=p.workload,
                seed=10_000 * rep + i,
                **SAMPLINGS[cell.sampling],
            )
            for i, p in enumerate(prompts)
        ]
    return out


def run_cell(
    models: Any, cell: Cell, reps: Sequence[int], args: argparse.Namespace
) -> pd.DataFrame:
    """Replicates ``reps`` decoded in one batch: the cap-accept run (with compact's estimator
    fields) as req_steps rows, each request's finish_reason attached, and each replicate's
    rows under its own run_id (the estimator sees one replicate at a time)."""
    from dspark_obs.engine.types import EngineConfig
    from dspark_obs.fanout import FanOut, MemorySink

    reqs = build_requests(cell, reps, args.per_workload, args.new_tokens, models.tokenizer)
    cfg = EngineConfig(
        mode="cap-accept", gamma=GAMMA, max_batch=len(reqs), backend=args.backend, overlap=False
    )
    engine = companion_engine_class()(models.target, models.drafter, cfg, models.stop_ids)
    engine.scheduler.forced_budget_frac = cell.frac
    sink = MemorySink()
    fan = FanOut([sink])
    engine.run(reqs, fan.emit, f"{cell.name}-batch{reps[0]}")
    if fan.errors:
        raise RuntimeError(f"{cell.name} reps {list(reps)}: rejected rows {fan.errors[:3]}")
    rows = sink.table("req_steps").to_pandas()
    finish = dict(
        zip(*(sink.table("requests").to_pandas()[c] for c in ("rid", "finish_reason")), strict=True)
    )
    rows["finish_reason"] = rows["rid"].map(finish)
    keep = [
        "run_id", "rid", "workload", "forward_ct", "gamma", "prefix_len", "verify_len",
        "acc_len", "correct_drafts", "cap_trim", "bonus_token", "draft_tokens", "confidence",
        "survival", "temperature", "top_p", "top_k", "is_last", "pg", "trimmed_tokens", "q_lp",
        "finish_reason",
    ]  # fmt: skip
    out = rows[keep].copy()
    out["rep"] = out["rid"].str.extract(r"-r(\d+)-", expand=False).astype(int)
    out["run_id"] = cell.name + "-r" + out["rep"].astype(str)
    out["frac"], out["sampling"] = cell.frac, cell.sampling
    out["new_tokens"], out["batch_requests"] = args.new_tokens, len(reqs)
    return out


def _jobs(args: argparse.Namespace) -> Iterator[tuple[Cell, list[int], Path]]:
    """Replicate-major order, so a partial collection already covers every cell; ``--pack``
    replicates share one engine batch (one file)."""
    todo = cells(tuple(args.fracs), tuple(args.samplings))
    pack = max(1, int(args.pack))
    for first in range(0, args.replicates, pack):
        reps = list(range(first, min(first + pack, args.replicates)))
        for cell in todo:
            yield cell, reps, args.rows / f"{cell.name}_r{first:03d}-{reps[-1]:03d}.parquet"


def collect(args: argparse.Namespace) -> None:
    import torch

    from dspark_obs.engine.session import load_models

    args.rows.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    jobs = list(_jobs(args))
    left = [j for j in jobs if not j[2].exists()]
    print(f"{len(jobs) - len(left)}/{len(jobs)} runs already collected", file=sys.stderr)
    if not left:
        return
    models = load_models(device="cpu")
    t0 = time.perf_counter()
    for n, (cell, reps, path) in enumerate(left, 1):
        with torch.inference_mode():
            rows = run_cell(models, cell, reps, args)
        tmp = path.with_suffix(".tmp")
        rows.to_parquet(tmp, index=False)
        os.replace(tmp, path)  # a killed collector leaves no half-written file
        rate = (time.perf_counter() - t0) / n
        print(
            f"[{len(jobs) - len(left) + n}/{len(jobs)}] {path.name}: {len(rows)} rows, "
            f"{rate:.1f} s/run, ~{rate * (len(left) - n) / 60:.0f} min left",
            file=sys.stderr,
            flush=True,
        )


def load_rows(rows_dir: Path) -> pd.DataFrame:
    files = sorted(rows_dir.glob("*.parquet"))
    if not files:
        raise SystemExit(f"no collected rows under {rows_dir} (run `collect` first)")
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


def estimator_input(run: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """What the estimator may see of a collected run (its compact rows: no ``cap_trim``) and
    the requests' finish reasons."""
    rows = run.drop(
        columns=[
            "cap_trim",
            "finish_reason",
            "frac",
            "sampling",
            "rep",
            "new_tokens",
            "batch_requests",
        ],
        errors="ignore",
    )
    reqs = run.drop_duplicates("rid")[["run_id", "rid", "finish_reason"]]
    return rows, reqs


def evaluate_run(run: pd.DataFrame, tail: str, n_boot: int, seed: int) -> list[dict[str, Any]]:
    """One replicate judged against its truth: pooled, and per workload."""
    from dspark_obs.analytics import estimate_blocks

    rows, reqs = estimator_input(run)
    est = estimate_blocks(rows, reqs, tail=tail, mode="compact", seed=seed)
    blocks = est.blocks.merge(
        run[["run_id", "rid", "forward_ct", "acc_len", "cap_trim"]],
        on=["run_id", "rid", "forward_ct"],
        validate="one_to_one",
    )
    blocks["truth"] = blocks["acc_len"] + blocks["cap_trim"]
    out = []
    for scope, summ in (
        ("all", est.summary(by=(), n_boot=n_boot, seed=seed).assign(workload="all")),
        ("workload", est.summary(by=("workload",), n_boot=n_boot, seed=seed)),
    ):
        truth = (
            blocks.groupby("workload")["truth"].mean()
            if scope == "workload"
            else pd.Series({"all": blocks["truth"].mean()})
        )
        for r in summ.itertuples(index=False):
            t = float(truth[r.workload])
            out.append(
                {
                    "frac": float(run["frac"].iloc[0]),
                    "sampling": str(run["sampling"].iloc[0]),
                    "rep": int(run["rep"].iloc[0]),
                    "workload": r.workload,
                    "blocks": int(r.blocks),
                    "censored_share": float(r.censored_share),
                    "truth": t,
                    "point": float(r.mean_point),
                    "ci_lo": float(r.companion_ci_lo),
                    "ci_hi": float(r.companion_ci_hi),
                    "tail_model": est.tail_model.name if est.tail_model else tail,
                }
            )
    return out


def cell_table(reps: pd.DataFrame) -> pd.DataFrame:
    """Per cell (fraction, sampling, workload): censored share, signed relative point error,
    coverage of the 95% companion interval, its width (tokens, and relative to the truth)."""
    r = reps.assign(
        err=(reps["point"] - reps["truth"]) / reps["truth"],
        covers=(reps["ci_lo"] - 1e-9 <= reps["truth"]) & (reps["truth"] <= reps["ci_hi"] + 1e-9),
        width=reps["ci_hi"] - reps["ci_lo"],
        exact=(reps["point"] - reps["truth"]).abs() < 1e-9,
    )
    g = r.groupby(["frac", "sampling", "workload"], sort=False)
    out = g.agg(
        replicates=("rep", "nunique"),
        blocks=("blocks", "mean"),
        censored_share=("censored_share", "mean"),
        truth=("truth", "mean"),
        point_error=("err", "mean"),
        point_error_sd=("err", "std"),
        abs_point_error=("err", lambda x: float(np.abs(x).mean())),
        coverage=("covers", "mean"),
        interval_width=("width", "mean"),
        exact_share=("exact", "mean"),
    ).reset_index()
    out["interval_width_rel"] = out["interval_width"] / out["truth"]
    out["tail_models"] = g["tail_model"].agg(lambda x: dict(x.value_counts())).to_numpy()
    return out


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a coverage k / n (how precisely n replicates measure it)."""
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return c - h, c + h


def plot(table: pd.DataFrame, path: Path) -> None:
    """Point error and coverage against censored share, one marker per sampling setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = table[table["workload"] == "all"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for s, g in t.groupby("sampling", sort=False):
        ax1.errorbar(
            100 * g["censored_share"], 100 * g["point_error"],
            yerr=196 * g["point_error_sd"] / np.sqrt(g["replicates"]), fmt="o", label=s,
            capsize=3,
        )  # fmt: skip
        ax2.plot(100 * g["censored_share"], g["coverage"], "o", label=s)
    ax1.axhspan(-2, 2, color="green", alpha=0.1, label="goal: within 2%")
    ax1.axhline(0, color="k", lw=0.5)
    ax1.set_xlabel("censored blocks (%)")
    ax1.set_ylabel("mean point error vs companion (%), 95% CI")
    ax2.axhspan(0.93, 0.97, color="green", alpha=0.1, label="goal: 0.93-0.97")
    ax2.set_ylim(0.5, 1.02)
    ax2.set_xlabel("censored blocks (%)")
    ax2.set_ylabel("coverage of the 95% companion interval")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8, loc="lower left")
    fig.suptitle("Block-accept estimator vs cap-accept truth (SmolLM2-135M, CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def evaluate(args: argparse.Namespace) -> None:
    rows = load_rows(args.rows)
    reps: list[dict[str, Any]] = []
    runs = list(rows.groupby("run_id", sort=True))
    t0 = time.perf_counter()
    for n, (_, run) in enumerate(runs, 1):
        reps.extend(evaluate_run(run, args.tail, args.boot, int(run["rep"].iloc[0])))
        if n % 20 == 0:
            print(f"[{n}/{len(runs)}] evaluated, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    frame = pd.DataFrame(reps)
    table = cell_table(frame)
    pooled = frame[frame["workload"] == "all"]
    covers = (pooled["ci_lo"] - 1e-9 <= pooled["truth"]) & (
        pooled["truth"] <= pooled["ci_hi"] + 1e-9
    )
    k, n = int(covers.sum()), len(covers)
    pooled_cells = table[table["workload"] == "all"]
    goal = pooled_cells[pooled_cells["censored_share"] <= 0.8]
    # coverage is a goal where something is estimated; fully observed cells are exact
    judged = goal[goal["exact_share"] < 1.0]
    censored = pooled[pooled["censored_share"] > 0]
    ck = int(
        (
            (censored["ci_lo"] - 1e-9 <= censored["truth"])
            & (censored["truth"] <= censored["ci_hi"] + 1e-9)
        ).sum()
    )
    summary = {
        "runs": len(runs),
        "coverage_all_cells": k / n if n else float("nan"),
        "coverage_all_cells_wilson95": wilson(k, n),
        "replicates_judged": n,
        "coverage_censored_replicates": ck / len(censored) if len(censored) else float("nan"),
        "coverage_censored_replicates_wilson95": wilson(ck, len(censored)),
        "censored_replicates": len(censored),
        "max_censored_share": float(pooled_cells["censored_share"].max()),
        "max_abs_point_error": float(goal["point_error"].abs().max()),
        "cells_within_2pct": int((goal["point_error"].abs() <= 0.02).sum()),
        "cells": len(goal),
        "cells_coverage_in_0.93_0.97": int(judged["coverage"].between(0.93, 0.97).sum()),
        "cells_coverage_judged": len(judged),
        "exact_cells": int((goal["exact_share"] == 1.0).sum()),
        "exact_cells_zero_error": int(
            ((goal["exact_share"] == 1.0) & (goal["abs_point_error"] == 0.0)).sum()
        ),
    }
    design = rows.drop_duplicates("run_id")
    out = {
        "bench": "bench/bench_estimator_sweep.py",
        "command": " ".join(["python", *sys.argv]),
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 weights, float32) + shipped drafter, CPU",
        "design": (
            "per replicate: one eval prompt per workload (math, chat, poetry), "
            f"{sorted(design.get('new_tokens', pd.Series([0])).unique().tolist())} new tokens "
            "each, gamma 5, forced budget fraction; replicates decoded "
            f"{sorted((design.get('batch_requests', pd.Series([3])) // 3).unique().tolist())} "
            "to an engine batch, judged one by one; one cap-accept run with compact's "
            "estimator fields (its rows are the compact run's, checked by "
            "tests/test_engine_estimator.py); truth = acc_len + cap_trim of the same rows"
        ),
        "tail": args.tail,
        "n_boot": args.boot,
        "interval": "companion_ci (95%): tail-model refits on resampled requests x 20 chain "
        "realizations each, same blocks; randomized lattice percentiles of the integer "
        "total (estimator_summary.lattice_interval)",
        "summary": summary,
        "cells": json.loads(table.to_json(orient="records")),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    plot(table, args.plot)
    pd.set_option("display.width", 200)
    print(table.drop(columns=["tail_models"]).to_string(index=False, float_format="%.3f"))
    print(json.dumps(summary, indent=1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="decode and store rows (resumable)")
    c.add_argument("--replicates", type=int, default=20)
    c.add_argument("--per-workload", type=int, default=1, help="requests per workload")
    c.add_argument("--pack", type=int, default=4, help="replicates decoded in one batch")
    c.add_argument("--new-tokens", type=int, default=16)
    c.add_argument("--fracs", type=float, nargs="+", default=list(FRACTIONS))
    c.add_argument("--samplings", nargs="+", default=list(SAMPLINGS), choices=list(SAMPLINGS))
    c.add_argument("--backend", default="reference", help="engine backend (reference: CPU)")
    c.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    c.add_argument("--rows", type=Path, default=ROWS_DIR)
    e = sub.add_parser("evaluate", help="judge the estimator on collected rows")
    e.add_argument("--rows", type=Path, default=ROWS_DIR)
    e.add_argument("--out", type=Path, default=Path("runtime/bench/estimator_sweep.json"))
    e.add_argument("--plot", type=Path, default=Path("docs/bench/estimator_sweep.png"))
    e.add_argument("--tail", default="auto")
    e.add_argument("--boot", type=int, default=200)
    args = ap.parse_args(argv)
    if args.cmd == "collect":
        collect(args)
    else:
        evaluate(args)


if __name__ == "__main__":
    main()
