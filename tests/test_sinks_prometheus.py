"""PrometheusSink: totals equal the analytics' numbers for the same run; censoring is exact.

A tiny random-initialized engine run (compact + its cap-accept companion) feeds a MemorySink
and a PrometheusSink through one FanOut; every exported number is read back with
CollectorRegistry.get_sample_value and compared with the analytics functions over the
MemorySink's rows.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dspark_obs.analytics.calibration import calibration_table, position_labels
from dspark_obs.analytics.companion import step_ceilings
from dspark_obs.analytics.estimator import estimate_blocks
from dspark_obs.analytics.windows import window_stats
from dspark_obs.cost_table import AdditiveCostTable
from dspark_obs.engine.session import run_with_companion
from dspark_obs.engine.types import EngineConfig, GenRequest
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.sinks import PrometheusSink, telemetry_sinks
from dspark_obs.sinks.catalog import METRICS, token_buckets
from dspark_obs.testing.tiny_models import tiny_models

VOCAB = 6  # tiny vocabulary: random drafts are often accepted, so windows get trimmed
ALLOWED_LABELS = {"model", "mode", "workload", "dp_rank", "position", "bin", "table", "reason",
                  "finish_reason", "tail", "le"}  # fmt: skip


def trimming_config(mode: str = "compact") -> EngineConfig:
    table = AdditiveCostTable.from_dict(
        {
            "bias_seconds": 0.01,
            "bs_probes": [1, 16],
            "alpha_seconds": [0.0, 0.0],
            "m_probes": [1, 8, 16, 64, 128],
            "theta_seconds": [0.0, 0.01, 0.03, 0.15, 0.4],
        }
    )
    return EngineConfig(mode=mode, gamma=5, max_batch=4, cost_table=table, flush_every=4)


def tiny_requests(n: int = 10, seed: int = 0, temperature: float = 1.0) -> list[GenRequest]:
    rng = np.random.default_rng(seed)
    return [
        GenRequest(
            rid=f"r{i}",
            prompt_ids=rng.integers(0, VOCAB, size=6).tolist(),
            max_new_tokens=int(rng.integers(12, 30)),
            workload=("math", "chat", "poetry")[i % 3],
            temperature=temperature,
            seed=100 + i,
            arrival_step=i,
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def run():
    mem = MemorySink()
    prom = PrometheusSink(registry=CollectorRegistry())
    run_with_companion(
        tiny_models(), tiny_requests(), trimming_config(), [mem, prom], "t", companion=True,
        workload="mixed",
    )  # fmt: skip
    prom.flush()
    assert prom.errors == []
    return mem, prom


def samples(prom: PrometheusSink) -> list:
    """One scrape's samples (what the registry renders at /metrics), with every series past
    its birth: a series new to the exporter reads 0 on its first scrape (tested below)."""
    list(prom.registry.collect())
    return [s for fam in prom.registry.collect() for s in fam.samples]


def value(src: PrometheusSink | list, name: str, **labels: str) -> float:
    """Sum of a sample over every series matching ``labels`` (a sink: scrape it now)."""
    scraped = samples(src) if isinstance(src, PrometheusSink) else src
    return sum(
        s.value
        for s in scraped
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def frames(mem: MemorySink):
    return mem.table("req_steps").to_pandas(), mem.table("runs").to_pandas()


def test_acceptance_per_position_is_accepted_over_observed(run) -> None:
    mem, prom = run
    rs, runs = frames(mem)
    lab = position_labels(rs, runs=runs)
    prom = samples(prom)
    for run_id, mode in (("t", "compact"), ("t-cap", "cap-accept")):
        obs = lab[(lab.run_id == run_id) & lab.observed]
        for j, g in obs.groupby("position"):
            pos = str(j)
            assert value(prom, "dspark_position_observed_total", mode=mode, position=pos) == len(g)
            assert value(prom, "dspark_position_accepted_total", mode=mode, position=pos) == (
                g.label.sum()
            )
        drafted = lab[lab.run_id == run_id]
        censored = drafted[~drafted.observed]
        assert value(prom, "dspark_position_censored_total", mode=mode) == len(censored)
        assert value(prom, "dspark_position_drafted_total", mode=mode) == len(drafted)
    # the compact run really trims (else censoring is untested here)
    assert value(prom, "dspark_position_censored_total", mode="compact") > 0
    assert value(prom, "dspark_position_censored_total", mode="cap-accept") == 0


def test_ece_per_position_from_bin_counters_equals_the_analytics(run) -> None:
    mem, prom = run
    rs, runs = frames(mem)
    lab = position_labels(rs[rs.run_id == "t"], runs=runs)
    table = calibration_table(lab, by=("position",))
    assert len(table) == 5
    scraped = samples(prom)
    for row in table.itertuples():
        pos, err, n = str(row.position), 0.0, 0.0
        for b in range(15):
            kw = {"mode": "compact", "position": pos, "bin": str(b)}
            p = value(scraped, "dspark_calibration_predicted_probability_total", **kw)
            y = value(scraped, "dspark_calibration_accepted_total", **kw)
            err += abs(p - y)
            n += value(scraped, "dspark_calibration_observations_total", **kw)
        assert n == row.n
        assert err / n == pytest.approx(row.ece, abs=1e-9)


def test_window_utilization_estimator_and_token_counters(run) -> None:
    mem, prom = run
    rs, runs = frames(mem)
    ws = window_stats(rs[rs.run_id == "t"], by=("workload",))
    for r in ws.itertuples():
        kw = {"mode": "compact", "workload": r.workload}
        mean = value(prom, "dspark_verify_window_tokens_sum", **kw) / value(
            prom, "dspark_verify_window_tokens_count", **kw
        )
        assert mean == pytest.approx(r.mean_window, rel=1e-12)
    cap = step_ceilings(rs[rs.run_id == "t-cap"])
    assert value(prom, "dspark_ceiling_tokens_total", mode="cap-accept") == cap.ceiling.sum()
    assert value(prom, "dspark_ceiling_committed_tokens_total") == cap.committed.sum()
    assert value(prom, "dspark_cap_trim_tokens_total") == cap.cap_trim.sum() > 0
    assert value(prom, "dspark_committed_tokens_total", mode="compact") == (
        rs[rs.run_id == "t"].acc_len.sum()
    )
    assert value(prom, "dspark_ceiling_per_step_tokens_count") == len(cap)
    # estimator: finished per request; the bracket sums equal one pass over the whole run
    # (the point's tail model is fit on the run so far at each pass: tests/test_sinks_stats.py)
    compact = rs[rs.run_id == "t"]
    blocks = estimate_blocks(
        compact, requests=mem.table("requests").to_pandas(), mode="compact"
    ).blocks
    for col in ("lo", "hi", "committed"):
        got = value(prom, f"dspark_estimator_{col}_tokens_total")
        assert got == pytest.approx(blocks[col].sum(), rel=1e-9)
    scraped = samples(prom)
    tails = {s.labels["tail"] for s in scraped if s.name == "dspark_estimator_point_tokens_total"}
    assert tails and tails <= {"calibrated", "confidence", "empirical", "none"}
    assert value(scraped, "dspark_estimator_point_tokens_total") >= blocks["committed"].sum()
    assert value(prom, "dspark_estimator_blocks_total") == len(compact)
    full = (compact.correct_drafts == compact.verify_len - 1) & (compact.verify_len <= 5)
    assert value(prom, "dspark_window_fully_accepted_total") == full.sum() > 0


def test_histograms_latency_and_vllm_family(run) -> None:
    mem, prom = run
    rs, _ = frames(mem)
    req = mem.table("requests").to_pandas()
    compact = rs[rs.run_id == "t"]
    # verify window buckets are cumulative integers 1..gamma+1 (+Inf)
    for le in (1, 3, 6):
        got = value(prom, "dspark_verify_window_tokens_bucket", mode="compact", le=str(le))
        assert got == (compact.verify_len <= le).sum()
    assert value(prom, "dspark_time_to_first_token_seconds_count") == len(req)
    ttft = (req.first_token_time - req.arrival_time).sum()
    assert value(prom, "dspark_time_to_first_token_seconds_sum") == pytest.approx(ttft)
    tpot = req[req.completion_tokens > 1]
    assert value(prom, "dspark_time_per_output_token_seconds_count") == len(tpot)
    assert value(prom, "dspark_request_accept_length_tokens_count") == len(req)
    # vLLM-compatible family, position 1-based like every dspark metric: drafts 1..j accepted
    for j in range(1, 6):
        got = value(prom, "dspark_spec_decode_num_accepted_tokens_per_pos_total",
                    mode="compact", position=str(j))  # fmt: skip
        assert got == (compact.correct_drafts >= j).sum()
    assert value(prom, "dspark_spec_decode_num_accepted_tokens_per_pos_total", position="0") == 0
    assert value(prom, "dspark_spec_decode_num_drafts_total", mode="compact") == len(compact)
    steps = mem.table("steps").to_pandas()
    assert value(prom, "dspark_steps_total", mode="compact") == (steps.run_id == "t").sum()


def test_every_catalog_metric_is_exposed_with_bounded_labels(run) -> None:
    _, prom = run
    text = generate_latest(prom.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for m in METRICS:
        assert m.family in families, m.name
        assert families[m.family].type == m.kind
        for s in families[m.family].samples:
            assert set(s.labels) <= ALLOWED_LABELS, (m.name, s.labels)
            assert "rid" not in s.labels and "run_id" not in s.labels


def _req_row(**kw) -> dict:
    row = {"run_id": "u", "dp_rank": 0, "forward_ct": 0, "rid": "a", "gamma": 5,
           "workload": "math", "confidence": [0.9] * 5, "draft_tokens": [1] * 5}  # fmt: skip
    row.update(kw)
    row["acc_len"] = row["correct_drafts"] + 1
    return row


def _runs_row(run_id: str, mode: str) -> dict:
    return {"run_id": run_id, "source": "engine", "mode": mode, "gamma": 5, "model": "m"}


def test_a_trimmed_position_is_never_a_rejection() -> None:
    prom = PrometheusSink(registry=CollectorRegistry(), background=False)
    fan = FanOut([prom])
    fan.emit("runs", [_runs_row("u", "compact"), _runs_row("c", "cap-accept")])
    fan.emit(
        "req_steps",
        [
            # window 3 fully accepted: positions 3..5 never verified -> censored, not rejected
            _req_row(forward_ct=0, verify_len=3, correct_drafts=2),
            # rejection at position 1 inside window 3: positions 1..5 all settled to 0
            _req_row(forward_ct=1, verify_len=3, correct_drafts=0),
            # cap-accept: window 2 committed 1 draft, the full block accepted 3 (cap_trim 2)
            _req_row(run_id="c", verify_len=2, correct_drafts=1, cap_trim=2),
        ],
    )
    obs = [value(prom, "dspark_position_observed_total", mode="compact", position=str(j))
           for j in range(1, 6)]  # fmt: skip
    acc = [value(prom, "dspark_position_accepted_total", mode="compact", position=str(j))
           for j in range(1, 6)]  # fmt: skip
    cen = [value(prom, "dspark_position_censored_total", mode="compact", position=str(j))
           for j in range(1, 6)]  # fmt: skip
    assert obs == [2, 2, 1, 1, 1]
    assert acc == [1, 1, 0, 0, 0]
    assert cen == [0, 0, 1, 1, 1]
    series = {"model": "m", "mode": "compact", "workload": "math", "dp_rank": "0"}
    get = prom.registry.get_sample_value
    assert get("dspark_position_censored_total", {**series, "position": "3"}) == 1.0
    assert get("dspark_position_accepted_total", {**series, "position": "3"}) == 0.0
    assert get("dspark_position_observed_total", {**series, "position": "3"}) == 1.0
    cap = [value(prom, "dspark_position_accepted_total", mode="cap-accept", position=str(j))
           for j in range(1, 6)]  # fmt: skip
    assert cap == [1, 1, 1, 0, 0]
    assert value(prom, "dspark_position_observed_total", mode="cap-accept") == 5
    assert value(prom, "dspark_ceiling_tokens_total", mode="cap-accept") == 4
    assert value(prom, "dspark_window_fully_accepted_total", mode="compact") == 1
    # calibration counts only observed positions: 2 + 2 + 1 + 1 + 1
    assert value(prom, "dspark_calibration_observations_total", mode="compact") == 7


def test_rejected_rows_are_counted_and_good_rows_of_the_batch_kept() -> None:
    prom = PrometheusSink(registry=CollectorRegistry(), background=False)
    fan = FanOut([prom])
    fan.emit("runs", [_runs_row("u", "compact")])
    bad = _req_row(forward_ct=1, verify_len=9, correct_drafts=0)  # window > gamma + 1
    fan.emit("req_steps", [_req_row(verify_len=2, correct_drafts=1), bad])
    assert value(prom, "dspark_req_steps_total") == 1
    got = value(prom, "dspark_records_rejected_total", table="req_steps")
    assert got == 1
    reasons = [s.labels["reason"] for f in prom.registry.collect() for s in f.samples
               if s.name == "dspark_records_rejected_total"]  # fmt: skip
    assert reasons == ["verify_len: verify_len must be in 1..gamma+1"]


def test_rows_of_a_run_not_yet_described_wait_for_its_runs_row() -> None:
    prom = PrometheusSink(registry=CollectorRegistry(), background=False)
    fan = FanOut([prom])
    fan.emit("req_steps", [_req_row(verify_len=2, correct_drafts=1)])
    assert value(prom, "dspark_req_steps_total") == 0
    fan.emit("runs", [_runs_row("u", "cap-accept")])
    assert value(prom, "dspark_req_steps_total", mode="cap-accept", model="m") == 1


def test_token_buckets_follow_gamma() -> None:
    assert token_buckets(5) == (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)


def test_in_process_sinks_serve_metrics_and_healthz() -> None:
    sinks = telemetry_sinks(metrics_port=0, otlp_endpoint=None)
    assert len(sinks) == 1
    prom = sinks[0]
    try:
        fan = FanOut(sinks)
        fan.emit("runs", [_runs_row("u", "compact")])
        fan.emit("req_steps", [_req_row(verify_len=2, correct_drafts=1)])
        url = prom.server.url
        assert prom.server.host == "127.0.0.1"
        series = 'dspark_req_steps_total{dp_rank="0",mode="compact",model="m",workload="math"}'
        texts = []
        for _ in range(2):
            with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
                texts.append(r.read().decode())
        # born at 0 on the first scrape, its value from the next one on
        assert f"{series} 0.0" in texts[0]
        assert f"{series} 1.0" in texts[1]
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
            assert json.loads(r.read())["status"] == "ok"
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"{url}/other", timeout=5)
    finally:
        prom.close()
        prom.server.close()


def _scrape(prom: PrometheusSink) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in prom.registry.collect()
        for s in fam.samples
        if s.name.startswith("dspark_")
    }


def test_every_series_is_born_at_zero_so_increase_counts_its_first_increment() -> None:
    prom = PrometheusSink(registry=CollectorRegistry(), background=False)
    fan = FanOut([prom])
    fan.emit("runs", [_runs_row("u", "compact")])
    fan.emit("req_steps", [_req_row(verify_len=2, correct_drafts=1)])
    first, second = _scrape(prom), _scrape(prom)
    assert first.keys() == second.keys() and len(first) > 20
    assert set(first.values()) == {0.0}  # counters, buckets, sums and counts: all at 0
    key = ("dspark_req_steps_total", (("dp_rank", "0"), ("mode", "compact"), ("model", "m"),
                                      ("workload", "math")))  # fmt: skip
    assert second[key] == 1.0
    # a later increment of a known series shows at once; a new label set is born at 0 again
    fan.emit("req_steps", [_req_row(forward_ct=1, verify_len=2, correct_drafts=1),
                           _req_row(forward_ct=1, rid="b", workload="chat", verify_len=2,
                                    correct_drafts=0)])  # fmt: skip
    third = _scrape(prom)
    assert third[key] == 2.0
    chat = ("dspark_req_steps_total", (("dp_rank", "0"), ("mode", "compact"), ("model", "m"),
                                       ("workload", "chat")))  # fmt: skip
    assert third[chat] == 0.0 and _scrape(prom)[chat] == 1.0


def test_adopted_series_resume_with_their_value() -> None:
    """serve rebuilds its totals from the store after a restart: those continue (no reset)."""
    prom = PrometheusSink(registry=CollectorRegistry(), background=False)
    fan = FanOut([prom])
    fan.emit("runs", [_runs_row("u", "compact")])
    fan.emit("req_steps", [_req_row(verify_len=2, correct_drafts=1)])
    prom.adopt_current()
    assert value(_scrape_list(prom), "dspark_req_steps_total") == 1.0


def _scrape_list(prom: PrometheusSink) -> list:
    return [s for fam in prom.registry.collect() for s in fam.samples]


def test_metric_names_follow_prometheus_naming() -> None:
    """Units as suffixes (token histograms _tokens, time _seconds), no _sum / _count /
    _bucket inside a name, counters end in _total; renamed names are gone."""
    from dspark_obs.sinks.catalog import RENAMED

    names = {m.name for m in METRICS}
    for m in METRICS:
        base = m.name.removesuffix("_total")
        assert not any(part in base for part in ("_sum", "_count", "_bucket")), m.name
        if m.kind == "counter":
            assert m.name.endswith("_total"), m.name
        else:
            unit = {"tokens": "_tokens", "seconds": "_seconds"}[m.unit]
            assert m.name.endswith(unit), m.name
    assert not set(RENAMED) & names and set(RENAMED.values()) <= names


def test_latency_buckets_cover_an_h200_and_the_cpu_engine() -> None:
    """TPOT of ~2 ms (H200) and TTFT of ~60 s (embedded CPU engine) fall inside finite buckets
    with neighbours on both sides: a p99 is never pinned at the last finite edge."""
    from dspark_obs.sinks.catalog import (
        GENAI_DURATION_BUCKETS,
        GENAI_TPOT_BUCKETS,
        GENAI_TTFT_BUCKETS,
    )

    for edges, fast, slow in (
        (GENAI_TTFT_BUCKETS, 0.004, 60.0),
        (GENAI_TPOT_BUCKETS, 0.002, 8.0),
        (GENAI_DURATION_BUCKETS, 0.05, 300.0),
    ):
        assert list(edges) == sorted(edges)
        assert edges[0] < fast and edges[-1] > 2 * slow, edges
