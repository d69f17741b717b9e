"""dspark-obs's SGLang records and files against the class definitions in the sglang wheel.

The wheel (sglang==0.5.23, downloaded by .ci/run into ~/.cache/dspark-obs/wheels) is opened
as a zip and its sources read with ``ast``; sglang is never imported (it needs CUDA). From
each msgspec class we rebuild a struct with the same fields, types, defaults and options,
and decode what dspark-obs writes with it: that is SGLang's own field rules (required
fields, types, omit_defaults), without SGLang's code.
"""

from __future__ import annotations

import ast
import json
import threading
import zipfile
from pathlib import Path
from typing import Any, Optional

import msgspec
import numpy as np
import pyarrow as pa
import pytest

from dspark_obs.analytics.sts import fit_sts
from dspark_obs.analytics.sts_shards import load_sts_shards, save_sts_shard
from dspark_obs.cost_table import AdditiveCostTable, CostTable, StepsPerSecTable
from dspark_obs.schema import REQ_STEPS, STEPS
from dspark_obs.sglang import records as ours
from dspark_obs.sglang.files import read_sps_records
from dspark_obs.sts_file import StsCalibration

WHEELS = Path.home() / ".cache" / "dspark-obs" / "wheels"
OBS = "sglang/srt/speculative/dspark_components/dspark_observability.py"
STS = "sglang/srt/speculative/dspark_components/dspark_sts.py"
SPS = "sglang/srt/speculative/dspark_components/dspark_sps.py"


def _wheel() -> Path:
    found = sorted(WHEELS.glob("sglang-0.5.23-*.whl"))
    if not found:
        pytest.skip(f"sglang 0.5.23 wheel not in {WHEELS} (.ci/run downloads it)")
    return found[0]


@pytest.fixture(scope="module")
def classes() -> dict[str, ast.ClassDef]:
    out = {}
    with zipfile.ZipFile(_wheel()) as zf:
        for member in (OBS, STS, SPS):
            tree = ast.parse(zf.read(member).decode())
            out.update({n.name: n for n in tree.body if isinstance(n, ast.ClassDef)})
    return out


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _type(node: ast.expr) -> Any:
    """An annotation of the wheel's source as a Python type (the subset these classes use)."""
    if isinstance(node, ast.Name):
        return _TYPES[node.id]
    if isinstance(node, ast.Constant) and node.value is None:
        return type(None)
    if isinstance(node, ast.Subscript):
        base = node.value.id  # type: ignore[attr-defined]
        if base == "Optional":
            return Optional[_type(node.slice)]  # noqa: UP045 - built from source text
        if base == "list":
            return list[_type(node.slice)]
    if isinstance(node, ast.BinOp):
        return _type(node.left) | _type(node.right)
    raise AssertionError(f"unhandled annotation {ast.dump(node)}")


def _fields(cls: ast.ClassDef) -> list[tuple[str, ast.expr, Any, bool]]:
    """(name, annotation, default, has_default) of each field, in order."""
    out = []
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            has = stmt.value is not None
            out.append(
                (
                    stmt.target.id,
                    stmt.annotation,
                    ast.literal_eval(stmt.value) if has else None,
                    has,
                )
            )
    return out


def _struct(cls: ast.ClassDef, nested: dict[str, type] | None = None) -> type:
    """The wheel class rebuilt with msgspec.defstruct: same fields, types, defaults, options."""
    nested = nested or {}
    kwargs = {k.arg: ast.literal_eval(k.value) for k in cls.keywords}
    fields = []
    for name, ann, default, has in _fields(cls):
        src = ast.unparse(ann)
        typ = (
            _type(ann)
            if not any(n in src for n in nested)
            else eval(  # noqa: S307
                src, {"Optional": Optional, "list": list, **nested}
            )
        )
        fields.append((name, typ, default) if has else (name, typ))
    return msgspec.defstruct(cls.name, fields, **kwargs)


# ---------------------------------------------------------------- step dump


