"""Calibration: reliability diagrams per position and workload, ECE raw vs STS."""

from __future__ import annotations

import plotly.express as px
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from dashboards.streamlit import ui
from dashboards.streamlit.queries import calibration
from dashboards.streamlit.queries.shared import Filters
from dspark_obs.store import Store

COLORS = {"raw": "#1f77b4", "sts": "#ff7f0e"}


def show(s: Store, f: Filters) -> None:
    run_id = ui.pick_run(s, f, "Run", key="cal_run")
    if run_id is None:
        ui.empty_state("No run matches the filters.")
    else:
        cal = ui.cached(calibration.calibration, s, ui.run_rows(s, run_id), run_id, f.workloads)
        if len(cal.metrics) == 0:
            ui.empty_state(f"{run_id} recorded no confidence vectors ({cal.evaluation}).")
        else:
            st.caption(cal.evaluation)
            verdict = cal.verdict
            if verdict is not None:  # the same verdict fit-sts and the report give
                say = {"ok": st.success, "too few to trust": st.warning}.get(
                    verdict.status, st.error
                )
                say(
                    "\n".join([f"**STS verdict: {verdict.status}**", *(f"- {r}" for r in
                                                                        verdict.reasons)])
                )  # fmt: skip
            if cal.pooled:
                c1, c2 = st.columns(2)
                c1.metric("held-out ECE, raw (pooled)", f"{cal.pooled['ece_before']:.4f}")
                c2.metric(
                    "held-out ECE, after STS",
                    f"{cal.pooled['ece_after']:.4f}",
                    delta=f"{cal.pooled['ece_after'] - cal.pooled['ece_before']:+.4f}",
                    delta_color="inverse",
                )
            m = cal.metrics
            fig = px.scatter(
                m,
                x="position",
                y="ece",
                color="variant",
                facet_col="workload",
                error_y=m["ece_hi"] - m["ece"],
                error_y_minus=m["ece"] - m["ece_lo"],
                hover_data=["n", "requests"],
                color_discrete_map=COLORS,
                title="ECE per position, 95% interval over requests",
            )
            ui.chart(fig, key="ece")
            bins = cal.reliability[cal.reliability["count"] > 0]
            for wl, part in bins.groupby("workload", sort=True):
                positions = sorted(part["position"].unique())
                fig = make_subplots(
                    rows=1,
                    cols=len(positions),
                    shared_yaxes=True,
                    subplot_titles=[f"j = {p}" for p in positions],
                )
                for i, pos in enumerate(positions, start=1):
                    fig.add_trace(
                        go.Scatter(
                            x=[0, 1],
                            y=[0, 1],
                            mode="lines",
                            line={"dash": "dot", "color": "grey"},
                            showlegend=False,
                        ),
                        row=1,
                        col=i,
                    )
                    for variant, color in COLORS.items():
                        g = part[(part["position"] == pos) & (part["variant"] == variant)]
                        fig.add_trace(
                            go.Scatter(
                                x=g["mean_pred"],
                                y=g["mean_label"],
                                mode="markers",
                                name=variant,
                                legendgroup=variant,
                                showlegend=i == 1,
                                marker={
                                    "size": 4 + 14 * (g["count"] / max(1, g["count"].max())),
                                    "color": color,
                                },
                                customdata=g["count"],
                                hovertemplate="pred %{x:.2f}<br>accepted %{y:.2f}"
                                "<br>n %{customdata}<extra></extra>",
                            ),
                            row=1,
                            col=i,
                        )
                fig.update_layout(title=f"Reliability, {wl} (marker size = bin count)")
                fig.update_xaxes(range=[0, 1], title_text="predicted S_j")
                fig.update_yaxes(range=[0, 1.02])
                ui.chart(fig, key=f"rel-{wl}", top=80)
            ui.table(m)
            if cal.sts_json and verdict is not None and verdict.servable:
                st.download_button(
                    f"Download the STS JSON (SGLang format) · verdict: {verdict.status}",
                    cal.sts_json,
                    file_name=f"sts-{run_id}.json",
                    mime="application/json",
                )
                st.code(f"dspark-obs fit-sts --run {run_id} --out sts.json", language="bash")
            elif cal.sts_json:  # a harmful STS is never offered as a download
                st.info(
                    "No download: these temperatures made calibration worse on held-out "
                    "requests. Fit on more traffic and check the verdict again:"
                )
                st.code(f"dspark-obs fit-sts --run {run_id} --out sts.json", language="bash")


ui.page(
    "Calibration",
    "Prediction for draft position j: survival S_j = c_1...c_j; label: drafts 1..j all "
    "accepted. Censored positions (past an all-accepted compact window) are never counted "
    "as rejections. ECE: 15 equal-width bins, as SGLang's STS fitter computes it.",
    show,
)
