"""Windows: the verify-window histogram per workload, its spread over steps, the budget."""

from __future__ import annotations

import plotly.express as px
import plotly.graph_objects as go
import streamlit as st

from dashboards.streamlit import ui
from dashboards.streamlit.queries import windows
from dashboards.streamlit.queries.shared import Filters
from dspark_obs.store import Store


def show(s: Store, f: Filters) -> None:
    hist = windows.window_histogram(s, f)
    if len(hist) == 0:
        ui.empty_state("No req-step rows match the filters.")
    else:
        fig = px.bar(
            hist,
            x="verify_len",
            y="share",
            color="workload",
            barmode="group",
            facet_col="run_id",
            facet_col_wrap=3,
            hover_data=["steps"],
            title="Verify-window histogram per workload (share of req-steps)",
        )
        ui.chart(fig, key="hist")
        per_step = windows.window_per_step(s, f)
        for run_id, part in per_step.groupby("run_id", sort=True):
            width = int(part["step_width"].iloc[0])
            piv = part.pivot_table(
                index="verify_len", columns="step", values="req_steps", fill_value=0
            )
            share = piv / piv.sum(axis=0)
            fig = go.Figure(
                go.Heatmap(
                    z=share.to_numpy(),
                    x=share.columns.tolist(),
                    y=share.index.tolist(),
                    colorscale="Viridis",
                    colorbar={"title": "share"},
                    customdata=piv.to_numpy(),
                    hovertemplate="step %{x}<br>window %{y}<br>share %{z:.2f}"
                    "<br>req-steps %{customdata}<extra></extra>",
                )
            )
            fig.update_layout(
                title=f"{run_id}: window distribution per step (buckets of {width} steps)",
                xaxis_title="decode step",
                yaxis_title="verify_len",
            )
            ui.chart(fig, key=f"steps-{run_id}")
        budget = windows.budget_per_step(s, f)
        if len(budget) and budget["budget"].notna().any():
            fig = px.line(
                budget,
                x="step",
                y=["budget", "verify_tokens", "batch_size"],
                facet_row="run_id",
                title="Budget per step (extra verify tokens the planner "
                "granted), verify tokens and batch size",
            )
            ui.chart(fig, key="budget")
        else:
            st.info("No step recorded a budget (static runs and SGLang without DSpark: -1).")
        st.subheader("Histogram table")
        ui.table(hist)


ui.page(
    "Windows",
    "verify_len = target positions verified per request per step (anchor included, "
    "1..gamma+1). compact trims the window where the confidence head expects rejection.",
    show,
)