def test_step_record_types_match_the_wheel(classes):
    for name, mine in (("DecodeStepRecord", ours.DecodeStepRecord), ("ReqDetail", ours.ReqDetail)):
        theirs = _fields(classes[name])
        assert [f[0] for f in theirs] == list(mine.__struct_fields__), name
        defaults = dict(
            zip(
                mine.__struct_fields__[-len(mine.__struct_defaults__) :],
                mine.__struct_defaults__,
                strict=True,
            )
        )
        for fname, _ann, default, has in theirs:
            assert (fname in defaults) == has, f"{name}.{fname}: required in one only"
            if has:
                assert defaults[fname] == default, f"{name}.{fname} default"
        kw = {k.arg: ast.literal_eval(k.value) for k in classes[name].keywords}
        assert kw.get("omit_defaults") and mine.__struct_config__.omit_defaults


def test_store_schema_covers_every_sglang_field(classes):
    steps, req_steps = set(STEPS.names), set(REQ_STEPS.names)
    for fname, *_ in _fields(classes["DecodeStepRecord"]):
        assert fname == "reqs" or fname in steps, f"steps lacks DecodeStepRecord.{fname}"
    for fname, *_ in _fields(classes["ReqDetail"]):
        assert fname in req_steps, f"req_steps lacks ReqDetail.{fname}"


def test_engine_server_records_decode_under_the_wheel_rules(classes):
    req_cls = _struct(classes["ReqDetail"])
    step_cls = _struct(classes["DecodeStepRecord"], {"ReqDetail": req_cls})
    step = {
        "forward_ct": 7,
        "bs": 2,
        "mode": "compact",
        "budget": 4,
        "lag_steps": 2,
        "num_running_reqs": 2,
        "num_verify_tokens": 6,
        "verify_tokens_local": 6,
        "predicted_step_ms": None,
        "predicted_theta": None,
        "step_cpu_ms": 3.141592,
    }
    reqs = [
        {
            "req_pool_index": i,
            "prefix_len": 10 + i,
            "verify_len": 3,
            "acc_len": 2,
            "correct_drafts": 1,
            "cap_trim": 0,
            "bonus_token": 5,
            "draft_tokens": [1, 2, 3],
            "rid": f"r{i}",
            "confidence": [0.912345, 0.5, 0.25],
            "survival": [0.912345, 0.4561725, 0.114],
        }
        for i in range(2)
    ]
    for comps in (frozenset(ours.COMPONENTS), frozenset({"core"}), frozenset({"step_cpu_time"})):
        body = msgspec.json.encode(ours.step_record(step, reqs, comps))
        back = msgspec.json.decode(body, type=step_cls)
        plain = json.loads(body)
        # omit_defaults: nothing at its default is written (SGLang's rule)
        assert "predicted_step_ms" not in plain and "step_gpu_ms" not in plain
        assert ("reqs" in plain) == ("reqs" in comps) and ("bs" in plain) == ("core" in comps)
        if "reqs" in comps:
            assert back.reqs[0].confidence == [0.9123, 0.5, 0.25]  # rounded to 4 decimals
        if "step_cpu_time" in comps:
            assert back.step_cpu_ms == 3.1416


