"""Compare: two runs side by side, every headline metric with its difference and interval."""

from __future__ import annotations

import plotly.graph_objects as go
import streamlit as st

from dashboards.streamlit import ui
from dashboards.streamlit.queries import compare, overview
from dashboards.streamlit.queries.shared import Filters
from dspark_obs.store import Store


def show(s: Store, f: Filters) -> None:
    runs = overview.run_table(s, f)
    if len(runs) < 2:
        ui.empty_state("Comparing needs two runs (the filters leave fewer).")
    else:
        ids = runs["run_id"].tolist()
        c1, c2 = st.columns(2)
        run_a = c1.selectbox("Run A", ids, index=1 if len(ids) > 1 else 0, key="cmp_a")
        run_b = c2.selectbox("Run B", ids, index=0, key="cmp_b")
        cmp = compare.compare_runs(s, run_a, run_b, f.workloads)
        ui.table(cmp)
        for note in sorted(set(cmp["note"]) - {""}):
            st.info(f"Not compared: {note}. A compact run's ceiling is hidden, so its mean "
                    "ceiling and utilization are never compared as if measured.")  # fmt: skip
        rel = cmp[(cmp["metric"] != "requests") & cmp["diff"].notna()].copy()
        scale = rel["a"].abs().where(rel["a"].abs() > 0, 1.0)
        fig = go.Figure(
            go.Scatter(
                x=100 * rel["diff"] / scale,
                y=rel["metric"],
                mode="markers",
                marker={"size": 12},
                error_x={
                    "type": "data",
                    "symmetric": False,
                    "array": 100 * (rel["diff_hi"] - rel["diff"]) / scale,
                    "arrayminus": 100 * (rel["diff"] - rel["diff_lo"]) / scale,
                },
            )
        )
        fig.add_vline(x=0, line_dash="dot")
        fig.update_layout(
            title=f"{run_b} vs {run_a}: difference in % of A, 95% interval", xaxis_title="% of A"
        )
        ui.chart(fig, key="cmp")
        side = runs[runs["run_id"].isin([run_a, run_b])][
            [
                "run_id",
                "mode",
                "requests",
                "tokens",
                "tokens_per_s",
                "ttft_p50_s",
                "tpot_p50_s",
                "companion_status",
            ]
        ]
        ui.table(side)
        rows = (ui.run_rows(s, run_a), ui.run_rows(s, run_b))  # the view scans both runs
        wl = ui.cached(compare.workload_summary, s, rows, (run_a, run_b), f.workloads)
        st.subheader("Per workload")
        ui.table(wl)
    st.subheader("Bench runs (dspark-obs bench)")
    bench = compare.bench_runs(s)
    if len(bench) == 0:
        ui.empty_state(
            "No bench run is stored yet.",
            "dspark-obs bench --url http://127.0.0.1:30000 --store " + str(s.root),
        )
    else:
        ui.table(bench)
        st.caption(
            "Two bench runs can be picked as A and B above; the A/B gate: "
            "dspark-obs gate BASE_RUN NEW_RUN --store " + str(s.root)
        )


ui.page(
    "Compare",
    "B - A for every headline metric, with a 95% bootstrap interval over requests "
    "(each run's requests resampled independently). Pick any two runs: compact vs static, "
    "two drafters, before and after STS. TTFT / TPOT quantiles in the run table are exact.",
    show,
)
