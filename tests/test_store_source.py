"""A deterministic record source and a writer process for the store tests (no tests here).

    python tests/test_store_source.py ROOT RUN_ID N_BATCHES [--sleep S] [--crash FN:N:WHEN]
    python tests/test_store_source.py --zygote

The writer prints ``READY`` once its batches are built, then ``ACK <table> <k>`` after each
write of batch ``k`` returned (i.e. was acknowledged as durable), then ``DONE``. ``--crash``
kills the writer itself with SIGKILL at the N-th call of ``os.replace`` or of the store's
directory fsync, ``before`` or ``after`` the real call: deterministic crash points.

``--zygote`` imports everything once, then forks one writer process per JSON line read from
stdin (``{"argv": [...], "out": path}``; the writer's stdout goes to ``out``) and answers
``PID <pid>``: many writers to kill without paying the interpreter start-up each time.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from dspark_obs import schema, validation

GAMMA = 4
STEPS_PER_BATCH = 6
REQS_PER_STEP = 8


def run_row(run_id: str) -> pa.Table:
    rows = [{"run_id": run_id, "source": "engine", "mode": "cap-accept", "gamma": GAMMA,
             "model": "tiny", "workload": "mixed", "temperature": 0.7, "seed": 1}]
    return _valid("runs", rows)


def steps_batch(run_id: str, k: int, dp_rank: int = 0) -> pa.Table:
    fct = np.arange(k * STEPS_PER_BATCH, (k + 1) * STEPS_PER_BATCH)
    rows = [
        {"run_id": run_id, "dp_rank": dp_rank, "forward_ct": int(f), "source": "engine",
         "mode": "cap-accept", "bs": REQS_PER_STEP, "num_verify_tokens": int(3 * REQS_PER_STEP),
         "step_cpu_ms": 1.5 + (int(f) % 7) / 10}
        for f in fct
    ]
    return _valid("steps", rows)


def req_steps_batch(run_id: str, k: int, dp_rank: int = 0) -> pa.Table:
    rng = np.random.default_rng(1000 * k + dp_rank)
    rows = []
    for f in range(k * STEPS_PER_BATCH, (k + 1) * STEPS_PER_BATCH):
        for r in range(REQS_PER_STEP):
            conf = np.round(rng.uniform(0.3, 1.0, GAMMA), 4)
            verify = int(rng.integers(1, GAMMA + 2))
            full = int(rng.integers(0, GAMMA + 1))
            correct = min(full, verify - 1)
            rows.append({
                "run_id": run_id, "dp_rank": dp_rank, "forward_ct": f, "rid": f"r{r}-{f // 50}",
                "gamma": GAMMA, "req_pool_index": r, "prefix_len": 10 + f, "verify_len": verify,
                "acc_len": correct + 1, "correct_drafts": correct, "cap_trim": full - correct,
                "bonus_token": 7 * f + r,
                "draft_tokens": [int(x) for x in rng.integers(0, 500, GAMMA)],
                "confidence": conf.tolist(), "survival": np.round(np.cumprod(conf), 4).tolist(),
                "workload": ("math", "chat", "poetry")[r % 3], "is_last": False,
            })
    return _valid("req_steps", rows)


def amends_batch(run_id: str, k: int, dp_rank: int = 0) -> pa.Table:
    """Late estimator lines for every request-step of req_steps batch ``k`` (stored without
    them): the drafts past each window, their log-probs, one pg entry each."""
    rows = []
    for row in req_steps_batch(run_id, k, dp_rank).to_pylist():
        n = GAMMA + 1 - row["verify_len"]
        f = row["forward_ct"]
        rows.append({
            "run_id": run_id, "dp_rank": dp_rank, "forward_ct": f, "rid": row["rid"],
            "gamma": GAMMA, "verify_len": row["verify_len"],
            "trimmed_tokens": [(f * 31 + j) % 500 for j in range(n)],
            "q_lp": [-0.25 * (j + 1) for j in range(n)],
            "pg": [{"src_fct": f, "k": row["verify_len"] + j, "target_logprob": -0.5,
                    "draft_token": (f * 31 + j) % 500, "realized_token": 3} for j in range(n)],
        })
    return _valid("req_step_amends", rows)


def requests_batch(run_id: str, k: int) -> pa.Table:
    rows = [{"run_id": run_id, "rid": f"r{r}-{k}", "workload": ("math", "chat", "poetry")[r % 3],
             "completion_tokens": 40 + r, "finish_reason": "stop"} for r in range(REQS_PER_STEP)]
    return _valid("requests", rows)


def source(run_id: str, n_batches: int) -> Iterator[tuple[str, int, pa.Table]]:
    """(table, batch number, batch) in the order a producer would emit them."""
    yield "runs", 0, run_row(run_id)
    for k in range(n_batches):
        yield "steps", k, steps_batch(run_id, k)
        yield "req_steps", k, req_steps_batch(run_id, k)
        if k % 2 == 1:  # the estimator lines of this batch came after it was stored
            yield "req_step_amends", k, amends_batch(run_id, k)
        if k % 5 == 4:
            yield "requests", k, requests_batch(run_id, k)


def merged_req_steps(run_id: str, k: int) -> pa.Table:
    """What the req_steps view shows for batch ``k``: its amendment's fields merged on."""
    rows = req_steps_batch(run_id, k)
    if k % 2 == 0:
        return rows
    amends = amends_batch(run_id, k)
    for name in schema.AMENDED_FIELDS:
        i = rows.schema.get_field_index(name)
        rows = rows.set_column(i, rows.schema.field(i), amends.column(name))
    return rows


