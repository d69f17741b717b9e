"""Cost model: does the cost table predict step time? Measured vs predicted, residuals."""

from __future__ import annotations

import plotly.express as px
import streamlit as st

from dashboards.streamlit import ui
from dashboards.streamlit.queries import cost_model
from dashboards.streamlit.queries.shared import Filters
from dspark_obs.store import Store


def show(s: Store, f: Filters) -> None:
    cm = cost_model.cost_model(s, f)
    pts, shape = cm["points"], cm["by_shape"]
    if len(pts) == 0:
        ui.empty_state(
            "No step carries both a prediction and a measurement (runs without a cost table "
            "verify whole blocks and predict nothing).",
        )
    else:
        top = float(max(pts["predicted_ms"].max(), pts["measured_ms"].max()))
        fig = px.scatter(
            pts,
            x="predicted_ms",
            y="measured_ms",
            color="run_id",
            hover_data=["bs", "num_verify_tokens", "forward_ct"],
            title="Measured vs predicted step time (ms)",
        )
        fig.add_shape(type="line", x0=0, y0=0, x1=top, y1=top, line={"dash": "dot"})
        left, right = st.columns(2)
        with left:
            ui.chart(fig, key="scatter")
        with right:
            ui.chart(
                px.histogram(
                    pts,
                    x="residual_ms",
                    color="run_id",
                    nbins=40,
                    title="Residual (measured - predicted, ms)",
                ),
                key="resid",
            )
        ui.chart(
            px.scatter(
                shape,
                x="num_verify_tokens",
                y="residual_ms",
                color="bs",
                size="steps",
                facet_col="run_id",
                title="Mean residual by batch size and verify tokens",
            ),
            key="shape",
        )
        ui.table(shape)
    run_id = ui.pick_run(s, f, "Cost table of run", key="cost_run")
    if run_id is not None:
        table, note = cost_model.cost_table_of(s, run_id)
        st.subheader("Fitted cost table")
        st.caption(note)
        if len(table):
            ui.table(table)
        st.code("dspark-obs profile --out runtime/cost_tables/mine.json", language="bash")


ui.page(
    "Cost model",
    "The planner picks the budget with T(bs, K) = bias + alpha(bs) + theta(bs + K); "
    "predicted_step_ms is that prediction for the step it ran, measured is the step's GPU "
    "time (SGLang) or CPU wall time (embedded engine).",
    show,
)
