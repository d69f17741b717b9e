"""What every page shares: the store handle, the page frame, the sidebar filters, caching.

The store comes from $DSPARK_OBS_STORE (``dspark-obs dashboard --store`` sets it), else
./store. Every read goes through ``Store.query`` (read-only, confined to the store), so the
dashboard can stay open while a run is being ingested: SQL aggregates are not cached at all,
and the analytics (estimator, calibration) are cached per run *and* per row count of that run,
so new rows invalidate them as soon as they land.

Pages import this module and the queries by their full name (``dashboards.streamlit.ui``,
``dashboards.streamlit.queries.<page>``), with the repository root on ``sys.path``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from dashboards.streamlit.queries import overview, shared
from dspark_obs.store import Store

STORE_ENV = "DSPARK_OBS_STORE"
RUN_HINT = "dspark-obs run --workload mixed -n 12 --mode compact --companion --store {store}"
T = TypeVar("T")


@st.cache_resource
def _store(root: str) -> Store:
    return Store(root)


def store() -> Store:
    return _store(os.environ.get(STORE_ENV, "store"))


def page(title: str, why: str, show: Callable[[Store, shared.Filters], None]) -> None:
    """One page: its title and why, then ``show(store, filters)``, or, on a store without
    any run, an empty state naming the command that fills it."""
    st.set_page_config(page_title=f"dspark-obs · {title}", layout="wide")
    st.title(title)
    st.caption(why)
    s = store()
    if require_data(s):
        show(s, sidebar_filters(s))


def empty_state(what: str, command: str | None = None) -> None:
    """Say what is missing and the command that produces it."""
    st.info(f"{what} Run this to produce it:")
    st.code(command or RUN_HINT.format(store=store().root), language="bash")


def require_data(s: Store) -> bool:
    """False (with an empty state) when the store holds no run at all."""
    rows = shared.store_rows(s)
    if rows["req_steps"] == 0 and rows["runs"] == 0:
        empty_state(f"The store at `{s.root}` holds no run yet.")
        return False
    return True


def sidebar_filters(s: Store) -> shared.Filters:
    """Run / workload / mode multiselects (empty = all); their state is kept across pages."""
    opts = shared.filter_options(s)
    st.sidebar.header("Filters")
    keep = st.session_state
    chosen = {}
    for name, label in (("runs", "Runs"), ("workloads", "Workloads"), ("modes", "Modes")):
        key = f"filter_{name}"
        if key in keep:  # a run may have disappeared from the options since (store reset)
            keep[key] = [v for v in keep[key] if v in opts[name]]
        chosen[name] = tuple(st.sidebar.multiselect(label, opts[name], key=key))
    st.sidebar.caption(f"store: `{s.root}` · empty selection = all")
    return shared.Filters(**chosen)


def pick_run(
    s: Store, f: shared.Filters, label: str, modes: tuple[str, ...] = (), key: str = "run"
) -> str | None:
    """One run (of the filtered ones, optionally of some modes); None if there is none."""
    runs = overview.run_table(s, f)
    if modes:
        runs = runs[runs["mode"].isin(modes)]
    runs = runs.sort_values("companion_of", na_position="first", kind="stable")  # primaries first
    if len(runs) == 0:
        return None
    return st.selectbox(label, runs["run_id"].tolist(), key=key)


def run_rows(s: Store, run_id: str) -> int:
    """Rows of a run so far: the cache key that makes cached analytics follow ingestion."""
    sql = f"SELECT count(*) FROM req_steps WHERE run_id = {shared.lit(run_id)}"
    return int(s.query(sql).column(0)[0].as_py())


@st.cache_data(ttl=600, show_spinner="Computing over the run's rows ...", max_entries=64)
def _cached(_fn: Callable[..., Any], name: str, root: str, version: object, *args: Any) -> Any:
    return _fn(_store(root), *args)


def cached(fn: Callable[..., T], s: Store, version: object, *args: Any) -> T:
    """``fn(s, *args)`` cached per (function, store, version, args); ``version`` is what must
    change for the answer to change (the row counts of the runs it reads)."""
    return _cached(fn, f"{fn.__module__}.{fn.__qualname__}", str(s.root), version, *args)


def chart(fig: go.Figure, key: str | None = None, top: int = 40) -> None:
    fig.update_layout(margin={"l": 10, "r": 10, "t": top, "b": 10})
    st.plotly_chart(fig, key=key)


def table(frame: pd.DataFrame, **kwargs: Any) -> None:
    st.dataframe(frame, hide_index=True, **kwargs)