def expected_counts(n_batches: int) -> dict[str, int]:
    return {
        "runs": 1,
        "steps": n_batches * STEPS_PER_BATCH,
        "req_steps": n_batches * STEPS_PER_BATCH * REQS_PER_STEP,
        "requests": (n_batches // 5) * REQS_PER_STEP,
        "req_step_amends": (n_batches // 2) * STEPS_PER_BATCH * REQS_PER_STEP,
    }


def _valid(table: str, rows: list[dict[str, Any]]) -> pa.Table:
    batch, errors = validation.validate(table, rows)
    assert not errors, errors
    return batch


def _arm_crash(spec: str) -> None:
    """Make the N-th call of os.replace / the directory fsync SIGKILL this process."""
    from dspark_obs.store import layout

    name, nth, when = spec.split(":")
    target: Any = os if name == "replace" else layout
    attr = "replace" if name == "replace" else "fsync_dir"
    real: Callable[..., Any] = getattr(target, attr)
    calls = {"n": 0}

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == int(nth) and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(*args, **kwargs)
        if calls["n"] == int(nth) and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(target, attr, wrapped)


def main(argv: list[str] | None = None) -> None:
    from dspark_obs.store import Store

    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("run_id")
    ap.add_argument("n_batches", type=int)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--crash", default=None)
    ap.add_argument("--compact-every", type=int, default=0, help="compact after every N batches")
    ap.add_argument("--compact-only", action="store_true", help="compact the store, no writes")
    args = ap.parse_args(argv)
    batches = [] if args.compact_only else list(source(args.run_id, args.n_batches))
    if args.crash:
        _arm_crash(args.crash)
    out = sys.stdout
    with Store(args.root) as store:
        out.write("READY\n")
        out.flush()
        if args.compact_only:
            store.compact()
        for table, k, batch in batches:
            store.write(table, batch)
            out.write(f"ACK {table} {k}\n")
            out.flush()
            if args.compact_every and table == "req_steps" and k % args.compact_every == 0:
                store.compact()
            if args.sleep:
                time.sleep(args.sleep)
    out.write("DONE\n")
    out.flush()


def zygote() -> None:
    """Fork writers on request; the children are reaped by the kernel (SIGCHLD ignored)."""
    import json

    import dspark_obs.store  # noqa: F401 - imported once, before any fork

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    sys.stdout.write("ZYGOTE\n")
    sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                main(req["argv"])
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        sys.stdout.write(f"PID {pid}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        zygote()
    else:
        main()
