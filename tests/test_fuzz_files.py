"""Files from outside, fuzzed: any bytes give the reader's own clear error, never a traceback.

Readers covered: cost tables (``CostTable.load``), STS JSON (``StsCalibration.load``), STS
shards (``load_sts_shards``), SGLang's estimator JSONL (``read_estimator_jsonl``, then
``estimate_blocks`` on what it kept, and the ``ingest-estimator`` command end to end).
Inputs are random bytes, random JSON, and near-valid files whose fields hold random values.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dspark_obs.analytics import (
    EstimatorFileError,
    estimate_blocks,
    load_sts_shards,
    read_estimator_jsonl,
)
from dspark_obs.cli import app
from dspark_obs.cost_table import CostTable, CostTableError
from dspark_obs.sts_file import StsCalibration, StsFileError

# database=None: nothing is written under the repository (.hypothesis/)
FUZZ = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-3, max_value=12)
    | st.integers()
    | st.sampled_from([10**8, 2**63, -(2**63) - 1, 10**400])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=20,
)


def _dump(value: object) -> str:
    return json.dumps(value, allow_nan=True)


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def _file_texts(template: dict) -> st.SearchStrategy[bytes]:
    """Random bytes, random JSON, deep nesting, and the template with fields replaced."""
    keys = sorted(template)
    mutated = st.fixed_dictionaries(
        {},
        optional={k: json_values | st.just(template[k]) for k in keys},
    ).map(lambda d: _dump(d).encode())
    return st.one_of(
        st.binary(max_size=400),
        json_values.map(lambda v: _dump(v).encode()),
        mutated,
        st.sampled_from([_deep(100_000).encode(), b"\xff\xfe{}", ("1" * 6000).encode()]),
        mutated.map(lambda b: b[: len(b) // 2]),
    )


def _write(data: bytes, suffix: str) -> Path:
    fd, name = tempfile.mkstemp(suffix=suffix)
    with open(fd, "wb") as fh:
        fh.write(data)
    return Path(name)


def _expect_clear(call, path: Path, error: type[Exception]) -> None:
    try:
        call()
    except error as exc:
        assert str(path) in str(exc), exc
        assert len(str(exc)) < 2000
    finally:
        path.unlink(missing_ok=True)


ADDITIVE = {
    "bias_seconds": 0.01,
    "bs_probes": [1, 4],
    "alpha_seconds": [0.0, 0.001],
    "m_probes": [1, 8],
    "theta_seconds": [0.0, 0.01],
}
ONE_D = {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [90.0, 20.0], "max_batch_tokens": 8}
STS = {"temperatures": [1.0, 0.9], "dataset": "x", "num_samples": 3, "ece_before": [0.1, 0.2]}


@FUZZ
@given(data=st.one_of(_file_texts(ADDITIVE), _file_texts(ONE_D)))
def test_cost_table_reader_never_tracebacks(data: bytes) -> None:
    path = _write(data, ".json")

    def load() -> None:
        table = CostTable.load(path)
        for bs in (1, 3, 64):  # whatever was accepted predicts positive finite step times
            sec = table.step_seconds(bs, 5)
            assert math.isfinite(sec) and sec > 0

    _expect_clear(load, path, CostTableError)


@FUZZ
@given(data=_file_texts(STS))
def test_sts_json_reader_never_tracebacks(data: bytes) -> None:
    path = _write(data, ".json")

    def load() -> None:
        cal = StsCalibration.load(path)
        assert 1 <= cal.gamma <= 64 and all(t > 0 for t in cal.temperatures)

    _expect_clear(load, path, StsFileError)


@FUZZ
@given(data=_file_texts(STS))
def test_the_drafters_sts_reader_never_tracebacks(data: bytes) -> None:
    """Drafter.set_sts(path) (``run --sts`` for the drafter): the same bounded reading."""
    drafter = _tiny_drafter()
    path = _write(data, ".json")

    def load() -> None:
        drafter.set_sts(path)
        temps = drafter.sts_temperatures.tolist()
        assert temps and all(math.isfinite(t) and t > 0 for t in temps)

    _expect_clear(load, path, ValueError)


def test_the_drafters_sts_reader_names_deep_nesting(tmp_path: Path) -> None:
    path = tmp_path / "sts.json"
    path.write_text('{"temperatures": ' + _deep(100_000) + "}")
    with pytest.raises(ValueError, match="nested deeper than"):
        _tiny_drafter().set_sts(path)


def _tiny_drafter() -> Any:
    from dspark_obs.engine.drafter import Drafter
    from dspark_obs.engine.drafter_config import DrafterConfig
    from dspark_obs.engine.model import ModelConfig, Target

    target = Target(ModelConfig.tiny())
    return Drafter(DrafterConfig.for_target(target, num_layers=1, gamma_max=4), target)


TRAFFIC_LINE = {
    "prompt": {"id": "p", "workload": "chat", "messages": [{"role": "user", "content": "hi"}]},
    "arrival_step": 0,
    "max_new_tokens": 8,
}


@FUZZ
@given(
    lines=st.lists(
        st.one_of(_file_texts(TRAFFIC_LINE), st.just(json.dumps(TRAFFIC_LINE).encode())), max_size=4
    )
)
def test_the_workload_file_reader_never_tracebacks(lines: list[bytes]) -> None:
    from dspark_obs.workloads import WorkloadFileError, load_traffic

    path = _write(b"\n".join(line.replace(b"\n", b" ") for line in lines), ".jsonl")
    _expect_clear(lambda: load_traffic(path), path, WorkloadFileError)


@pytest.mark.parametrize(
    "line",
    [
        _deep(100_000),
        '{"a": ' + "1" * 6000 + "}",
        '{"prompt": ' + "{" * 50_000 + "}" * 50_000 + "}",
    ],
)
def test_the_workload_file_reader_names_the_line(tmp_path: Path, line: str) -> None:
    from dspark_obs.workloads import WorkloadFileError, load_traffic

    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps(TRAFFIC_LINE) + "\n" + line + "\n")
    with pytest.raises(WorkloadFileError, match=r":2\b|line 2"):
        load_traffic(path)


tensors = st.builds(
    lambda shape, dtype, fill: torch.full(shape, fill).to(dtype),
    st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
    | st.sampled_from([(3, 100), (2, 5)]),
    st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bool, torch.complex64]),
    st.sampled_from([0.0, 1.0, 0.5, 2.0, -1.0, float("nan"), float("inf")]),
)
shard_values = tensors | json_values


@FUZZ
@given(
    kind=st.sampled_from(["bytes", "object"]),
    raw=st.binary(max_size=300),
    obj=st.one_of(
        st.fixed_dictionaries({}, optional={"logits": shard_values, "prefix_mask": shard_values}),
        json_values,
    ),
)
def test_sts_shard_reader_never_tracebacks(kind: str, raw: bytes, obj: object) -> None:
    path = _write(raw, ".pt")
    if kind == "object":
        torch.save(obj, str(path))

    def load() -> None:
        data = load_sts_shards([path])
        assert np.isfinite(data.logits).all()
        assert set(np.unique(data.prefix_mask)) <= {0.0, 1.0}

    _expect_clear(load, path, StsFileError)


def test_sts_shard_names_nan_logits_and_bad_masks(tmp_path: Path) -> None:
    good = torch.zeros(4, 5)
    for field, logits, mask, needle in (
        ("logits", good.clone().index_fill_(0, torch.tensor([2]), float("nan")), good, "row 2"),
        ("prefix_mask", good, good.clone().fill_(0.5), "0 or 1"),
        ("logits", [[0.0] * 5] * 4, good, "must be a tensor, got list"),
    ):
        path = tmp_path / f"{field}.pt"
        torch.save({"logits": logits, "prefix_mask": mask}, str(path))
        with pytest.raises(StsFileError, match=needle) as info:
            load_sts_shards([path])
        assert str(path) in str(info.value) and field in str(info.value)


records = st.fixed_dictionaries(
    {},
    optional={
        "rid": st.sampled_from(["a", "b"]) | json_values,
        "fct": st.integers(0, 6) | json_values,
        "w": st.integers(0, 5) | st.sampled_from([10**8, 64, 65]) | json_values,
        "cl": st.integers(0, 5) | json_values,
        "ct": st.integers(0, 3) | json_values,
        "trimmed_tokens": st.lists(st.integers(0, 9), max_size=6) | json_values,
        "q_lp": st.lists(st.floats(-5, 0), max_size=6) | json_values,
        "pg": st.lists(
            st.tuples(
                st.integers(0, 6),
                st.integers(0, 7),
                st.floats(-9, 0),
                st.integers(0, 9),
                st.integers(0, 9),
            ).map(list)
            | json_values,
            max_size=4,
        )
        | json_values,
        "eos_end": st.lists(st.integers(0, 6), max_size=2) | json_values,
    },
)
jsonl_lines = st.lists(
    records.map(_dump).map(str.encode)
    | st.binary(max_size=60)
    | json_values.map(_dump).map(str.encode),
    max_size=12,
)


@FUZZ
@given(lines=jsonl_lines, gamma=st.sampled_from([None, 5]))
def test_estimator_jsonl_reader_never_tracebacks(lines: list[bytes], gamma: int | None) -> None:
    data = b"\n".join(line.replace(b"\n", b" ") for line in lines)
    path = _write(data, ".jsonl")
    try:
        frame, errors = read_estimator_jsonl(path, gamma=gamma)
        n_lines = data.count(b"\n") + 1
        for err in errors:
            assert 1 <= err.line <= n_lines and err.reason
        kept = frame["line"].tolist()
        assert len(set(kept)) == len(kept) <= n_lines and all(1 <= k <= n_lines for k in kept)
        if len(frame):
            assert int(frame["gamma"].max()) <= 64
            est = estimate_blocks(frame)
            assert len(est.blocks) == len(frame)
            assert np.isfinite(est.blocks["lo"]).all()
            assert (est.blocks["lo"] <= est.blocks["hi"]).all()
    finally:
        path.unlink(missing_ok=True)


def test_estimator_jsonl_bounded_memory_cases(tmp_path: Path) -> None:
    path = tmp_path / "est.jsonl"
    good = {"rid": "a", "fct": 0, "w": 2, "cl": 1, "ct": 0}
    path.write_bytes(
        b"\n".join(
            [
                json.dumps(good).encode(),
                json.dumps({**good, "fct": 1, "w": 10**8, "cl": 10**8}).encode(),
                b'{"rid": "a", "fct": 2, "w": 1, "cl": 1, "ct": 1' + b"0" * 5000 + b"}",
                _deep(100_000).encode(),
                b"\xff\xfe\xfd",
                b'{"rid": "' + b"x" * (2 << 20) + b'"}',
            ]
        )
    )
    frame, errors = read_estimator_jsonl(path)
    assert len(frame) == 1 and int(frame["gamma"].iloc[0]) == 2
    reasons = {e.line: e.reason for e in errors}
    assert "'w' must be in 0..64" in reasons[2]
    assert "not valid JSON" in reasons[3]
    assert "nested deeper" in reasons[4]
    assert "not UTF-8" in reasons[5]
    assert "longer than" in reasons[6]
    with pytest.raises(EstimatorFileError, match=str(tmp_path)):
        read_estimator_jsonl(tmp_path)  # a directory


@settings(max_examples=15, deadline=None, database=None)
@given(lines=jsonl_lines)
def test_ingest_estimator_command_never_tracebacks(lines: list[bytes]) -> None:
    path = _write(b"\n".join(line.replace(b"\n", b" ") for line in lines), ".jsonl")
    try:
        res = CliRunner().invoke(app, ["ingest-estimator", str(path), "--boot", "5"])
        assert res.exit_code in (0, 2), res.output
        assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
        if res.exit_code == 2:
            assert "error:" in res.output and str(path) in res.output
    finally:
        path.unlink(missing_ok=True)
