"""One encoder and one decoder per SGLang payload, and the decoder's strict typing.

The step dump: :func:`records.step_record` renders rows, :func:`records.records_to_tables`
reads them back (column-wise); a record with a wrongly typed, missing or out-of-range field is
left out and named, its chunk's other records kept. The estimator JSONL:
:mod:`sglang.estimator_writer` writes what ``analytics.estimator_jsonl`` reads. (The wheel's
own types judge these encoders in test_sglang_formats.py; SGLang-built bodies go through the
decoder in test_sglang_wheel_collect.py.)
"""

from __future__ import annotations

import json
import math

import msgspec
import pytest

from dspark_obs.analytics.estimator_jsonl import parse_estimator_lines
from dspark_obs.sglang import records
from dspark_obs.sglang.estimator_writer import EstimatorWriter, eos_line, estimator_line

GAMMA = 3


def _req(i: int, fct: int) -> dict:
    conf = [0.91234, 0.5, 0.25][: 1 + i % GAMMA]
    return {
        "req_pool_index": i,
        "prefix_len": 10 + fct,
        "verify_len": 1 + i % (GAMMA + 1),
        "acc_len": 1,
        "correct_drafts": 0,
        "cap_trim": i % 2,
        "bonus_token": 100 + i,
        "draft_tokens": [7, 8, 9][: 1 + i % GAMMA],
        "rid": f"r{i}",
        "confidence": conf,
        "survival": [math.prod(conf[: j + 1]) for j in range(len(conf))],
    }


def _step(fct: int, bs: int) -> dict:
    return {
        "forward_ct": fct,
        "bs": bs,
        "mode": "compact",
        "budget": bs,
        "lag_steps": 2,
        "num_running_reqs": bs,
        "num_verify_tokens": 2 * bs,
        "verify_tokens_local": 2 * bs,
        "predicted_step_ms": 1.5,
        "predicted_theta": None,
        "step_cpu_ms": 3.14159,
    }


def _encoded(n: int, bs: int = 3) -> list[bytes]:
    comps = frozenset(records.COMPONENTS)
    return [
        msgspec.json.encode(
            records.step_record(_step(f, bs), [_req(i, f) for i in range(bs)], comps)
        )
        for f in range(1, n + 1)
    ]


def _tables(recs: list[bytes], chunk: int = 4096) -> records.Tables:
    import pyarrow as pa

    parts = list(
        records.records_to_tables(
            recs, run_id="r", dp_rank=0, gamma=GAMMA, mode="compact", chunk=chunk, workers=1
        )
    )
    return records.Tables(
        pa.concat_tables([p.steps for p in parts]),
        pa.concat_tables([p.req_steps for p in parts]),
        [e for p in parts for e in p.errors],
    )


def test_step_records_round_trip_field_equal():
    recs = _encoded(5)
    got = _tables(recs)
    assert not got.errors
    steps = got.steps.to_pylist()
    assert [s["forward_ct"] for s in steps] == [1, 2, 3, 4, 5]
    for s in steps:
        want = _step(s["forward_ct"], 3)
        for k, v in want.items():
            expect = round(v, 4) if k == "step_cpu_ms" else v
            assert s[k] == expect, (k, s[k], expect)
        assert s["source"] == "sglang" and s["run_id"] == "r"
    rows = got.req_steps.to_pylist()
    assert len(rows) == 15
    for row in rows:
        want = _req(row["req_pool_index"], row["forward_ct"])
        for k in (*records.SGLANG_REQ_INT_FIELDS, "draft_tokens", "rid"):
            assert row[k] == want[k], k
        for k in ("confidence", "survival"):  # rounded to 4 decimals, stored as float32
            assert row[k] == pytest.approx([round(x, 4) for x in want[k]], abs=1e-6)
        assert row["gamma"] == GAMMA


def test_components_left_out_are_absent_not_zero():
    rec = records.step_record(_step(1, 1), [_req(0, 1)], frozenset({"step_cpu_time"}))
    body = json.loads(msgspec.json.encode(rec))
    assert body == {"forward_ct": 1, "step_cpu_ms": 3.1416}


