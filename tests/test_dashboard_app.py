"""The Streamlit app: every page with data and on an empty store (streamlit.testing AppTest),
and the dashboard's queries against the project's own analytics.

The store holds the project's synthetic compact run + cap-accept companion written through
the real ingest path (dspark_obs/testing/sample_store.py); everything is real DuckDB.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "dashboards" / "streamlit"
sys.path.insert(0, str(ROOT))  # the pages import dashboards.streamlit.* as a package

from dashboards.streamlit import rollups  # noqa: E402
from dashboards.streamlit.queries import calibration, ceiling, compare, overview, shared, windows  # noqa: E402
from dspark_obs.analytics import pair_companion, window_histogram  # noqa: E402
from dspark_obs.store import Store  # noqa: E402
from dspark_obs.testing import sample_store  # noqa: E402

PAGES = {
    "Overview.py": 4,  # page -> plotly charts expected with data
    "pages/1_Windows.py": 3,
    "pages/2_Ceiling.py": 3,
    "pages/3_Calibration.py": 2,
    "pages/4_Cost_model.py": 3,
    "pages/5_Requests.py": 3,
    "pages/6_Compare.py": 1,
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    root = tmp_path_factory.mktemp("dash") / "store"
    return sample_store.write_sample_store(root, n_requests=18, max_new_tokens=32, seed=3)


def _app(monkeypatch: pytest.MonkeyPatch, root: Path, page: str) -> AppTest:
    monkeypatch.setenv("DSPARK_OBS_STORE", str(root))
    at = AppTest.from_file(str(APP / "Overview.py"), default_timeout=120)
    if page != "Overview.py":
        at.switch_page(page)
    return at.run()


def _values(v: object) -> list:
    """A Plotly JSON array: a list, or a typed array {dtype, bdata} (plotly >= 6)."""
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).tolist()
    return list(v) if isinstance(v, list | tuple) else []


def _figures(at: AppTest) -> list[dict]:
    return [json.loads(el.proto.spec) for el in at.get("plotly_chart")]


@pytest.mark.parametrize("page", list(PAGES))
def test_page_with_data(page: str, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    at = _app(monkeypatch, store.root, page)
    assert not at.exception, [e.message for e in at.exception]
    figs = _figures(at)
    assert len(figs) >= PAGES[page], f"{page}: {len(figs)} charts"
    for fig in figs:  # every chart carries data points, not an empty frame
        points = sum(max(len(_values(t.get(k, []))) for k in "xyz") for t in fig["data"])
        assert points > 0, fig["layout"].get("title")
    assert len(at.sidebar.multiselect) == 3  # run, workload, mode filters on every page
    assert not [i for i in at.info if "holds no run" in i.value]


@pytest.mark.parametrize("page", list(PAGES))
def test_page_on_empty_store(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = _app(monkeypatch, tmp_path / "nothing-here", page)
    assert not at.exception, [e.message for e in at.exception]
    assert not at.get("plotly_chart")
    assert any("holds no run" in i.value for i in at.info)
    assert any("dspark-obs run" in c.value for c in at.code)  # says which command to run


def test_overview_numbers_and_companion(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    at = _app(monkeypatch, store.root, "Overview.py")
    metrics = {m.label: m.value for m in at.metric}
    # the first screen: the newest primary run, its ceiling measured by its companion
    assert metrics["ceiling / step"] != "unknown"
    assert any("ceiling measured by demo-cap" in h.value for h in at.subheader)
    assert "%" in metrics["utilization"] and metrics["utilization"] != "100.0%"
    runs = overview.run_table(store)
    compact = runs.set_index("run_id").loc["demo-compact"]
    assert compact["companion"] == "demo-cap" and compact["companion_status"] == "identical"
    reqs = store.query("SELECT sum(completion_tokens) FROM requests WHERE run_id='demo-compact'")
    assert compact["tokens"] == reqs.column(0)[0].as_py() > 0


def test_workload_filter_narrows_every_chart(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    at = _app(monkeypatch, store.root, "pages/1_Windows.py")
    at.sidebar.multiselect[1].select("math").run()
    assert not at.exception
    hist = _figures(at)[0]
    assert {t["name"] for t in hist["data"]} == {"math"}


def test_calibration_page_offers_sts_json(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    at = _app(monkeypatch, store.root, "pages/3_Calibration.py")
    assert not at.exception
    cal = calibration.calibration(store, at.selectbox[0].value)
    sts = json.loads(cal.sts_json)
    assert len(sts["temperatures"]) == 5 and all(t > 0 for t in sts["temperatures"])
    assert set(cal.metrics["variant"]) == {"raw", "sts"}
    assert (cal.metrics["ece_lo"] <= cal.metrics["ece"] + 1e-12).all()
    assert (cal.reliability["count"] >= 0).all()
    assert at.get("download_button")


def test_compare_page_shows_differences(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    at = _app(monkeypatch, store.root, "pages/6_Compare.py")
    assert not at.exception
    cmp = compare.compare_runs(store, "demo-compact", "demo-cap")
    row = cmp.set_index("metric").loc["utilization (committed / ceiling)"]
    assert np.isnan(row["a"]) and np.isnan(row["diff"])  # compact's ceiling is hidden
    assert row["b"] < 1.0 and "demo-compact: ceiling hidden" in row["note"]
    assert any("Not compared" in i.value for i in at.info)
    same = cmp.set_index("metric").loc["accept length (committed / step)"]
    assert same["diff"] == pytest.approx(0.0)  # the companion commits what compact commits


def test_window_histogram_matches_the_analytics(store: Store) -> None:
    sql = windows.window_histogram(store, shared.Filters(runs=("demo-compact",)))
    rows = store.query("FROM req_steps WHERE run_id = 'demo-compact'").to_pandas()
    ref = window_histogram(rows, by=("workload",))
    ref = ref[ref["steps"] > 0].reset_index(drop=True)
    assert sql[["workload", "verify_len", "steps"]].to_dict("records") == ref[
        ["workload", "verify_len", "steps"]
    ].to_dict("records")
    assert np.allclose(sql["share"], ref["share"])


def test_ceiling_matches_companion_pairing(store: Store) -> None:
    truth = ceiling.ceiling_by_workload(store).set_index("workload")
    rows = store.query("FROM req_steps").to_pandas()
    comp = pair_companion(
        rows[rows.run_id == "demo-compact"], rows[rows.run_id == "demo-cap"]
    ).per_workload.set_index("workload")
    assert np.allclose(truth.loc[comp.index, "utilization"], comp["utilization"])
    assert (truth.loc[comp.index, "tokens_left"] == comp["tokens_left"]).all()
    est = ceiling.ceiling_estimate(store, "demo-compact", n_boot=50)
    assert set(est.summary["workload"]) == set(comp.index)
    assert (est.summary["mean_lo"] <= est.summary["mean_hi"] + 1e-9).all()
    assert len(est.validation) == len(comp)


def test_pages_follow_a_run_being_ingested(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows written after the page first rendered show up on the next rerun (no stale cache)."""
    tables = sample_store.synthetic_tables(n_requests=9, max_new_tokens=24, seed=5, prefix="live")
    store = Store(tmp_path / "store")
    half = tables["req_steps"]["forward_ct"].median()
    store.write("runs", sample_store._arrow("runs", tables["runs"]))
    first = tables["req_steps"][tables["req_steps"]["forward_ct"] <= half]
    store.write("req_steps", sample_store._arrow("req_steps", first))
    at = _app(monkeypatch, store.root, "pages/2_Ceiling.py")
    assert not at.exception
    before = overview.run_table(store).set_index("run_id")["req_steps"].sum()
    rest = tables["req_steps"][tables["req_steps"]["forward_ct"] > half]
    store.write("req_steps", sample_store._arrow("req_steps", rest))
    at.run()
    assert not at.exception
    after = overview.run_table(store).set_index("run_id")["req_steps"].sum()
    assert after == len(tables["req_steps"]) > before
    shown = {r for t in _figures(at)[0]["data"] for r in [t.get("name")]}
    assert shown  # the ceiling chart rendered from the partial, then the full run