def test_collector_reads_records_written_by_the_wheel_rules(classes):
    """Records encoded by the rebuilt SGLang classes parse into the store schema, defaults
    (left out of the JSON) becoming -1 / null, and a record without forward_ct is left out
    and named while the others of its chunk are kept."""
    req_cls = _struct(classes["ReqDetail"])
    step_cls = _struct(classes["DecodeStepRecord"], {"ReqDetail": req_cls})
    recs = [
        step_cls(
            forward_ct=3,
            bs=1,
            mode="cap-accept",
            reqs=[
                req_cls(
                    req_pool_index=0,
                    prefix_len=4,
                    verify_len=2,
                    acc_len=2,
                    correct_drafts=1,
                    cap_trim=2,
                    bonus_token=9,
                    draft_tokens=[1, 2, 3, 4, 5],
                )
            ],
        ),
        step_cls(forward_ct=4),
    ]
    raws = [msgspec.Raw(msgspec.json.encode(r)) for r in recs]
    (tab,) = ours.records_to_tables(
        raws, run_id="r", dp_rank=1, gamma=5, mode="cap-accept", fct_offset=100
    )
    assert tab.steps.column("forward_ct").to_pylist() == [103, 104]
    assert tab.steps.column("budget").to_pylist() == [-1, -1]
    assert tab.steps.column("mode").to_pylist() == ["cap-accept", "cap-accept"]
    (row,) = tab.req_steps.to_pylist()
    assert row["rid"] == "pool0" and row["cap_trim"] == 2 and row["confidence"] is None
    pretty = [msgspec.Raw(json.dumps(msgspec.to_builtins(r), indent=2).encode()) for r in recs]
    (again,) = ours.records_to_tables(
        pretty, run_id="r", dp_rank=1, gamma=5, mode="cap-accept", fct_offset=100
    )
    assert again.steps.equals(tab.steps) and again.req_steps.equals(tab.req_steps)
    (part,) = ours.records_to_tables(
        [raws[0], msgspec.Raw(b'{"bs": 2}')], run_id="r", dp_rank=0, gamma=5, mode=None
    )
    assert part.steps.column("forward_ct").to_pylist() == [3]
    assert len(part.errors) == 1 and part.errors[0].startswith("records[1]: ")
    assert "forward_ct" in part.errors[0]


def test_chunks_parsed_in_parallel_equal_the_serial_parse(classes):
    """Chunks parsed two at a time come out in record order, field-equal to one at a time;
    a wrongly typed record in any chunk is named by its index in the whole list and left out,
    its neighbours kept."""
    req_cls = _struct(classes["ReqDetail"])
    step_cls = _struct(classes["DecodeStepRecord"], {"ReqDetail": req_cls})
    recs = [
        step_cls(
            forward_ct=i,
            bs=2,
            mode="compact",
            reqs=[
                req_cls(
                    req_pool_index=j,
                    prefix_len=10 + i,
                    verify_len=3,
                    acc_len=2,
                    correct_drafts=1,
                    cap_trim=0,
                    bonus_token=i * 7 + j,
                    draft_tokens=[i, j, 1, 2, 3],
                    rid=f"r{j}",
                    confidence=[0.5] * 5,
                )
                for j in range(2)
            ],
        )
        for i in range(23)
    ]
    raws = [msgspec.Raw(msgspec.json.encode(r)) for r in recs]
    bad = {5: b'{"forward_ct": "5", "bs": 2}', 17: b'{"forward_ct": 17, "bs": 1.5}'}
    for i, body in bad.items():
        raws[i] = msgspec.Raw(body)

    def run(workers: int) -> tuple[Any, Any, list[str]]:
        parts = list(
            ours.records_to_tables(
                raws, run_id="r", dp_rank=0, gamma=5, mode=None, chunk=4, workers=workers
            )
        )
        steps = pa.concat_tables([t.steps for t in parts])
        reqs = pa.concat_tables([t.req_steps for t in parts])
        return steps, reqs, [e for t in parts for e in t.errors]

    steps, reqs, errors = run(2)
    want = [i for i in range(23) if i not in bad]
    assert steps.column("forward_ct").to_pylist() == want
    assert reqs.column("bonus_token").to_pylist() == [i * 7 + j for i in want for j in range(2)]
    assert [e.split(":")[0] for e in errors] == ["records[5]", "records[17]"]
    serial = run(1)
    assert steps.equals(serial[0]) and reqs.equals(serial[1]) and errors == serial[2]
    # a caller that stops early (a store error mid-poll) leaves no parse thread behind
    chunks = ours.records_to_tables(raws, run_id="r", dp_rank=0, gamma=5, mode=None, chunk=2)
    next(chunks)
    chunks.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("dump-parse")]


# ---------------------------------------------------------------- STS and SPS files


def _post_init_checks(cls: ast.ClassDef) -> str:
    return ast.unparse(
        next(s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "__post_init__")
    )


