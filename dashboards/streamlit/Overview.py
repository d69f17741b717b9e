"""Overview: the acceptance ceiling first (committed vs ceiling, utilization, tokens left on the
table, ECE, windows), then every run at a glance (throughput, latency, companion status).

Launch with ``dspark-obs dashboard``; this file is the app's entry page, the others are in
pages/. Each page is layout only: the numbers come from the queries package
(dashboards/streamlit/queries/, one module per page).
"""

from __future__ import annotations

import math

import plotly.express as px
import plotly.graph_objects as go
import streamlit as st

from dashboards.streamlit import ui
from dashboards.streamlit.queries import overview
from dashboards.streamlit.queries.overview import RunCeiling
from dashboards.streamlit.queries.shared import Filters, store_rows
from dspark_obs.store import Store

MAX_CEILING_RUNS = 6  # the first screen's chart: the newest runs that are not companions


def _fmt(value: float, digits: int = 2, pct: bool = False) -> str:
    if not math.isfinite(value):
        return "unknown"
    return f"{100 * value:.1f}%" if pct else f"{value:.{digits}f}"


def _ranged(c: RunCeiling, name: str, digits: int = 2, pct: bool = False) -> str:
    """A figure, with its interval when it is estimated."""
    point = _fmt(getattr(c, name), digits, pct)
    if not c.estimated or point == "unknown":
        return point
    lo, hi = (
        _fmt(getattr(c, f"{name}_lo"), digits, pct),
        _fmt(getattr(c, f"{name}_hi"), digits, pct),
    )
    return f"{point} [{lo}, {hi}]"


def ceiling_screen(s: Store, runs, version: int) -> None:
    """The first screen: the newest primary run's ceiling figures, then a chart over runs."""
    primary = runs[runs["companion_of"].isna()]
    shown = (primary if len(primary) else runs).head(MAX_CEILING_RUNS)
    ceilings = [ui.cached(overview.run_ceiling, s, version, r) for r in shown["run_id"]]
    c = ceilings[0]
    label = {"measured": "measured"}.get(c.source, c.source)
    st.subheader(f"{c.run_id} ({c.mode or 'mode unknown'}): ceiling {label}")
    cols = st.columns(6)
    cols[0].metric("committed / step", _fmt(c.committed))
    cols[1].metric("ceiling / step" + (" (estimated)" if c.estimated else ""),
                   _ranged(c, "ceiling"), help=f"ceiling {label}")  # fmt: skip
    cols[2].metric("utilization" + (" (estimated)" if c.estimated else ""),
                   _ranged(c, "utilization", pct=True))  # fmt: skip
    cols[3].metric("tokens left on the table" + (" (estimated)" if c.estimated else ""),
                   _ranged(c, "tokens_left", digits=0))  # fmt: skip
    cols[4].metric("ECE (raw, pooled)", _fmt(c.ece, 4), help=f"{c.ece_n} observed positions")
    cols[5].metric("mean window", _fmt(c.mean_window))
    if c.source == "unknown":
        st.info(
            f"{c.run_id}: the ceiling is unknown (no companion and no estimate). Run with "
            "`--companion` to measure it."
        )
    fig = go.Figure()
    names = [x.run_id for x in ceilings]
    fig.add_trace(go.Bar(x=names, y=[x.committed for x in ceilings], name="committed / step"))
    for kind, keep in (("measured", lambda x: x.source.startswith("measured")),
                       ("estimated (95% interval)", lambda x: x.estimated)):  # fmt: skip
        sel = [x for x in ceilings if keep(x)]
        if not sel:
            continue
        fig.add_trace(
            go.Scatter(
                x=[x.run_id for x in sel],
                y=[x.ceiling for x in sel],
                mode="markers",
                name=f"ceiling, {kind}",
                marker={"size": 14, "symbol": "diamond" if kind == "measured" else "circle-open"},
                error_y={
                    "type": "data",
                    "symmetric": False,
                    "array": [x.ceiling_hi - x.ceiling for x in sel],
                    "arrayminus": [x.ceiling - x.ceiling_lo for x in sel],
                },
                customdata=[x.source for x in sel],
                hovertemplate="%{x}: ceiling %{y:.2f} (%{customdata})<extra></extra>",
            )
        )
    fig.update_layout(title="Committed vs ceiling per step (runs without a ceiling: bar only)",
                      yaxis_title="tokens per step", barmode="group")  # fmt: skip
    ui.chart(fig, key="ceiling")
    table = [
        {
            "run_id": x.run_id,
            "mode": x.mode,
            "ceiling": x.source,
            "committed/step": x.committed,
            "ceiling/step": _ranged(x, "ceiling"),
            "utilization": _ranged(x, "utilization", pct=True),
            "tokens left": _ranged(x, "tokens_left", digits=0),
            "ECE raw": x.ece,
            "mean window": x.mean_window,
        }
        for x in ceilings
    ]
    ui.table(table)


def body(s: Store, f: Filters) -> None:
    runs = overview.run_table(s, f)
    if len(runs) == 0:
        ui.empty_state("No run matches the filters.")
        return
    ceiling_screen(s, runs, store_rows(s)["req_steps"])
    st.subheader("Runs")
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
    st.caption("TTFT / TPOT: exact quantiles over the stored requests.")
    left, right = st.columns(2)
    wl = overview.accept_by_workload(s, f)
    if len(wl):
        fig = px.bar(
            wl,
            x="workload",
            y="accept_length",
            color="run_id",
            barmode="group",
            title="Accept length per workload",
            labels={"accept_length": "accept length"},
        )
        with left:
            ui.chart(fig, key="accept")
    with right:
        ui.chart(
            px.bar(runs, x="run_id", y="tokens_per_s", color="mode", title="Tokens/s per run"),
            key="tps",
        )
    lat = overview.latency(s, f)
    if len(lat) == 0:
        ui.empty_state("No finished request yet (TTFT / TPOT appear when requests finish).")
        return
    left, right = st.columns(2)
    for col, metric, title in (
        (left, "ttft_s", "TTFT (s), box p5-p95, exact quantiles"),
        (right, "tpot_s", "TPOT (s, TTFT excluded), box p5-p95, exact quantiles"),
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


def show(s: Store, f: Filters) -> None:
    live = st.sidebar.toggle("Auto-refresh every 5 s", value=False, key="live")
    st.fragment(body, run_every=5 if live else None)(s, f)


ui.page(
    "Overview",
    "Is trimming leaving accepted tokens on the table? Ceiling = what a full-block verify "
    "would have committed: measured for cap-accept and static runs (and for a compact run by "
    "its cap-accept companion), estimated with its 95% interval for a compact run alone "
    "(block-accept estimator). Utilization = committed / ceiling.",
    show,
)
