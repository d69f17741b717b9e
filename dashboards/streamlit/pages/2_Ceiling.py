"""Ceiling: committed vs what a full-block verify would have committed, and the estimator."""

from __future__ import annotations

import plotly.express as px
import plotly.graph_objects as go
import streamlit as st

from dashboards.streamlit import ui
from dashboards.streamlit.queries import ceiling
from dashboards.streamlit.queries.shared import Filters
from dspark_obs.analytics.estimator_cells import describe_tail
from dspark_obs.store import Store


def show(s: Store, f: Filters) -> None:
    truth = ceiling.ceiling_by_workload(s, f)
    if len(truth) == 0:
        ui.empty_state(
            "No cap-accept companion run matches the filters, so the ceiling is not measured.",
        )
    else:
        long = truth.melt(
            id_vars=["run_id", "workload"],
            value_vars=["mean_committed", "mean_ceiling"],
            var_name="what",
            value_name="tokens per step",
        )
        left, right = st.columns(2)
        with left:
            ui.chart(
                px.bar(
                    long,
                    x="workload",
                    y="tokens per step",
                    color="what",
                    barmode="group",
                    facet_col="run_id",
                    title="Committed vs ceiling (per step)",
                ),
                key="committed",
            )
        with right:
            ui.chart(
                px.bar(
                    truth,
                    x="workload",
                    y="utilization",
                    color="run_id",
                    barmode="group",
                    range_y=[0, 1.05],
                    title="Utilization (committed / ceiling)",
                    hover_data=["tokens_left"],
                ),
                key="util",
            )
        st.metric("tokens left on the table (all selected runs)", int(truth["tokens_left"].sum()))
        ui.table(truth)

    run_id = ui.pick_run(s, f, "Compact run for the estimator", modes=("compact",), key="est")
    if run_id is None:
        ui.empty_state(
            "The estimator needs a compact run.",
        )
    else:
        est = ui.cached(ceiling.ceiling_estimate, s, ui.run_rows(s, run_id), run_id)
        if len(est.summary) == 0:
            st.warning(f"{run_id}: nothing to estimate ({'; '.join(est.problems)})")
        else:
            summ = est.summary
            fig = go.Figure()
            fig.add_trace(
                go.Scatter(
                    x=summ["workload"],
                    y=summ["mean_point"],
                    mode="markers",
                    name="point",
                    marker={"size": 12},
                    error_y={
                        "type": "data",
                        "symmetric": False,
                        "array": summ["point_ci_hi"] - summ["mean_point"],
                        "arrayminus": summ["mean_point"] - summ["point_ci_lo"],
                    },
                )
            )
            fig.add_trace(
                go.Bar(
                    x=summ["workload"],
                    y=summ["mean_hi"] - summ["mean_lo"],
                    base=summ["mean_lo"],
                    name="bracket [lo, hi]",
                    opacity=0.3,
                )
            )
            fig.add_trace(  # the bracket's ends as markers: visible where lo = hi (no bar)
                go.Scatter(
                    x=[*summ["workload"], *summ["workload"]],
                    y=[*summ["mean_lo"], *summ["mean_hi"]],
                    mode="markers",
                    name="bracket ends (lo, hi)",
                    marker={"symbol": "line-ew-open", "size": 22, "line": {"width": 3}},
                )
            )
            if len(est.validation):
                val = est.validation
                fig.add_trace(
                    go.Scatter(
                        x=val["workload"],
                        y=val["truth_mean_ceiling"],
                        mode="markers",
                        name="companion truth",
                        marker={"symbol": "x", "size": 14},
                    )
                )
            fig.update_layout(
                title=f"{run_id}: estimated mean ceiling (point, 95% interval, bracket)",
                yaxis_title="tokens per step",
            )
            ui.chart(fig, key="estimator")
            st.caption(describe_tail(est.tail))
            ui.table(summ)
            if len(est.validation):
                st.subheader("Estimator vs companion truth")
                ui.table(est.validation)
            else:
                st.info(
                    f"{run_id} has no cap-accept companion: run with `--companion` to judge "
                    "the estimator against the truth."
                )
            for p in est.problems:
                st.warning(p)


ui.page(
    "Ceiling",
    "ceiling = acc_len + cap_trim, measured exactly by a cap-accept companion; "
    "utilization = committed / ceiling. The block-accept estimator recovers the ceiling "
    "from the compact run alone: [lo, hi] is SGLang's bracket, point is calibrated.",
    show,
)
