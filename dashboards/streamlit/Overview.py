"""Overview: every run at a glance (throughput, accept length, companion status, latency).

Launch with ``dspark-obs dashboard``; this file is the app's entry page, the others are in
pages/. Each page is layout only: the numbers come from queries.py.
"""

from __future__ import annotations

import plotly.express as px
import plotly.graph_objects as go
import queries as q
import streamlit as st
import ui

ui.header(
    "Overview",
    "Runs in the store: tokens/s, accept length (committed per step, bonus included), "
    "windows, TTFT / TPOT, and whether each compact run has a cap-accept companion.",
)
s = ui.store()
live = st.sidebar.toggle("Auto-refresh every 5 s", value=False, key="live")


@st.fragment(run_every=5 if live else None)
def body(f: q.Filters) -> None:
    runs = q.run_table(s, f)
    if len(runs) == 0:
        ui.empty_state("No run matches the filters.")
        return
    primary = runs[runs["companion_of"].isna()]
    latest = (primary if len(primary) else runs).iloc[0]  # newest run that is not a companion
    cols = st.columns(5)
    cols[0].metric("runs", len(runs))
    cols[1].metric(f"tokens/s · {latest.run_id}", f"{latest.tokens_per_s or 0:.1f}")
    cols[2].metric("accept length", f"{latest.accept_length or 0:.2f}")
    cols[3].metric("mean window", f"{latest.mean_window or 0:.2f}")
    cols[4].metric("companion", str(latest.companion_status))
    ui.table(
        runs[
            [
                "run_id",
                "mode",
                "model",
                "workload",
                "requests",
                "tokens",
                "tokens_per_s",
                "accept_length",
                "mean_window",
                "ttft_p50_s",
                "tpot_p50_s",
                "companion_status",
                "started_at",
                "last_record",
            ]
        ]
    )
    left, right = st.columns(2)
    wl = q.workload_table(s, f)
    if len(wl):
        fig = px.bar(
            wl,
            x="workload",
            y="mean_acc_len",
            color="run_id",
            barmode="group",
            title="Accept length per workload",
            labels={"mean_acc_len": "accept length"},
        )
        with left:
            ui.chart(fig, key="accept")
    with right:
        ui.chart(
            px.bar(runs, x="run_id", y="tokens_per_s", color="mode", title="Tokens/s per run"),
            key="tps",
        )
    lat = q.latency(s, f)
    if len(lat) == 0:
        ui.empty_state("No finished request yet (TTFT / TPOT appear when requests finish).")
        return
    left, right = st.columns(2)
    for col, metric, title in (
        (left, "ttft_s", "TTFT (s), box p5-p95"),
        (right, "tpot_s", "TPOT (s, TTFT excluded), box p5-p95"),
    ):
        fig = go.Figure()
        for run_id, g in lat[lat["metric"] == metric].groupby("run_id", sort=True):
            fig.add_trace(
                go.Box(
                    x=g["workload"],
                    name=run_id,
                    q1=g["p25"],
                    median=g["p50"],
                    q3=g["p75"],
                    lowerfence=g["p05"],
                    upperfence=g["p95"],
                )
            )
        fig.update_layout(title=title, boxmode="group", yaxis_title="seconds")
        with col:
            ui.chart(fig, key=metric)


if ui.require_data(s):
    body(ui.sidebar_filters(s))