def test_sts_json_decodes_under_the_wheel_rules(classes, tmp_path):
    sts_cls = _struct(classes["DSparkStsCalibration"])
    rng = np.random.default_rng(0)
    logits = rng.normal(1.0, 2.0, size=(400, 4)).astype(np.float32)
    correct = rng.integers(0, 5, size=400)
    mask = (np.arange(4)[None, :] < correct[:, None]).astype(np.float32)
    save_sts_shard(tmp_path / "sts.0.pt", logits, mask)  # the shard SGLang's recorder writes
    data = load_sts_shards(str(tmp_path / "sts.*.pt"))
    cal = fit_sts(data.logits, data.prefix_mask, dataset="unit")
    cal.save(tmp_path / "sts.json")
    back = msgspec.json.decode((tmp_path / "sts.json").read_bytes(), type=sts_cls)
    assert len(back.temperatures) == 4 and all(t > 0 for t in back.temperatures)
    assert back.num_samples == 400 and len(back.ece_before) == len(back.ece_after) == 4
    assert "temperature <= 0" in _post_init_checks(classes["DSparkStsCalibration"])
    # what SGLang refuses, dspark-obs refuses too
    with pytest.raises(ValueError, match="temperatures"):
        StsCalibration(temperatures=[1.0, 0.0])


def test_sps_tables_decode_under_the_wheel_rules(classes, tmp_path):
    one_d = _struct(classes["SpsCostTable"])
    additive = _struct(classes["SpsAdditiveCostTable"])
    t1 = StepsPerSecTable.from_dict(
        {
            "sample_batch_tokens": [1, 8, 64],
            "sample_steps_per_sec": [100.0, 80.0, 20.0],
            "max_batch_tokens": 64,
        }
    )
    t2 = AdditiveCostTable.from_dict(
        {
            "bias_seconds": 0.01,
            "bs_probes": [1, 16],
            "alpha_seconds": [0.0, 0.002],
            "m_probes": [1, 64],
            "theta_seconds": [0.0, 0.05],
        }
    )
    for table, cls in ((t1, one_d), (t2, additive)):
        path = tmp_path / f"{cls.__name__}.json"
        table.save(path)
        back = msgspec.json.decode(path.read_bytes(), type=cls)
        assert msgspec.structs.asdict(back) == {
            k: v for k, v in table.to_dict().items() if k in cls.__struct_fields__
        }
        assert CostTable.load(path).to_dict() == table.to_dict()
        # SGLang tells the shapes apart by the key "bias_seconds"
        assert ('"bias_seconds"' in path.read_text()) == (cls is additive)


def test_a_table_with_a_host_block_decodes_under_the_wheel_rules(classes):
    """The ``host`` block dspark-obs profiles write is an unknown key SGLang ignores."""
    additive = _struct(classes["SpsAdditiveCostTable"])
    shipped = Path(__file__).resolve().parents[1] / "runtime/cost_tables/smollm2_cpu_batched.json"
    assert "host" in json.loads(shipped.read_text())
    back = msgspec.json.decode(shipped.read_bytes(), type=additive)
    assert back.bias_seconds == CostTable.load(shipped).to_dict()["bias_seconds"]


def test_sps_profiler_records_are_ingested(tmp_path):
    lines = [
        {
            "repeat": 0,
            "batch_size": 4,
            "batch_size_per_rank": 4,
            "dp_rank": 0,
            "forward_ct": 10 + i,
            "num_running_reqs": 4,
            "num_verify_tokens": 4 + i,
            "step_time": 0.012 + i / 1000,
        }
        for i in range(3)
    ]
    text = "\n".join(json.dumps(x) for x in lines)
    text += '\n{"dp_rank": 0, "forward_ct": 99\n' + json.dumps(lines[0]) + "\n"
    (tmp_path / "t.records.jsonl").write_text(text)
    table, errors = read_sps_records(tmp_path / "t.records.jsonl", run_id="prof")
    assert table.num_rows == 3
    assert table.column("step_cpu_ms").to_pylist() == pytest.approx([12.0, 13.0, 14.0])
    assert [e.line for e in errors] == [4, 5]
    assert "duplicate" in errors[1].reason


