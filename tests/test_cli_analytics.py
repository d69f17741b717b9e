"""``ingest-estimator`` on an SGLang estimator JSONL with malformed lines."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from dspark_obs.cli import app

LINES = [
    json.dumps(
        {
            "rid": "a",
            "fct": 1,
            "w": 2,
            "cl": 2,
            "ct": 0,
            "trimmed_tokens": [5, 6, 7],
            "q_lp": [-0.1, -0.2, -0.3],
        }
    ),
    json.dumps(
        {
            "rid": "a",
            "fct": 2,
            "w": 3,
            "cl": 1,
            "ct": 0,
            "pg": [[1, 3, -0.05, 5, 5], [1, 4, -0.5, 6, 9]],
        }
    ),
    "not json",
    json.dumps({"rid": "b", "fct": 1, "w": 5, "cl": 2, "ct": 0}),
    json.dumps({"rid": "b", "w": 5}),
    json.dumps({"rid": "b", "eos_end": [1]}),
]


def test_ingest_estimator_reports_bad_lines_and_keeps_the_rest(tmp_path: Path) -> None:
    path, out = tmp_path / "est.jsonl", tmp_path / "blocks.parquet"
    path.write_text("\n".join(LINES) + "\n")
    res = CliRunner().invoke(
        app, ["ingest-estimator", str(path), "--gamma", "5", "--boot", "20", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "est.jsonl:3:" in res.output and "est.jsonl:5:" in res.output
    assert "2 bad lines" in res.output
    blocks = pd.read_parquet(out)
    assert len(blocks) == 3
    # rid a, fct 1: window of 2 drafts fully accepted; trimmed draft k=3 resolved (matched,
    # a3 = min(1, exp(-0.05 + 0.1)) = 1), k=4 diverged (a4 = exp(-0.5 + 0.2)), so
    # lo = w + 1 + P3 + P4 = 3 + 1 + a4 and k=5 stays unresolved: hi = lo + P4 * 1.
    a4 = math.exp(-0.3)
    a_row = blocks[(blocks.rid == "a") & (blocks.forward_ct == 1)].iloc[0]
    assert a_row["lo"] == pytest.approx(3 + 1 + a4)
    assert a_row["hi"] == pytest.approx(3 + 1 + a4 + a4)


def test_ingest_estimator_without_valid_lines_fails_clearly(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("nope\n")
    res = CliRunner().invoke(app, ["ingest-estimator", str(path)])
    assert res.exit_code == 2 and "no valid estimator line" in res.output