_BASE = (
    b'{"forward_ct":%d,"reqs":[{"req_pool_index":0,"prefix_len":1,"verify_len":2,"acc_len":1,'
    b'"correct_drafts":0,"cap_trim":0,'
)
BAD = {
    "forward_ct as a string": (b'{"forward_ct":"12"}', "forward_ct"),
    "forward_ct null": (b'{"forward_ct":null}', "forward_ct"),
    "a fraction in an int": (b'{"forward_ct":9,"bs":1.5}', "bs"),
    "a bool in a float": (b'{"forward_ct":9,"step_cpu_ms":true}', "step_cpu_ms"),
    "a required ReqDetail field missing": (_BASE % 9 + b'"draft_tokens":[1]}]}', "bonus_token"),
    "a required ReqDetail field null": (
        _BASE % 9 + b'"bonus_token":null,"draft_tokens":[1]}]}',
        "bonus_token",
    ),
    "a null draft token": (_BASE % 9 + b'"bonus_token":5,"draft_tokens":[1,null]}]}', "draft"),
    "a string confidence": (
        _BASE % 9 + b'"bonus_token":5,"draft_tokens":[1],"confidence":["a"]}]}',
        "confidence",
    ),
    "a null ReqDetail": (b'{"forward_ct":9,"reqs":[null]}', "reqs"),
    "an int past int64": (b'{"forward_ct":99999999999999999999}', "int64"),
    "not JSON": (b'{"forward_ct":9,', "records[1]"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_wrongly_typed_record_is_named_and_its_chunk_kept(case):
    bad, named = BAD[case]
    good = _encoded(2)
    got = _tables([good[0], bad, good[1]])
    assert [s["forward_ct"] for s in got.steps.to_pylist()] == [1, 2]
    assert got.req_steps.num_rows == 6
    assert len(got.errors) == 1 and got.errors[0].startswith("records[1]:"), got.errors
    assert named in got.errors[0], got.errors


def test_bad_records_in_several_chunks_are_each_named():
    recs = _encoded(10)
    recs[3] = b'{"forward_ct":"x"}'
    recs[8] = _BASE % 99 + b'"draft_tokens":[1]}]}'
    got = _tables(recs, chunk=4)
    assert [s["forward_ct"] for s in got.steps.to_pylist()] == [1, 2, 3, 5, 6, 7, 8, 10]
    assert [e.split(":")[0] for e in got.errors] == ["records[3]", "records[8]"]


def _row(fct: int, **kw) -> dict:
    row = {
        "rid": "a",
        "forward_ct": fct,
        "verify_len": 2,
        "correct_drafts": 1,
        "cap_trim": 0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "trimmed_tokens": None,
        "q_lp": None,
        "pg": None,
    }
    return {**row, **kw}


def test_estimator_writer_output_reads_back_and_skips_what_sglang_skips(tmp_path):
    path = tmp_path / "est.jsonl"
    w = EstimatorWriter(path)
    w.rows(
        [
            _row(1, trimmed_tokens=[5, 6], q_lp=[-0.5, -1.0]),
            _row(1, rid="greedy", temperature=0.0),
            _row(1, rid="topk", top_k=20),
            _row(1, rid="topp", top_p=0.9),
        ],
        1,
    )
    pg = [{"src_fct": 1, "k": 1, "target_logprob": -0.25, "draft_token": 5, "realized_token": 5}]
    w.rows([_row(2, correct_drafts=0, pg=pg)], 1)
    w.eos("a")  # block 1 still has its second draft unresolved
    w.close()
    lines = path.read_text().splitlines()
    assert [json.loads(x)["rid"] for x in lines] == ["a", "a", "a"]
    assert json.loads(lines[0]) == {
        "rid": "a",
        "fct": 1,
        "w": 1,
        "cl": 1,
        "ct": 0,
        "trimmed_tokens": [5, 6],
        "q_lp": [-0.5, -1.0],
    }
    assert json.loads(lines[1])["pg"] == [[1, 1, -0.25, 5, 5]]
    assert json.loads(lines[2]) == eos_line("a", [1])
    frame, errors = parse_estimator_lines(lines, gamma=GAMMA)
    assert not errors
    assert sorted(frame["forward_ct"].tolist()) == [1, 2]


def test_estimator_line_is_the_lines_of_rows():
    line = estimator_line(_row(4, verify_len=1, correct_drafts=0, cap_trim=0))
    assert line == {"rid": "a", "fct": 4, "w": 0, "cl": 0, "ct": 0}
