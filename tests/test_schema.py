"""Schema: SGLang DecodeStepRecord / ReqDetail round trip through the store, and every
validation rule (the message names the field and the value; good rows of a batch are kept)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from dspark_obs import schema, validation
from dspark_obs.store import Store
from dspark_obs.testing import sglang_roundtrip

GAMMA = 5


def _req(i: int, fct: int, **over: Any) -> dict[str, Any]:
    conf = [round(0.95 - 0.1 * j - 0.01 * i, 4) for j in range(GAMMA)]
    surv = [round(math.prod(conf[: j + 1]), 4) for j in range(GAMMA)]
    req = {
        "req_pool_index": i,
        "prefix_len": 100 + 7 * fct + i,
        "verify_len": 1 + (fct + i) % (GAMMA + 1),
        "acc_len": 0,
        "correct_drafts": 0,
        "cap_trim": 0,
        "bonus_token": 1000 + i,
        "draft_tokens": [31 * i + j for j in range(GAMMA)],
        "rid": f"req-{i}",
        "confidence": conf,
        "survival": surv,
    }
    req["correct_drafts"] = max(0, req["verify_len"] - 1 - i % 2)
    req["acc_len"] = req["correct_drafts"] + 1
    req["cap_trim"] = min(1, GAMMA - req["correct_drafts"]) if i % 2 == 0 else 0
    req.update(over)
    return req


def sglang_dump() -> dict[str, Any]:
    """An ``internal_states[i]["dspark_info_record"]`` with every field SGLang may send."""
    full = {
        "forward_ct": 11,
        "bs": 3,
        "mode": "cap-accept",
        "budget": 4,
        "lag_steps": 2,
        "num_running_reqs": 3,
        "num_verify_tokens": 9,
        "verify_tokens_local": 9,
        "verify_tokens_dp_synced": 12,
        "verify_tokens_graph_key": 16,
        "predicted_step_ms": 12.625,
        "predicted_theta": 0.3125,
        "step_cpu_ms": 13.0625,
        "step_gpu_ms": 11.5,
        "draft_gpu_ms": 2.25,
        "target_verify_gpu_ms": 8.75,
        "reqs": [_req(i, 11) for i in range(3)],
    }
    sparse = {"forward_ct": 12, "mode": "cap-accept", "bs": 2, "step_cpu_ms": 9.5,
              "reqs": [_req(i, 12) for i in range(2)]}
    no_reqs = {"forward_ct": 13, "mode": "cap-accept", "bs": 2}
    return {"mode": "cap-accept", "gamma": GAMMA, "verify_num_draft_tokens": GAMMA + 1,
            "components": ["core", "reqs"], "records": [full, sparse, no_reqs]}


def test_sglang_dump_covers_every_field() -> None:
    full = sglang_dump()["records"][0]
    assert set(full) == {"forward_ct", "mode", "reqs", *schema.SGLANG_STEP_INT_FIELDS,
                         *schema.SGLANG_STEP_FLOAT_FIELDS}
    assert set(full["reqs"][0]) == {*schema.SGLANG_REQ_INT_FIELDS, "draft_tokens", "rid",
                                    "confidence", "survival"}


def test_sglang_round_trip_through_the_store(tmp_path: Path) -> None:
    dump = sglang_dump()
    steps, req_steps = sglang_roundtrip.steps_from_sglang(dump, run_id="sg-1", dp_rank=1)
    s_batch, s_err = validation.validate("steps", steps)
    r_batch, r_err = validation.validate("req_steps", req_steps)
    assert not s_err and not r_err
    with Store(tmp_path / "store") as store:
        store.write("steps", s_batch)
        store.write("req_steps", r_batch)
    store = Store(tmp_path / "store")
    back_steps = store.query("SELECT * FROM steps ORDER BY forward_ct").to_pylist()
    back_reqs = store.query(
        "SELECT * FROM req_steps ORDER BY forward_ct, req_pool_index"
    ).to_pylist()
    assert {r["run_id"] for r in back_steps} == {"sg-1"}
    assert {r["dp_rank"] for r in back_reqs} == {1}
    assert all(r["gamma"] == GAMMA for r in back_reqs)
    rebuilt = []
    for orig, step in zip(dump["records"], back_steps, strict=True):
        reqs = [r for r in back_reqs if r["forward_ct"] == step["forward_ct"]]
        rebuilt.append(sglang_roundtrip.step_to_sglang(step, reqs if "reqs" in orig else None))
    assert rebuilt == dump["records"]


def test_sglang_defaults_mode_and_rid() -> None:
    dump = sglang_dump()
    del dump["records"][2]["mode"]
    del dump["records"][0]["reqs"][1]["rid"]
    steps, reqs = sglang_roundtrip.steps_from_sglang(dump, run_id="r")
    assert steps[2]["mode"] == "cap-accept" and steps[2]["source"] == "sglang"
    assert reqs[1]["rid"] == "pool1"
    batch, errors = validation.validate("steps", steps)
    assert not errors
    assert batch.column("budget").to_pylist() == [4, -1, -1]  # absent int fields: -1
    assert sglang_roundtrip.step_to_sglang(batch.to_pylist()[2]) == {
        "forward_ct": 13, "mode": "cap-accept", "bs": 2
    }


# ------------------------------------------------------------------- validation rules


def _row(**over: Any) -> dict[str, Any]:
    row = {"run_id": "r", "dp_rank": 0, "forward_ct": 5, "gamma": GAMMA, "is_last": False,
           **_req(0, 5)}
    row.update(over)
    return {k: v for k, v in row.items() if v is not _DROP}


_DROP = object()
NAN, INF = float("nan"), float("inf")


def _one_error(table: str, rows: list[dict[str, Any]] | pa.Table) -> validation.RecordError:
    batch, errors = validation.validate(table, rows)
    assert batch.num_rows == 0 and len(errors) == 1, errors
    return errors[0]


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("verify_len", "three", "expected int64"),
        ("forward_ct", 2.5, "expected int64"),
        ("draft_tokens", "abc", "expected list"),
        ("confidence", [0.9, NAN, 0.5, 0.4, 0.3], "finite probability"),
        ("confidence", [0.9, 0.8, INF, 0.4, 0.3], "finite probability"),
        ("survival", [0.9, 0.8, 0.7, 1.2, 0.3], "finite probability"),
        ("survival", [0.9, -0.1, 0.5, 0.4, 0.3], "finite probability"),
        ("confidence", [0.9, 0.8, 0.7, 0.6], "length must equal gamma"),
        ("survival", [0.9, 0.8, 0.7, 0.6, 0.5, 0.4], "length must equal gamma"),
        ("draft_tokens", [1, 2, 3], "length must equal gamma"),
        ("verify_len", 0, "verify_len must be in 1..gamma+1"),
        ("verify_len", GAMMA + 2, "verify_len must be in 1..gamma+1"),
        ("temperature", NAN, "finite"),
        ("temperature", -0.5, ">= 0"),
        ("run_id", _DROP, "required field is missing"),
        ("rid", _DROP, "required field is missing"),
        ("forward_ct", None, "required field is missing"),
    ],
)
def test_each_req_step_rule_names_field_and_value(field: str, value: Any, reason: str) -> None:
    err = _one_error("req_steps", [_row(**{field: value})])
    assert err.field == field and reason in err.reason
    text = str(err)
    assert f".{field}=" in text and reason in text
    shown = None if value is _DROP else value
    if isinstance(shown, list) and not all(math.isfinite(v) for v in shown):
        assert "nan" in text or "inf" in text
    elif isinstance(shown, list):
        assert len(err.value) == len(shown)
    else:
        assert repr(shown) in text


def test_acc_len_must_be_correct_drafts_plus_one_except_on_the_last_step() -> None:
    short = {"verify_len": 4, "correct_drafts": 3, "acc_len": 2, "cap_trim": 0}
    err = _one_error("req_steps", [_row(**short)])
    assert err.field == "acc_len" and err.value == 2 and "correct_drafts+1" in err.reason
    batch, errors = validation.validate("req_steps", [_row(**short, is_last=True)])
    assert batch.num_rows == 1 and not errors  # EOS / length limit cut the final commit
    err = _one_error("req_steps", [_row(verify_len=4, correct_drafts=1, acc_len=3, is_last=True)])
    assert err.field == "acc_len" and err.value == 3  # never more than correct_drafts+1
    err = _one_error("req_steps", [_row(verify_len=2, correct_drafts=2, acc_len=3)])
    assert err.field == "correct_drafts"  # cannot accept more drafts than were verified


def test_valid_rows_of_a_batch_are_kept_and_rows_numbered_as_given() -> None:
    rows = [
        _row(forward_ct=0),
        _row(forward_ct=1, verify_len="x"),  # type error (slow path drops it first)
        _row(forward_ct=2),
        _row(forward_ct=3, confidence=[0.5] * 4),  # rule error after the type error
        _row(forward_ct=4, run_id=_DROP),
        _row(forward_ct=5),
    ]
    batch, errors = validation.validate("req_steps", rows)
    assert batch.column("forward_ct").to_pylist() == [0, 2, 5]
    assert [(e.row, e.field) for e in errors] == [(1, "verify_len"), (3, "confidence"),
                                                  (4, "run_id")]


def test_arrow_batches_are_validated_too() -> None:
    good, _ = validation.validate("req_steps", [_row(forward_ct=f) for f in range(3)])
    conf = pa.array(
        [[0.5] * GAMMA, [0.5, NAN, 0.5, 0.5, 0.5], [0.5] * GAMMA], pa.list_(pa.float32())
    )
    bad = good.set_column(good.schema.get_field_index("confidence"), "confidence", conf)
    bad = bad.set_column(0, "run_id", pa.array(["r", "r", None]))
    batch, errors = validation.validate("req_steps", bad)
    assert batch.num_rows == 1
    assert [(e.row, e.field) for e in errors] == [(1, "confidence"), (2, "run_id")]
    with pytest.raises(validation.SchemaError, match="missing required column"):
        validation.validate("req_steps", good.drop_columns(["rid"]))


@pytest.mark.parametrize(
    ("table", "row", "field"),
    [
        ("steps", {"run_id": "r", "dp_rank": 0, "forward_ct": 1, "step_gpu_ms": NAN},
         "step_gpu_ms"),
        ("steps", {"run_id": "r", "dp_rank": 0, "forward_ct": 1, "mode": "turbo"}, "mode"),
        ("steps", {"run_id": "r", "dp_rank": 0, "forward_ct": -1}, "forward_ct"),
        ("runs", {"run_id": "r", "source": "engine", "mode": "compact", "gamma": 0}, "gamma"),
        ("runs", {"run_id": "r", "source": "vllm", "mode": "compact", "gamma": 5}, "source"),
        ("runs", {"source": "engine", "mode": "compact", "gamma": 5}, "run_id"),
        ("requests", {"run_id": "r", "rid": "q", "finish_reason": "eos"}, "finish_reason"),
        ("requests", {"run_id": "r", "rid": "q", "finish_time": INF}, "finish_time"),
    ],
)
def test_other_tables_rules(table: str, row: dict[str, Any], field: str) -> None:
    err = _one_error(table, [row])
    assert err.field == field and f".{field}=" in str(err)


def test_schema_is_declarations_and_validation_sits_above_the_rules() -> None:
    """schema.py imports no project module; rules.py only schema; validation.py schema and
    rules (no circle, nothing deferred to the bottom of a module)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "dspark_obs"

    def project_imports(name: str) -> set[str]:
        tree = ast.parse((root / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dspark_obs"):
                mod = node.module or ""
                found |= {f"{mod}.{a.name}" if mod == "dspark_obs" else mod for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("dspark_obs")}
        return found

    assert project_imports("schema") == set()
    assert project_imports("rules") == {"dspark_obs.schema"}
    assert project_imports("validation") == {"dspark_obs.rules", "dspark_obs.schema"}
    assert not hasattr(schema, "validate") and not hasattr(schema, "is_validated")
