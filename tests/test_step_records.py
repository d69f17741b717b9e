"""Column-wise step records: the builder's tables equal validated row dicts, field by field.

A real engine run (tiny random models, CPU, every mode, greedy and sampled requests, a cost
table that trims windows so the estimator fields are filled) emits its records (the engine
builds them with ``StepRecordBuilder``; here they are read back as row dicts); the same steps
rebuilt as arrays from those rows and handed to a fresh builder must give tables equal to
``validation.validate(rows)``, schema and values, with nothing left for validate to drop.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from dspark_obs import schema, validation
from dspark_obs.cost_table import AdditiveCostTable
from dspark_obs.engine.drafter import Drafter
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.model import Target
from dspark_obs.engine.step_records import (
    PgEntries,
    RecordWorker,
    StepArrays,
    StepRecordBuilder,
    StepRecordError,
)
from dspark_obs.engine.types import EngineConfig, GenRequest
from dspark_obs.testing.tiny_models import tiny_pair

VOCAB = 6
GAMMA = 5


def _models() -> tuple[Target, Drafter]:
    return tiny_pair(0, vocab_size=VOCAB)


def _trimming_table() -> AdditiveCostTable:
    return AdditiveCostTable.from_dict(
        {
            "bias_seconds": 0.01,
            "bs_probes": [1, 16],
            "alpha_seconds": [0.0, 0.0],
            "m_probes": [1, 8, 16, 64, 128],
            "theta_seconds": [0.0, 0.01, 0.03, 0.15, 0.4],
        }
    )


def _requests(n: int) -> list[GenRequest]:
    rng = np.random.default_rng(3)
    return [
        GenRequest(
            rid=f"r{i}",
            prompt_ids=rng.integers(0, VOCAB, size=int(rng.integers(3, 9))).tolist(),
            max_new_tokens=int(rng.integers(8, 30)),
            workload=(None, "math", "chat", "poetry")[i % 4],
            temperature=(0.0, 0.8, 1.0)[i % 3],
            top_p=(1.0, 0.9)[i % 2],
            top_k=(-1, 4, -1)[i % 3],
            seed=100 + i,
            arrival_step=int(rng.integers(0, 5)),
        )
        for i in range(n)
    ]


@functools.cache
def _engine_rows(mode: str) -> dict[str, list[dict[str, Any]]]:
    target, drafter = _models()
    cfg = EngineConfig(mode=mode, gamma=GAMMA, max_batch=4, cost_table=_trimming_table())
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)

    def emit(table: str, batch: list[dict[str, Any]] | pa.Table) -> None:
        rows[table].extend(batch.to_pylist() if isinstance(batch, pa.Table) else batch)

    Engine(target, drafter, cfg).run(_requests(9), emit, f"run-{mode}")
    return rows


def _arrays_from_rows(
    rows: dict[str, list[dict[str, Any]]], mode: str
) -> tuple[StepRecordBuilder, list[StepArrays]]:
    """The arrays the loop holds at each step, rebuilt from its row dicts. Values the builder
    must not read (draft log-probs outside a censored tail, greedy rows' log-probs) are
    poisoned so that reading them shows."""
    steps = rows["steps"]
    builder = StepRecordBuilder(
        steps[0]["run_id"],
        mode=mode,
        gamma=GAMMA,
        lag_steps=steps[0]["lag_steps"],
        dp_rank=steps[0]["dp_rank"],
    )
    index: dict[str, int] = {}
    by_fct: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows["req_steps"]:
        by_fct[r["forward_ct"]].append(r)
        if r["rid"] not in index:
            index[r["rid"]] = builder.register(
                r["rid"],
                workload=r["workload"],
                temperature=r["temperature"],
                top_p=r["top_p"],
                top_k=r["top_k"],
            )
    out = []
    for s in steps:
        reqs = by_fct[s["forward_ct"]]
        bs = len(reqs)
        censored = np.array([r["trimmed_tokens"] is not None for r in reqs])
        greedy = np.array([r["temperature"] == 0.0 for r in reqs])
        lp = np.full((bs, GAMMA), np.nan, dtype=np.float32)
        for i, r in enumerate(reqs):
            if r["q_lp"] is not None:
                lp[i, r["verify_len"] - 1 :] = 7.0 if greedy[i] else r["q_lp"]

        def col(name: str, dtype: type = np.int64, reqs: list = reqs) -> np.ndarray:
            return np.array([r[name] for r in reqs], dtype=dtype)

        out.append(
            StepArrays(
                forward_ct=s["forward_ct"],
                budget=s["budget"],
                num_verify_tokens=s["num_verify_tokens"],
                ts=s["ts"],
                req=np.array([index[r["rid"]] for r in reqs]),
                req_pool_index=col("req_pool_index"),
                prefix_len=col("prefix_len"),
                verify_len=col("verify_len"),
                acc_len=col("acc_len"),
                correct_drafts=col("correct_drafts"),
                cap_trim=col("cap_trim"),
                bonus_token=col("bonus_token"),
                is_last=col("is_last", bool),
                draft_tokens=np.array([r["draft_tokens"] for r in reqs]),
                confidence=np.array([r["confidence"] for r in reqs], dtype=np.float32),
                survival=np.array([r["survival"] for r in reqs], dtype=np.float32),
                censored=censored,
                draft_logprobs=lp,
                greedy=greedy,
                pg=PgEntries.from_rows([r["pg"] for r in reqs]),
                predicted_step_ms=s["predicted_step_ms"],
                predicted_theta=s["predicted_theta"],
                step_cpu_ms=s["step_cpu_ms"],
                draft_gpu_ms=s["draft_gpu_ms"],
                target_verify_gpu_ms=s["target_verify_gpu_ms"],
            )
        )
    return builder, out


def _assert_tables_equal(got: pa.Table, want: pa.Table) -> None:
    assert got.schema.equals(want.schema), (got.schema, want.schema)
    assert got.num_rows == want.num_rows
    for name in want.column_names:
        a, b = got.column(name).combine_chunks(), want.column(name).combine_chunks()
        assert a.equals(b), f"{name}: {a.to_pylist()[:4]} != {b.to_pylist()[:4]}"


@pytest.mark.parametrize("mode", ["compact", "cap-accept", "static"])
def test_column_builder_equals_row_dicts_on_a_real_engine_run(mode: str) -> None:
    rows = _engine_rows(mode)
    builder, steps = _arrays_from_rows(rows, mode)
    # The run exercises what the builder must get right, or the test proves little.
    req_rows = rows["req_steps"]
    assert len({s["bs"] for s in rows["steps"]}) > 1
    assert any(r["is_last"] for r in req_rows)
    if mode == "compact":
        assert any(r["trimmed_tokens"] for r in req_rows if r["temperature"] > 0)
        assert any(r["trimmed_tokens"] for r in req_rows if r["temperature"] == 0)
        assert sum(len(r["pg"] or ()) > 1 for r in req_rows) > 0
    if mode == "cap-accept":
        assert any(r["cap_trim"] > 0 for r in req_rows)

    # Built in two chunks (as a loop flushing every few steps would), then joined.
    half = len(steps) // 2
    tables: dict[str, list[pa.Table]] = defaultdict(list)
    for chunk in (steps[:half], steps[half:]):
        for s in chunk:
            builder.add(s)
        assert builder.pending_steps == len(chunk)
        for name, t in builder.build().items():
            tables[name].append(t)
        assert builder.pending_steps == 0
    for name in ("steps", "req_steps"):
        got = pa.concat_tables(tables[name])
        want, errors = validation.validate(name, rows[name])
        assert errors == []
        _assert_tables_equal(got, want)
        again, errors = validation.validate(name, got)  # nothing for validate to drop or cast
        assert errors == []
        _assert_tables_equal(again, got)


def _step(bs: int, **over: Any) -> StepArrays:
    z = np.zeros(bs, dtype=np.int64)
    base: dict[str, Any] = dict(
        forward_ct=0,
        budget=0,
        num_verify_tokens=bs,
        ts=datetime(2026, 1, 1, tzinfo=UTC),
        req=z,
        req_pool_index=z,
        prefix_len=z + 1,
        verify_len=z + 1,
        acc_len=z + 1,
        correct_drafts=z,
        cap_trim=z,
        bonus_token=z,
        is_last=z.astype(bool),
        draft_tokens=np.zeros((bs, GAMMA), dtype=np.int64),
        confidence=np.ones((bs, GAMMA), dtype=np.float32),
        survival=np.ones((bs, GAMMA), dtype=np.float32),
    )
    base.update(over)
    return StepArrays(**base)


def test_bad_steps_are_refused_where_they_are_added_naming_the_problem() -> None:
    b = StepRecordBuilder("r", mode="compact", gamma=GAMMA, lag_steps=2)
    b.register("a", workload=None, temperature=0.0, top_p=1.0, top_k=-1)
    with pytest.raises(StepRecordError, match="verify_len must have shape"):
        b.add(_step(2, verify_len=np.ones(3, dtype=np.int64)))
    with pytest.raises(StepRecordError, match=r"confidence must have shape \(2, 5\)"):
        b.add(_step(2, confidence=np.ones((2, 4))))
    with pytest.raises(StepRecordError, match="never registered"):
        b.add(_step(2, req=np.array([0, 1])))
    with pytest.raises(StepRecordError, match=r"greedy must have shape \(1,\)"):
        b.add(_step(1, greedy=np.array([True, False])))
    with pytest.raises(StepRecordError, match="need draft_logprobs"):
        b.add(_step(1, censored=np.array([True])))
    with pytest.raises(StepRecordError, match="timezone-aware"):
        b.add(_step(1, ts=datetime(2026, 1, 1)))
    assert b.pending_steps == 0
    b2 = StepRecordBuilder("r", mode="compact", gamma=GAMMA, lag_steps=2)
    b2.register("a", workload=None, temperature=0.0, top_p=1.0, top_k=-1)
    b2.add(_step(1))  # the good step is kept and builds
    assert b2.build()["req_steps"].num_rows == 1


def test_empty_build_gives_empty_tables_of_the_schema() -> None:
    tables = StepRecordBuilder("r", mode="static", gamma=GAMMA, lag_steps=0).build()
    assert tables["steps"].schema.equals(schema.STEPS) and tables["steps"].num_rows == 0
    assert tables["req_steps"].schema.equals(schema.REQ_STEPS)
    assert tables["req_steps"].num_rows == 0


def test_record_worker_builds_and_emits_off_the_calling_thread_in_order() -> None:
    rows = _engine_rows("compact")
    builder, steps = _arrays_from_rows(rows, "compact")
    seen: list[tuple[str, int, str]] = []

    def emit(table: str, batch: Any) -> None:
        n = batch.num_rows if isinstance(batch, pa.Table) else len(batch)
        seen.append((table, n, threading.current_thread().name))

    worker = RecordWorker(builder, emit, capacity=2)
    sizes = []
    for k in range(0, len(steps), 5):
        for s in steps[k : k + 5]:
            worker.add(s)
        sizes.append(sum(s.bs for s in steps[k : k + 5]))
        worker.flush(then=[("requests", [{"run_id": "x", "rid": f"q{k}"}])])
    worker.flush()  # nothing added: nothing handed over
    worker.close()
    assert [t for t, _, _ in seen] == ["steps", "req_steps", "requests"] * len(sizes)
    assert [n for t, n, _ in seen if t == "req_steps"] == sizes
    assert {name for _, _, name in seen} == {"dspark-obs-records"}
    stats = worker.stats
    assert (stats.enqueued, stats.done, stats.rows) == (len(sizes), len(sizes), sum(sizes))


def test_record_worker_raises_a_failure_at_the_next_hand_over() -> None:
    b = StepRecordBuilder("r", mode="compact", gamma=GAMMA, lag_steps=2)
    b.register("a", workload=None, temperature=0.0, top_p=1.0, top_k=-1)

    def emit(table: str, batch: Any) -> None:
        raise OSError("store gone")

    worker = RecordWorker(b, emit)
    worker.add(_step(1))
    worker.flush()
    with pytest.raises(OSError, match="store gone"):
        worker.drain()
    worker.add(_step(1))
    with pytest.raises(OSError, match="store gone"):
        worker.close()