def test_rollups_equal_the_views_and_survive_compaction(tmp_path: Path) -> None:
    """The per-segment rollups give the views' numbers, before and after a compaction that
    retires every segment they had summarized, and pick up segments as they land."""
    store = Store(tmp_path / "store")
    tables = sample_store.synthetic_tables(n_requests=12, max_new_tokens=24, seed=9, prefix="c")
    sample_store.write_in_slices(store, tables, slices=4, pause=0.0)

    def check() -> None:
        view = store.query("FROM workload_summary ORDER BY ALL").to_pandas()
        mine = overview.accept_by_workload(store).sort_values(["run_id", "workload"])
        assert (
            mine[["run_id", "workload"]].values.tolist()
            == view[["run_id", "workload"]].values.tolist()
        )
        assert mine["req_steps"].tolist() == view["req_steps"].tolist()
        assert mine["committed"].tolist() == view["committed_tokens"].tolist()
        assert np.allclose(mine["mean_window"], view["mean_verify_len"])
        assert np.allclose(mine["accept_length"], view["mean_acc_len"])
        # the Ceiling page's measured truth: the view's ceiling of the cap-accept runs
        truth = ceiling.ceiling_by_workload(store).set_index(["measured_by", "workload"])
        cap = view[view["mode"] == "cap-accept"].set_index(["run_id", "workload"])
        assert (
            truth["ceiling_tokens"].sort_index().tolist()
            == cap["ceiling_tokens"].sort_index().tolist()
        )
        assert np.allclose(truth["utilization"].sort_index(), cap["utilization"].sort_index())
        counts = store.query(
            "SELECT (SELECT count(*) FROM req_steps) AS rs, (SELECT count(*) FROM requests) AS rq"
        ).to_pylist()[0]
        rows = shared.store_rows(store)
        assert (rows["req_steps"], rows["requests"]) == (counts["rs"], counts["rq"])

    check()
    before = overview.run_table(store).set_index("run_id")[["requests", "tokens", "accept_length"]]
    segments = store.segments("req_steps").files
    store.compact()
    assert set(store.segments("req_steps").files).isdisjoint(segments)
    check()
    after = overview.run_table(store).set_index("run_id")[["requests", "tokens", "accept_length"]]
    assert before.equals(after)