def test_saved_cap_accept_dump_gets_its_runs_row_and_full_calibration(tmp_path):
    """A step dump ingested through the library writes a runs row with the server's mode, so
    a cap-accept dump's positions past the window count as observed (not as compact)."""
    from dspark_obs.analytics.calibration import position_labels
    from dspark_obs.fanout import FanOut
    from dspark_obs.sglang import ingest_dump
    from dspark_obs.store import Store

    rng = np.random.default_rng(1)
    records = []
    for fct in range(40):
        correct = int(rng.integers(0, 6))
        window = int(rng.integers(1, 7))
        kept = min(correct, window - 1)
        conf = np.round(rng.uniform(0.2, 0.95, 5), 4)
        records.append(
            {
                "forward_ct": fct,
                "bs": 1,
                "mode": "cap-accept",
                "reqs": [
                    {
                        "req_pool_index": 0,
                        "prefix_len": 10 + fct,
                        "verify_len": window,
                        "acc_len": kept + 1,
                        "correct_drafts": kept,
                        "cap_trim": correct - kept,
                        "bonus_token": 3,
                        "draft_tokens": [1, 2, 3, 4, 5],
                        "rid": "r0",
                        "confidence": conf.tolist(),
                        "survival": np.round(np.cumprod(conf), 4).tolist(),
                    }
                ],
            }
        )
    dump = {
        "mode": "cap-accept",
        "gamma": 5,
        "verify_num_draft_tokens": 6,
        "components": ["core", "reqs"],
        "records": records,
    }
    store = Store(tmp_path / "store")
    res = ingest_dump(dump, "dump-1", FanOut([store]), model="m", drafter="d")
    assert (res.steps, res.req_steps, res.rejected) == (40, 40, 0)
    runs = store.query("FROM runs").to_pylist()
    assert [(r["mode"], r["gamma"], r["source"], r["model"]) for r in runs] == [
        ("cap-accept", 5, "sglang", "m")
    ]
    rows = store.query("FROM req_steps").to_pandas()
    full = position_labels(rows, store.query("FROM runs").to_pandas())
    as_compact = position_labels(rows, {"dump-1": "compact"})
    assert full["observed"].sum() > as_compact["observed"].sum()
    assert full["observed"].sum() == len(full)  # cap-accept verified every position


def test_cli_ingest_dump_with_profiler_records(tmp_path):
    from typer.testing import CliRunner

    from dspark_obs.cli import app
    from dspark_obs.store import Store

    dump = {
        "mode": "compact",
        "gamma": 5,
        "verify_num_draft_tokens": 6,
        "components": ["core", "step_cpu_time"],
        "records": [
            {"forward_ct": i, "bs": 2, "mode": "compact", "step_cpu_ms": 5.0 + i} for i in range(4)
        ],
    }
    (tmp_path / "dump.json").write_text(
        json.dumps({"model_path": "m", "internal_states": [{"dspark_info_record": dump}, {}]})
    )
    (tmp_path / "t.records.jsonl").write_text(
        json.dumps(
            {
                "dp_rank": 0,
                "forward_ct": 1,
                "num_running_reqs": 2,
                "num_verify_tokens": 9,
                "step_time": 0.01,
            }
        )
        + "\n"
    )
    res = CliRunner().invoke(
        app,
        [
            "ingest-dump",
            str(tmp_path / "dump.json"),
            "--run-id",
            "d",
            "--store",
            str(tmp_path / "s"),
            "--sps-records",
            str(tmp_path / "t.records.jsonl"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert (
        "d: 4 steps and 0 request-steps newly stored, 0 steps already stored, 0 rejected"
        in res.output
    )
    st = Store(tmp_path / "s")
    assert st.query("SELECT run_id, mode, dp_size FROM runs ORDER BY run_id").to_pylist() == [
        {"run_id": "d", "mode": "compact", "dp_size": 2},
        {"run_id": "d-sps", "mode": "static", "dp_size": 2},
    ]
    (tmp_path / "bad.json").write_text('{"internal_states": [{"dspark_info_record": {"reco')
    res = CliRunner().invoke(
        app,
        [
            "ingest-dump",
            str(tmp_path / "bad.json"),
            "--run-id",
            "x",
            "--store",
            str(tmp_path / "s"),
        ],
    )
    assert res.exit_code == 1 and "bad.json" in res.output and "Traceback" not in res.output
