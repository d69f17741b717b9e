"""The live estimator series (sinks/stats.py) use the store's and the report's estimator.

The Aggregator finalizes finished requests in passes; a run's tail model is selected
(``auto``) and fit on the observations of the requests it finished before fixed points of its
request count, so the sums do not depend on when passes ran; the point series says which model
filled the tail. Passes are forced here (no clock involved).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dspark_obs.analytics.estimator import estimate_blocks
from dspark_obs.analytics.estimator_live import REFIT_EVERY, TAIL_WINDOW, RunTail, refits_at
from dspark_obs.analytics.estimator_tail import OBS_COLUMNS, fit_tail
from dspark_obs.engine.session import run_with_companion
from dspark_obs.fanout import MemorySink
from dspark_obs.sinks.stats import Aggregator
from dspark_obs.testing.tiny_models import tiny_models
from tests.test_sinks_prometheus import tiny_requests, trimming_config

POINT = "dspark_estimator_point_tokens_total"


@pytest.fixture(scope="module")
def compact_run() -> MemorySink:
    sink = MemorySink()
    _, _, fan = run_with_companion(
        tiny_models(), tiny_requests(n=12, seed=3), trimming_config(), [sink], "t"
    )
    assert fan.errors == []
    return sink


def _aggregator(sink: MemorySink) -> Aggregator:
    agg = Aggregator(finalize_interval_s=float("inf"))  # passes only when forced
    agg.update("runs", sink.table("runs"))
    agg.update("req_steps", sink.table("req_steps"))
    return agg


def _points(agg: Aggregator) -> dict[str, float]:
    """Point tokens per tail label (the label is the last one)."""
    out: dict[str, float] = {}
    for key, v in agg.totals.counters[POINT].items():
        out[key[-1]] = out.get(key[-1], 0.0) + v
    return out


def _rows_of(sink: MemorySink, rids: list[str]) -> tuple[pa.Table, pa.Table]:
    rs, rq = sink.table("req_steps"), sink.table("requests")
    pick = pa.array(rids)
    return (
        rs.filter(pc.is_in(rs.column("rid"), value_set=pick)),
        rq.filter(pc.is_in(rq.column("rid"), value_set=pick)),
    )


def _order(sink: MemorySink) -> list[str]:
    return sink.table("requests").column("rid").to_pylist()  # finishing order


def test_sums_do_not_depend_on_when_the_passes_ran(compact_run) -> None:
    """One pass over every finished request, or one pass per request: the same totals (a
    restarted serve re-reading the store resumes every counter where it was)."""
    one = _aggregator(compact_run)
    one.update("requests", compact_run.table("requests"))
    one.finalize()
    many = _aggregator(compact_run)
    reqs = compact_run.table("requests")
    for i in range(reqs.num_rows):
        many.update("requests", reqs.slice(i, 1))
        many.finalize()
    for name in ("point", "lo", "hi", "committed"):
        full = f"dspark_estimator_{name}_tokens_total"
        assert many.totals.counters[full].keys() == one.totals.counters[full].keys()
        for key, v in one.totals.counters[full].items():
            assert many.totals.counters[full][key] == pytest.approx(v, rel=1e-12), (name, key)


def test_tail_model_is_the_auto_fit_on_the_requests_finished_before(compact_run) -> None:
    """Requests in finishing order; the model for request n is ``fit_tail("auto")`` on the
    requests before the last refit point <= n (0, 1, 2, 4, 8, ...), as the report fits it."""
    agg = _aggregator(compact_run)
    agg.update("requests", compact_run.table("requests"))
    agg.finalize()
    rids = _order(compact_run)
    starts = [n for n in range(len(rids)) if refits_at(n)] + [len(rids)]
    assert starts[:5] == [0, 1, 2, 4, 8]
    expected: dict[str, float] = {}
    seen = pd.DataFrame(columns=list(OBS_COLUMNS))
    for a, b in zip(starts, starts[1:], strict=False):
        rows, reqs = _rows_of(compact_run, rids[a:b])
        model = fit_tail("auto", seen, 5)
        est = estimate_blocks(rows, reqs, mode="compact", tail_model=model)
        expected[model.name] = expected.get(model.name, 0.0) + est.blocks["point"].sum()
        seen = pd.concat([seen, est.observations], ignore_index=True)
    got = _points(agg)
    assert got.keys() == expected.keys()
    for name, v in expected.items():
        assert got[name] == pytest.approx(v, rel=1e-12)
    full = estimate_blocks(
        compact_run.table("req_steps"), compact_run.table("requests"), mode="compact"
    )
    assert full.blocks["censored"].any()  # the trimming table censors: the tail matters
    for col in ("lo", "hi", "committed"):  # the bracket does not depend on the tail model
        total = sum(agg.totals.counters[f"dspark_estimator_{col}_tokens_total"].values())
        assert total == pytest.approx(full.blocks[col].sum(), rel=1e-12)


def test_refit_points_and_bounded_observations() -> None:
    assert [n for n in range(40) if refits_at(n)] == [0, 1, 2, 4, 8, 16, 32]
    assert refits_at(REFIT_EVERY) and not refits_at(REFIT_EVERY + 1)
    assert refits_at(3 * REFIT_EVERY) and not refits_at(3 * REFIT_EVERY - 1)
    state = RunTail()
    obs = pd.DataFrame(
        {
            "request": "r",
            "workload": "w",
            "position": np.ones(TAIL_WINDOW // 2 + 1, dtype=np.int64),
            "conf": 0.5,
            "y": 1.0,
            "resolved": False,
        }
    )
    for _ in range(3):
        state.add(obs, 1)
    assert len(state.observations) == TAIL_WINDOW and state.finished == 3
