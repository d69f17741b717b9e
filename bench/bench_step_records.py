"""Host time per decode step spent turning a step into records: row dicts vs Arrow columns.

Synthetic steps of the shape the engine produces (gamma 5, a quarter of the rows censored
with their estimator fields, a few ``pg`` entries per step) at several batch sizes. Per
batch size and path, ``--steps`` steps are turned into one hand-over (the engine hands
records over every 32 steps by default) and validated (``validation.validate``, as ``FanOut.emit``
does); the figure is the median over ``--reps`` of CPU microseconds per step (this thread's
CPU time, ``time.thread_time``: on a loaded machine wall time mostly measures preemption):

* ``dicts``:   one dict per request per step (the fields of ``Engine._req_step_row``), then
               ``validate`` (which builds the Arrow table from the dicts);
* ``columns``: ``StepRecordBuilder.add`` per step, ``build`` per hand-over, then
               ``validate`` (rules only: the table already has the schema's types).

    python bench/bench_step_records.py [--batch 1,16,64,256] [--steps 32] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime
from typing import Any

import numpy as np

from dspark_obs import validation
from dspark_obs.engine.step_records import PgEntries, StepArrays, StepRecordBuilder

GAMMA = 5


def synthetic_step(fct: int, bs: int, rng: np.random.Generator) -> dict[str, Any]:
    """The arrays of one step (what the loop holds on the host after its copy)."""
    conf = rng.uniform(0.3, 1.0, (bs, GAMMA)).astype(np.float32)
    verify = rng.integers(1, GAMMA + 1, bs)
    correct = np.minimum(rng.integers(0, GAMMA + 1, bs), verify - 1)
    censored = (correct == verify - 1) & (verify - 1 < GAMMA) & (rng.uniform(size=bs) < 0.5)
    pg_rows = np.sort(rng.choice(bs, size=min(bs, 3), replace=False))
    return {
        "fct": fct,
        "verify_len": verify,
        "correct": correct,
        "censored": censored,
        "conf": conf,
        "survival": np.cumprod(conf, axis=1),
        "drafts": rng.integers(0, 49152, (bs, GAMMA)),
        "draft_lp": rng.uniform(-3, 0, (bs, GAMMA)).astype(np.float32),
        "bonus": rng.integers(0, 49152, bs),
        "prefix": rng.integers(10, 500, bs),
        "pg_rows": pg_rows,
        "ts": datetime.now(UTC),
    }


def dict_rows(s: dict[str, Any], rids: list[str]) -> list[dict[str, Any]]:
    rows = []
    for i, rid in enumerate(rids):
        w = int(s["verify_len"][i])
        row = {
            "run_id": "bench", "dp_rank": 0, "forward_ct": s["fct"], "rid": rid,
            "gamma": GAMMA, "req_pool_index": i, "prefix_len": int(s["prefix"][i]) + 1,
            "verify_len": w, "acc_len": int(s["correct"][i]) + 1,
            "correct_drafts": int(s["correct"][i]), "cap_trim": 0,
            "bonus_token": int(s["bonus"][i]), "draft_tokens": s["drafts"][i].tolist(),
            "confidence": s["conf"][i].tolist(), "survival": s["survival"][i].tolist(),
            "workload": "math", "temperature": 1.0, "top_p": 1.0, "top_k": -1,
            "is_last": False, "ts": s["ts"], "pg": None, "trimmed_tokens": None, "q_lp": None,
        }  # fmt: skip
        if i in s["pg_rows"]:
            row["pg"] = [{"src_fct": s["fct"] - 1, "k": 3, "target_logprob": -0.5,
                          "draft_token": 7, "realized_token": 7}]  # fmt: skip
        if s["censored"][i]:
            row["trimmed_tokens"] = s["drafts"][i, w - 1 :].tolist()
            row["q_lp"] = s["draft_lp"][i, w - 1 :].tolist()
        rows.append(row)
    return rows


def step_arrays(s: dict[str, Any], req: np.ndarray) -> StepArrays:
    bs = len(req)
    n = len(s["pg_rows"])
    pg = PgEntries(
        row=s["pg_rows"], src_fct=np.full(n, s["fct"] - 1), k=np.full(n, 3),
        target_logprob=np.full(n, -0.5), draft_token=np.full(n, 7), realized_token=np.full(n, 7),
    )  # fmt: skip
    return StepArrays(
        forward_ct=s["fct"], budget=bs * GAMMA, num_verify_tokens=int(s["verify_len"].sum()),
        ts=s["ts"], req=req, req_pool_index=np.arange(bs), prefix_len=s["prefix"] + 1,
        verify_len=s["verify_len"], acc_len=s["correct"] + 1, correct_drafts=s["correct"],
        cap_trim=np.zeros(bs, dtype=np.int64), bonus_token=s["bonus"],
        is_last=np.zeros(bs, dtype=bool), draft_tokens=s["drafts"], confidence=s["conf"],
        survival=s["survival"], censored=s["censored"], draft_logprobs=s["draft_lp"], pg=pg,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--steps", type=int, default=32, help="steps per hand-over")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| batch | dicts us/step | columns us/step | dicts / columns |")
    print("|---|---|---|---|")
    for bs in (int(b) for b in args.batch.split(",")):
        steps = [synthetic_step(f, bs, rng) for f in range(1, args.steps + 1)]
        rids = [f"req-{i}" for i in range(bs)]
        times: dict[str, list[float]] = {"dicts": [], "columns": []}
        for _ in range(args.reps):
            t0 = time.thread_time()
            rows = [r for s in steps for r in dict_rows(s, rids)]
            _, errors = validation.validate("req_steps", rows)
            times["dicts"].append(time.thread_time() - t0)
            assert not errors
            t0 = time.thread_time()
            b = StepRecordBuilder("bench", mode="compact", gamma=GAMMA, lag_steps=2)
            req = np.array([
                b.register(r, workload="math", temperature=1.0, top_p=1.0, top_k=-1)
                for r in rids
            ])  # fmt: skip
            for s in steps:
                b.add(step_arrays(s, req))
            _, errors = validation.validate("req_steps", b.build()["req_steps"])
            times["columns"].append(time.thread_time() - t0)
            assert not errors
        d, c = (statistics.median(times[k]) / args.steps * 1e6 for k in ("dicts", "columns"))
        print(f"| {bs} | {d:,.0f} | {c:,.0f} | {d / c:.1f}x |")


if __name__ == "__main__":
    main()