def test_compare_lists_bench_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run stored by `dspark-obs bench` (source bench, summary in its config) is listed."""
    from dspark_obs.validation import to_table

    store = sample_store.write_sample_store(tmp_path / "store", n_requests=6, max_new_tokens=16)
    summary = {"completed": 6, "failed": 0, "output_throughput": 123.5,
               "ttft_ms": {"n": 6, "mean": 40.0, "median": 38.0, "p99": 90.0},
               "tpot_ms": {"n": 6, "mean": 9.0, "median": 8.5, "p99": 15.0},
               "accept_length_pooled": 2.4}  # fmt: skip
    config = json.dumps({"kind": "bench", "url": "http://x", "summary": summary})
    run = {"run_id": "bench-1", "source": "bench", "mode": "compact", "gamma": 5, "config": config}
    table, errors = to_table("runs", [run])
    assert not errors
    Store(store.root).write("runs", table)  # write_sample_store closed its writer
    listed = compare.bench_runs(store).set_index("run_id").loc["bench-1"]
    assert listed["output_tok_per_s"] == 123.5 and listed["ttft_median_ms"] == 38.0
    at = _app(monkeypatch, store.root, "pages/6_Compare.py")
    assert not at.exception
    shown = [df.value for df in at.dataframe if "output_tok_per_s" in df.value.columns]
    assert shown and shown[0]["run_id"].tolist() == ["bench-1"]


@pytest.mark.parametrize(
    "f",
    [
        shared.Filters(runs=("demo-cap",)),
        shared.Filters(modes=("compact",)),
        shared.Filters(workloads=("math", "poetry")),
        shared.Filters(
            runs=("demo-compact", "demo-cap"), workloads=("chat",), modes=("cap-accept",)
        ),
        shared.Filters(modes=("static",)),  # a mode no run has: nothing
        shared.Filters(workloads=("no-such-workload",)),
    ],
)
def test_rollups_and_store_filter_alike(store: Store, f: shared.Filters) -> None:
    """The all-runs pages filter the rollups with the same SQL predicate the per-run pages put
    in their queries over the store: the same rows come out either way."""
    sql = store.query(
        "SELECT run_id, coalesce(workload, 'unknown') AS workload, count(*) AS n "
        f"FROM req_steps WHERE {f.where()} GROUP BY ALL ORDER BY ALL"
    ).to_pandas()
    rolled = shared.select(rollups.partials(store, "req_steps"), f, shared.runs(store))
    mine = rolled.groupby(["run_id", "workload"], as_index=False)["n"].sum()
    assert mine.values.tolist() == sql.values.tolist()
