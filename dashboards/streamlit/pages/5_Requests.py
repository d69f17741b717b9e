"""Requests: one request step by step (confidence, survival, window, accepted tokens, text)."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import streamlit as st

from dashboards.streamlit import ui
from dashboards.streamlit.queries import overview, requests
from dashboards.streamlit.queries.shared import Filters
from dspark_obs.store import Store


def show(s: Store, f: Filters) -> None:
    reqs = requests.request_list(s, f)
    if len(reqs) == 0:
        ui.empty_state("No finished request matches the filters.")
    else:
        companions = set(overview.run_table(s, f).dropna(subset=["companion_of"])["run_id"])
        reqs = reqs.assign(_comp=reqs["run_id"].isin(companions))
        reqs = reqs.sort_values(["_comp", "completion_tokens"], ascending=[True, False])
        reqs = reqs.reset_index(drop=True)  # default: the longest request of a primary run
        labels = [
            f"{r.run_id} · {r.rid} ({r.workload}, {r.completion_tokens} tokens)"
            for r in reqs.itertuples()
        ]
        i = st.selectbox("Request", range(len(labels)), format_func=labels.__getitem__, key="req")
        run_id, rid = reqs.iloc[i]["run_id"], reqs.iloc[i]["rid"]
        steps = requests.request_steps(s, run_id, rid)
        detail = requests.request_detail(s, run_id, rid) or {}
        c = st.columns(5)
        c[0].metric("steps", len(steps))
        c[1].metric("completion tokens", detail.get("completion_tokens") or 0)
        c[2].metric("accept length", f"{steps['acc_len'].mean():.2f}" if len(steps) else "-")
        ttft, tpot = detail.get("ttft_s"), detail.get("tpot_s")
        one_token = (detail.get("completion_tokens") or 0) <= 1  # TPOT excludes the first
        c[3].metric("TTFT s", "-" if ttft is None else f"{ttft:.3f}")
        c[4].metric("TPOT s", "-" if tpot is None or one_token else f"{tpot:.4f}")
        if len(steps):
            fig = go.Figure()
            fig.add_trace(
                go.Bar(x=steps["forward_ct"], y=steps["verify_len"], name="window", opacity=0.35)
            )
            fig.add_trace(
                go.Scatter(
                    x=steps["forward_ct"],
                    y=steps["acc_len"],
                    name="committed",
                    mode="lines+markers",
                )
            )
            fig.add_trace(
                go.Scatter(
                    x=steps["forward_ct"],
                    y=steps["acc_len"] + steps["cap_trim"].fillna(0),
                    name="ceiling",
                    mode="lines",
                    line={"dash": "dot"},
                )
            )
            fig.update_layout(
                title="Window, committed and ceiling per step",
                xaxis_title="decode step (forward_ct)",
                yaxis_title="tokens",
            )
            ui.chart(fig, key="req-steps")
            gamma = int(steps["gamma"].max())
            for col, title in (("confidence", "Confidence c_j"), ("survival", "Survival S_j")):
                mat = np.full((gamma, len(steps)), np.nan)
                for k, v in enumerate(steps[col]):
                    if v is not None:
                        mat[: len(v), k] = v
                fig = go.Figure(
                    go.Heatmap(
                        z=mat,
                        x=steps["forward_ct"],
                        y=list(range(1, gamma + 1)),
                        zmin=0,
                        zmax=1,
                        colorscale="Blues",
                        colorbar={"title": col},
                    )
                )
                fig.add_trace(
                    go.Scatter(
                        x=steps["forward_ct"],
                        y=steps["verify_len"] - 0.5,
                        mode="lines",
                        line={"shape": "hv", "color": "red"},
                        name="window edge",
                    )
                )
                fig.update_layout(
                    title=f"{title} per step (red: drafts verified below the line)",
                    xaxis_title="decode step",
                    yaxis_title="draft position j",
                )
                ui.chart(fig, key=f"req-{col}")
            ui.table(steps)
        st.subheader("Prompt")
        st.text(detail.get("prompt") or "(not recorded)")
        st.subheader("Output token ids")
        st.caption(
            "The store keeps token ids (tokenizer-independent); "
            "decode them with the model's tokenizer."
        )
        st.code(str(detail.get("output_tokens")), language=None)


ui.page(
    "Requests",
    "Pick a request: per step its window, what was committed, the head's confidence c_j "
    "and survival S_j for each draft position, and its prompt and output.",
    show,
)
