"""Every surface states only what was measured: a compact run's hidden ceiling is NULL /
"unknown" or the estimator's figure labelled estimated with its interval, never a
measured-looking 1.0; one STS verdict everywhere; exact quantiles on store-backed pages.

Stores are written through the real ingest path (dspark_obs/testing/sample_store.py), read
with real DuckDB, and the pages run in streamlit.testing's AppTest.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "dashboards" / "streamlit"
sys.path.insert(0, str(ROOT))  # the pages import dashboards.streamlit.* as a package

from dashboards.streamlit.queries import calibration, ceiling, compare, overview  # noqa: E402
from dspark_obs.analytics.sts_verdict import OK, TOO_FEW, WORSE, sts_verdict  # noqa: E402
from dspark_obs.fanout import FanOut  # noqa: E402
from dspark_obs.store import Store  # noqa: E402
from dspark_obs.testing import sample_store  # noqa: E402


def _write(root: Path, tables: dict[str, pd.DataFrame]) -> Store:
    store = Store(root)
    fan = FanOut([store])
    for name, frame in tables.items():
        fan.emit(name, sample_store._arrow(name, frame))
    assert not fan.errors
    store.close()
    return Store(root)


@pytest.fixture(scope="module")
def paired(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """A compact run + its cap-accept companion, and a static run (same rows relabelled)."""
    tables = sample_store.synthetic_tables(n_requests=12, max_new_tokens=24, seed=4, prefix="p")
    static = {k: v[v["run_id"] == "p-cap"].assign(run_id="p-static") for k, v in tables.items()}
    static["runs"] = static["runs"].assign(mode="static", companion_of=None)
    both = {k: pd.concat([tables[k], static[k]], ignore_index=True) for k in tables}
    return _write(tmp_path_factory.mktemp("paired") / "store", both)


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """A compact run without a companion: its ceiling can only be estimated."""
    tables = sample_store.synthetic_tables(n_requests=12, max_new_tokens=24, seed=6, prefix="a")
    solo = {k: v[v["run_id"] == "a-compact"] for k, v in tables.items()}
    return _write(tmp_path_factory.mktemp("alone") / "store", solo)


def test_workload_summary_hides_the_compact_ceiling(paired: Store, monkeypatch) -> None:
    view = paired.query("FROM workload_summary ORDER BY ALL").to_pandas()
    compact, cap = view[view["mode"] == "compact"], view[view["mode"] == "cap-accept"]
    static = view[view["mode"] == "static"]
    assert len(compact) == len(cap) == len(static) == 3
    for col in ("mean_ceiling", "ceiling_tokens", "utilization"):
        assert compact[col].isna().all(), col  # never committed / committed = 1.0
        assert cap[col].notna().all() and static[col].notna().all(), col
    assert set(compact["ceiling_source"]) == {"hidden"}
    assert set(cap["ceiling_source"]) == set(static["ceiling_source"]) == {"measured"}
    assert (cap["utilization"] < 1).any()
    rows = paired.query("FROM req_steps WHERE run_id = 'p-cap'").to_pandas()
    for r in cap.itertuples():
        g = rows[rows.workload == r.workload]
        assert r.utilization == pytest.approx(g.acc_len.sum() / (g.acc_len + g.cap_trim).sum())
    # the Compare page's per-workload table is the view's rows (NaN where the view says NULL)
    monkeypatch.setenv("DSPARK_OBS_STORE", str(paired.root))
    at = AppTest.from_file(str(APP / "Overview.py"), default_timeout=120)
    at.switch_page("pages/6_Compare.py")
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    a, b = at.selectbox[0].value, at.selectbox[1].value
    (shown,) = [d.value for d in at.dataframe if "ceiling_source" in d.value.columns]
    want = view[view["run_id"].isin([a, b])].sort_values(["run_id", "workload"])
    assert len(shown) == len(want) > 0
    for col in ("mean_ceiling", "ceiling_tokens", "utilization"):
        assert np.allclose(shown[col].astype(float), want[col].astype(float), equal_nan=True)
    assert shown["ceiling_source"].tolist() == want["ceiling_source"].tolist()
    hidden = shown[shown["mode"] == "compact"]
    assert hidden[["mean_ceiling", "utilization"]].isna().all().all()


def test_compare_never_calls_a_hidden_ceiling_different(paired: Store) -> None:
    cmp = compare.compare_runs(paired, "p-compact", "p-cap", n_boot=100).set_index("metric")
    for name in compare.CEILING_METRICS:
        row = cmp.loc[name]
        assert math.isnan(row["a"]) and math.isnan(row["diff"]), name
        assert math.isnan(row["diff_lo"]) and math.isnan(row["diff_hi"]), name
        assert "p-compact: ceiling hidden" in row["note"]
        assert not math.isnan(row["b"])  # the companion's ceiling is measured
    same = cmp.loc["accept length (committed / step)"]
    assert same["diff"] == pytest.approx(0.0) and same["note"] == ""
    measured = compare.compare_runs(paired, "p-static", "p-cap", n_boot=100).set_index("metric")
    row = measured.loc["utilization (committed / ceiling)"]
    assert row["diff_lo"] <= row["diff"] <= row["diff_hi"] and row["note"] == ""


def test_run_ceiling_is_measured_by_the_companion_or_estimated_with_an_interval(
    paired: Store, alone: Store
) -> None:
    by_comp = overview.run_ceiling(paired, "p-compact", n_boot=50)
    truth = overview.run_ceiling(paired, "p-cap", n_boot=50)
    assert by_comp.source == "measured by p-cap" and truth.source == "measured"
    assert by_comp.ceiling == truth.ceiling and by_comp.utilization == truth.utilization < 1
    rows = paired.query("FROM req_steps WHERE run_id = 'p-cap'").to_pandas()
    assert truth.tokens_left == rows.cap_trim.sum()
    ceiling = (rows.acc_len + rows.cap_trim).sum()
    assert truth.utilization == pytest.approx(rows.acc_len.sum() / ceiling)
    est = overview.run_ceiling(alone, "a-compact", n_boot=100)
    assert est.source == "estimated" and est.estimated
    assert est.ceiling_lo <= est.ceiling <= est.ceiling_hi
    assert est.ceiling >= est.committed  # committed is a lower bound of the ceiling
    assert est.utilization_lo <= est.utilization <= est.utilization_hi <= 1.0
    assert est.tokens_left_lo <= est.tokens_left <= est.tokens_left_hi
    assert est.utilization < 1.0  # the estimate sees the tokens trimming left behind
    assert 0 < est.ece < 1 and est.ece_n > 0


def test_overview_first_screen_is_the_ceiling(alone: Store, monkeypatch) -> None:
    monkeypatch.setenv("DSPARK_OBS_STORE", str(alone.root))
    at = AppTest.from_file(str(APP / "Overview.py"), default_timeout=120).run()
    assert not at.exception, [e.message for e in at.exception]
    metrics = [(m.label, m.value) for m in at.metric]
    labels = [label for label, _ in metrics]
    assert labels[:6] == ["committed / step", "ceiling / step (estimated)",
                          "utilization (estimated)", "tokens left on the table (estimated)",
                          "ECE (raw, pooled)", "mean window"]  # fmt: skip
    values = dict(metrics)
    assert "[" in values["utilization (estimated)"]  # the interval is shown with the point
    assert values["utilization (estimated)"] != "100.0%"
    est = overview.run_ceiling(alone, "a-compact")
    assert values["ceiling / step (estimated)"].startswith(f"{est.ceiling:.2f} [")


def test_exact_quantiles_on_store_backed_pages(paired: Store) -> None:
    req = paired.query("FROM requests WHERE run_id = 'p-compact'").to_pandas()
    ttft = (req.first_token_time - req.arrival_time).to_numpy()
    run = overview.run_table(paired).set_index("run_id").loc["p-compact"]
    assert run["ttft_p50_s"] == pytest.approx(np.median(ttft), rel=1e-12)
    assert run["ttft_p95_s"] == pytest.approx(np.quantile(ttft, 0.95), rel=1e-12)
    lat = overview.latency(paired)
    row = lat[(lat.run_id == "p-compact") & (lat.metric == "ttft_s") & (lat.workload == "chat")]
    chat = req[req.workload == "chat"]
    want = np.quantile((chat.first_token_time - chat.arrival_time).to_numpy(), [0.25, 0.5, 0.75])
    assert row[["p25", "p50", "p75"]].to_numpy()[0] == pytest.approx(want, rel=1e-12)


def test_one_sts_verdict() -> None:
    assert sts_verdict(0.10, 0.05, 40).status == OK
    assert sts_verdict(0.10, 0.05, 4).status == TOO_FEW
    worse = sts_verdict(0.077, 0.18, 4, fit_requests=9)
    assert worse.status == WORSE and not worse.servable  # worse wins over too few
    assert len(worse.reasons) == 2 and "do not serve" in worse.line()
    assert sts_verdict(0.10, 0.12, 400).status == WORSE


def test_calibration_page_never_offers_a_harmful_sts(paired: Store, monkeypatch) -> None:
    real = calibration.calibration

    def harmful(store, run_id, *args, **kwargs):
        cal = real(store, run_id, *args, **kwargs)
        cal.verdict = sts_verdict(0.077, 0.18, 4, fit_requests=9)
        return cal

    monkeypatch.setattr(calibration, "calibration", harmful)  # the page reads it at call time
    monkeypatch.setenv("DSPARK_OBS_STORE", str(paired.root))
    at = AppTest.from_file(str(APP / "Overview.py"), default_timeout=120)
    at.switch_page("pages/3_Calibration.py")
    st.cache_data.clear()  # the page caches analytics per store: no result from another test
    try:
        at.run()
    finally:
        st.cache_data.clear()  # nor leave this doctored one for the next
    assert not at.exception, [e.message for e in at.exception]
    assert not at.get("download_button")
    assert any("worse: do not serve" in e.value for e in at.error)


def test_calibration_page_shows_the_verdict_beside_its_download(paired: Store,
                                                                 monkeypatch) -> None:  # fmt: skip
    monkeypatch.setenv("DSPARK_OBS_STORE", str(paired.root))
    at = AppTest.from_file(str(APP / "Overview.py"), default_timeout=120)
    at.switch_page("pages/3_Calibration.py")
    at.run()
    assert not at.exception
    cal = calibration.calibration(paired, at.selectbox[0].value)
    assert cal.verdict is not None and cal.verdict.servable
    shown = [e.value for e in [*at.success, *at.warning, *at.error]]
    assert any(cal.verdict.status in v for v in shown)
    (button,) = at.get("download_button")
    assert cal.verdict.status in button.proto.label


def test_ceiling_page_marks_both_bracket_ends(alone: Store, monkeypatch) -> None:
    """The [lo, hi] bracket is a bar from lo to hi: where lo = hi it has no height, so each
    end is also drawn as a marker."""
    import json

    monkeypatch.setenv("DSPARK_OBS_STORE", str(alone.root))
    at = AppTest.from_file(str(APP / "Overview.py"), default_timeout=120)
    at.switch_page("pages/2_Ceiling.py")
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    traces = [t for el in at.get("plotly_chart") for t in json.loads(el.proto.spec)["data"]]
    (ends,) = [t for t in traces if t.get("name") == "bracket ends (lo, hi)"]
    assert ends["mode"] == "markers"
    summ = ceiling.ceiling_estimate(alone, "a-compact", n_boot=50).summary
    want = [*summ["mean_lo"], *summ["mean_hi"]]
    got = ends["y"]
    if isinstance(got, dict):  # plotly >= 6 typed array
        import base64

        got = np.frombuffer(base64.b64decode(got["bdata"]), dtype=np.dtype(got["dtype"]))
    assert np.allclose(got, want)
