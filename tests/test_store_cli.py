"""The store commands: query (formats, refused writes), export, store-info."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from dspark_obs.cli import store as store_cli
from dspark_obs.store import Store

sys.path.insert(0, str(Path(__file__).parent))
import test_store_source as src  # noqa: E402

RUN = "run-cli"


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()
    store_cli.register(app)
    return app


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli") / "store"
    with Store(root) as store:
        for table, _, batch in src.source(RUN, 5):
            store.write(table, batch)
        for table, _, batch in src.source("other", 1):
            store.write(table, batch)
    return root


def run(app: typer.Typer, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    res = CliRunner().invoke(app, list(args), env=env)
    return res.exit_code, res.stdout, res.stderr


def test_query_formats(app: typer.Typer, root: Path) -> None:
    sql = (
        "SELECT forward_ct, rid, confidence FROM req_steps "
        "WHERE run_id = 'run-cli' ORDER BY forward_ct, rid LIMIT 3"
    )
    code, out, _ = run(app, "query", sql, "--store", str(root), "--format", "json")
    assert code == 0
    rows = json.loads(out)
    order = [("forward_ct", "ascending"), ("rid", "ascending")]
    want = src.req_steps_batch(RUN, 0).sort_by(order).slice(0, 3).to_pylist()
    assert [r["rid"] for r in rows] == [w["rid"] for w in want]
    assert rows[0]["confidence"] == [round(c, 4) for c in want[0]["confidence"]]

    code, out, _ = run(app, "query", sql, "--store", str(root), "--format", "csv")
    assert code == 0
    parsed = list(csv.reader(io.StringIO(out)))
    assert parsed[0] == ["forward_ct", "rid", "confidence"] and len(parsed) == 4
    assert json.loads(parsed[1][2]) == rows[0]["confidence"]

    code, out, _ = run(app, "query", "SELECT count(*) AS n FROM steps", "--store", str(root))
    assert code == 0 and "36" in out and "1 rows" in out


def test_query_uses_the_environment_store(app: typer.Typer, root: Path) -> None:
    code, out, _ = run(
        app, "query", "SELECT count(*) AS n FROM runs", "-f", "json",
        env={"DSPARK_OBS_STORE": str(root)},
    )
    assert code == 0 and json.loads(out) == [{"n": 2}]


@pytest.mark.parametrize(
    ("sql", "kind"),
    [("DELETE FROM steps", "DELETE"), ("COPY steps TO 'x.csv'", "COPY"),
     ("CREATE VIEW v AS SELECT 1", "CREATE")],
)
def test_query_refuses_writes_with_exit_2(
    app: typer.Typer, root: Path, sql: str, kind: str
) -> None:
    code, out, err = run(app, "query", sql, "--store", str(root))
    assert code == 2
    assert f"refused a {kind} statement" in err and "Traceback" not in err + out
    code, out, _ = run(app, "query", "SELECT count(*) AS n FROM steps", "-f", "json",
                       "--store", str(root))
    assert json.loads(out) == [{"n": 36}]


def test_bad_sql_is_a_clear_error(app: typer.Typer, root: Path) -> None:
    code, out, err = run(app, "query", "SELECT nope FROM steps", "--store", str(root))
    assert code == 1 and "nope" in err and "Traceback" not in err + out


def test_export_all_and_one_run(app: typer.Typer, root: Path, tmp_path: Path) -> None:
    code, out, _ = run(app, "export", str(tmp_path / "all"), "--store", str(root))
    assert code == 0 and "req_steps.parquet" in out
    assert pq.read_metadata(tmp_path / "all" / "req_steps.parquet").num_rows == 288
    code, _, _ = run(app, "export", str(tmp_path / "one"), "--store", str(root), "--run", "other")
    assert code == 0
    t = pq.read_table(tmp_path / "one" / "steps.parquet")
    assert t.num_rows == src.STEPS_PER_BATCH and set(t.column("run_id").to_pylist()) == {"other"}
    code, _, err = run(app, "export", str(tmp_path / "x"), "--store", str(root), "--run", "zzz")
    assert code == 1 and "'zzz' is not in the store" in err


def test_store_info(app: typer.Typer, root: Path) -> None:
    code, out, _ = run(app, "store-info", "--store", str(root), "--json")
    assert code == 0
    info = json.loads(out)
    assert info["tables"]["req_steps"] == {
        "rows": 288, "segments": 6, "bytes": info["tables"]["req_steps"]["bytes"],
        "skipped_files": 0,
    }
    assert [r["run_id"] for r in info["runs"]] == ["other", RUN]
    code, out, _ = run(app, "store-info", "--store", str(root))
    assert code == 0 and RUN in out and "req_steps" in out


def test_missing_store(app: typer.Typer, tmp_path: Path) -> None:
    code, out, err = run(app, "store-info", "--store", str(tmp_path / "none"))
    assert code == 1 and "no store at" in err and "Traceback" not in err + out
    code, out, err = run(app, "query", "SELECT count(*) AS n FROM steps", "-f", "json",
                         "--store", str(tmp_path / "none"))
    assert code == 0 and json.loads(out) == [{"n": 0}] and "no store at" in err


def test_store_compact(app: typer.Typer, tmp_path: Path) -> None:
    root = tmp_path / "store"
    with Store(root) as store:
        for table, _, batch in src.source(RUN, 4):
            store.write(table, batch)
    code, out, _ = run(app, "store-compact", "--store", str(root))
    assert code == 0 and f"req_steps {RUN}: 192 rows, 4 segments -> 1" in out
    info = Store(root).info()["tables"]
    assert info["req_steps"] == {"rows": 192, "segments": 1, "skipped_files": 0,
                                 "bytes": info["req_steps"]["bytes"]}
