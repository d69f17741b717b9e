"""Cost tables: SGLang JSON round-trips, validation errors, interpolation, least-squares fit."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from dspark_obs.cost_table import (
    AdditiveCostTable,
    CostTable,
    CostTableError,
    StepsPerSecTable,
    fit_additive,
)

SPS = {
    "sample_batch_tokens": [6, 12, 24, 48],
    "sample_steps_per_sec": [50.0, 45.5, 30.25, 12.0],
    "max_batch_tokens": 96,
}
ADD = {
    "bias_seconds": 0.01,
    "bs_probes": [1, 4, 8],
    "alpha_seconds": [0.0, 0.003, 0.005],
    "m_probes": [2, 10, 30],
    "theta_seconds": [0.0, 0.004, 0.024],
}


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "table.json"
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("data", [SPS, ADD], ids=["1d", "additive"])
def test_dict_round_trip_exact(data: dict) -> None:
    table = CostTable.from_dict(data)
    assert table.to_dict() == data
    assert list(table.to_dict()) == list(data)  # SGLang's key order
    assert CostTable.from_dict(table.to_dict()) == table


@pytest.mark.parametrize("data", [SPS, ADD], ids=["1d", "additive"])
def test_file_round_trip_exact(tmp_path: Path, data: dict) -> None:
    table = CostTable.from_dict(data)
    path = tmp_path / "t.json"
    table.save(path)
    again = CostTable.load(path)
    assert again == table
    assert json.loads(path.read_text()) == data
    assert again.to_dict() == data
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temp file left behind


def test_kind_is_told_apart_by_bias_seconds() -> None:
    assert isinstance(CostTable.from_dict(SPS), StepsPerSecTable)
    assert isinstance(CostTable.from_dict(ADD), AdditiveCostTable)


def test_loads_sglang_compact_json_and_keeps_unknown_keys(tmp_path: Path) -> None:
    # msgspec writes compact JSON; ints where floats are expected are fine.
    text = (
        '{"bias_seconds":0.002,"bs_probes":[1,16],"alpha_seconds":[0,0.001],'
        '"m_probes":[1,64,128],"theta_seconds":[0,0.01,0.05],"note":"profiled"}'
    )
    table = CostTable.load(_write(tmp_path, text))
    assert isinstance(table, AdditiveCostTable)
    assert table.alpha_seconds == (0.0, 0.001)
    out = table.to_dict()
    assert out["note"] == "profiled"
    table.save(tmp_path / "b.json")
    assert CostTable.load(tmp_path / "b.json").to_dict() == out


def test_direct_construction_is_validated() -> None:
    with pytest.raises(CostTableError, match="strictly increasing"):
        StepsPerSecTable((4, 2), (1.0, 2.0), 8)
    t = AdditiveCostTable(0.5, [1], [0.0], [1, 2], [0.0, 1.0])  # lists normalized
    assert t.bs_probes == (1,)
    assert t == CostTable.from_dict(t.to_dict())


# --------------------------------------------------------------------------- malformed files


def _mut(base: dict, **changes: object) -> str:
    data = dict(base)
    for key, value in changes.items():
        if value is _DROP:
            del data[key]
        else:
            data[key] = value
    return json.dumps(data)


_DROP = object()

MALFORMED = [
    ("not json", "{bias_seconds: 1", "not valid JSON"),
    ("empty file", "", "not valid JSON"),
    ("top level list", "[1, 2]", "JSON object"),
    ("nan", _mut(SPS).replace("50.0", "NaN"), "non-finite"),
    ("infinity", _mut(ADD).replace("0.003", "Infinity"), "non-finite"),
    ("huge overflows", _mut(ADD).replace("0.003", "1e999"), "non-finite"),
    ("1d missing key", _mut(SPS, max_batch_tokens=_DROP), "missing key(s) 'max_batch_tokens'"),
    ("1d missing probes", _mut(SPS, sample_batch_tokens=_DROP), "'sample_batch_tokens'"),
    ("add missing theta", _mut(ADD, theta_seconds=_DROP), "missing key(s) 'theta_seconds'"),
    ("add missing two", _mut(ADD, m_probes=_DROP, bs_probes=_DROP), "'bs_probes', 'm_probes'"),
    ("1d equal probes", _mut(SPS, sample_batch_tokens=[6, 12, 12, 48]), "strictly increasing"),
    ("1d decreasing", _mut(SPS, sample_batch_tokens=[48, 24, 12, 6]), "strictly increasing"),
    ("bs probes decreasing", _mut(ADD, bs_probes=[1, 8, 4]), "'bs_probes' must be strictly"),
    ("m probes equal", _mut(ADD, m_probes=[2, 2, 30]), "'m_probes' must be strictly"),
    ("1d empty", _mut(SPS, sample_batch_tokens=[], sample_steps_per_sec=[]), "non-empty"),
    ("1d lengths", _mut(SPS, sample_steps_per_sec=[1.0, 2.0]), "has 2 values but"),
    ("alpha lengths", _mut(ADD, alpha_seconds=[0.0, 0.1]), "'alpha_seconds' has 2 values"),
    ("theta lengths", _mut(ADD, theta_seconds=[0.0] * 4), "'theta_seconds' has 4 values"),
    ("bias zero", _mut(ADD, bias_seconds=0), "'bias_seconds' must be finite and > 0"),
    ("bias negative", _mut(ADD, bias_seconds=-0.1), "'bias_seconds' must be finite and > 0"),
    ("bias string", _mut(ADD, bias_seconds="0.1"), "'bias_seconds' must be a number"),
    ("sps zero", _mut(SPS, sample_steps_per_sec=[50.0, 0.0, 1.0, 1.0]), "must all be > 0"),
    ("sps negative", _mut(SPS, sample_steps_per_sec=[50.0, -1.0, 1.0, 1.0]), "> 0"),
    ("float probe", _mut(SPS, sample_batch_tokens=[6, 12.0, 24, 48]), "must hold ints"),
    ("bool probe", _mut(ADD, bs_probes=[True, 4, 8]), "must hold ints"),
    ("string value", _mut(ADD, theta_seconds=[0.0, "x", 1.0]), "must hold numbers"),
    ("max below probes", _mut(SPS, max_batch_tokens=40), "below the largest probe 48"),
    ("max not int", _mut(SPS, max_batch_tokens=96.0), "'max_batch_tokens' must be an int"),
]


@pytest.mark.parametrize(
    ("text", "needle"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_file_names_file_and_problem(tmp_path: Path, text: str, needle: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(CostTableError) as err:
        CostTable.load(path)
    message = str(err.value)
    assert str(path) in message
    assert needle in message


def test_missing_file_names_file(tmp_path: Path) -> None:
    with pytest.raises(CostTableError, match="nope.json"):
        CostTable.load(tmp_path / "nope.json")


def test_from_dict_names_its_source() -> None:
    with pytest.raises(CostTableError, match="profiler-output: missing key"):
        CostTable.from_dict({"bias_seconds": 1.0}, source="profiler-output")


# --------------------------------------------------------------------------- interpolation


def test_additive_interpolation_hand_computed() -> None:
    t = CostTable.from_dict(ADD)
    # alpha: [1 -> 0, 4 -> 0.003, 8 -> 0.005]; theta: [2 -> 0, 10 -> 0.004, 30 -> 0.024]
    cases = {
        (1, 1): 0.01 + 0.0 + 0.0,  # M = 2, both at their first probe
        (1, 0): 0.01 + 0.0 + 0.0,  # M = 1 is below m_probes: clamped to theta(2) = 0
        (2, 4): 0.01 + 0.001 + 0.002,  # alpha 1/3 of the way, theta(6) half way
        (4, 6): 0.01 + 0.003 + 0.004,  # exactly at probes
        (6, 14): 0.01 + 0.004 + 0.014,  # alpha(6) = 0.004, theta(20) = 0.014
        (8, 22): 0.01 + 0.005 + 0.024,  # M = 30 top probe
        (20, 100): 0.01 + 0.005 + 0.024,  # both clamped above the range
    }
    for (bs, k), want in cases.items():
        assert t.step_seconds(bs, k) == pytest.approx(want, rel=1e-12, abs=1e-15), (bs, k)
    vec = t.predicted_step_seconds(2, np.arange(0, 40))
    assert vec == pytest.approx([t.step_seconds(2, k) for k in range(40)], rel=0, abs=0)
    assert t.alpha_at(0.5) == 0.0 and t.alpha_at(100) == 0.005
    assert float(t.theta_at(31.0)) == pytest.approx(0.024, rel=1e-15)


def test_additive_single_probe_is_constant() -> None:
    t = AdditiveCostTable(0.25, (3,), (0.5,), (7,), (0.125,))
    for bs, k in [(1, 0), (3, 4), (50, 500)]:
        assert t.step_seconds(bs, k) == 0.875


def test_steps_per_sec_is_a_floor_lookup_clamped() -> None:
    t = CostTable.from_dict(SPS)
    assert isinstance(t, StepsPerSecTable)
    expect = {1: 50.0, 5: 50.0, 6: 50.0, 11: 50.0, 12: 45.5, 23: 45.5, 24: 30.25, 47: 30.25,
              48: 12.0, 500: 12.0}  # fmt: skip
    for n, sps in expect.items():
        assert t.steps_per_sec(n) == sps, n
        assert t.step_seconds(2, n - 2) == 1.0 / sps
    assert t.objective(4, np.array([4.0, 5.0, 6.0])).tolist() == [200.0, 250.0, 300.0]
    assert t.objective(10, np.array([10.0, 11.0, 12.0])).tolist() == [500.0, 550.0, 546.0]


def test_additive_objective_is_tau_over_step_time() -> None:
    t = CostTable.from_dict(ADD)
    tau = np.array([3.0, 3.5, 3.9])
    got = t.objective(3, tau)
    want = [tau[k] / t.step_seconds(3, k) for k in range(3)]
    assert got.tolist() == want


# --------------------------------------------------------------------------- fit


def _true_time(bs: int, m: int) -> float:
    return 0.004 + 0.0005 * math.sqrt(bs) + 2e-5 * m + 1e-7 * m * m


def test_fit_additive_recovers_an_additive_model() -> None:
    rng = np.random.default_rng(3)
    samples = []
    for bs in (1, 2, 4, 8):
        for k in range(0, 5 * bs + 1, max(1, bs)):
            for _ in range(3):
                samples.append((bs, k, _true_time(bs, bs + k)))
            samples.append((bs, k, 10 * _true_time(bs, bs + k)))  # outlier: median ignores it
    rng.shuffle(samples)
    t = fit_additive(samples)
    assert t.bs_probes == (1, 2, 4, 8)
    assert t.alpha_seconds[0] == 0.0 and t.theta_seconds[0] == 0.0
    assert 1 in t.m_probes and 48 in t.m_probes
    for bs, k, _ in samples:
        # the true model is additive in (bs, M), so every probed cell is reproduced
        assert t.step_seconds(bs, k) == pytest.approx(_true_time(bs, bs + k), rel=1e-9)
    assert CostTable.from_dict(t.to_dict()) == t


def test_fit_additive_bins_m() -> None:
    samples = [(bs, k, 0.01 + 0.001 * bs + 1e-4 * (bs + k)) for bs in (1, 2) for k in range(0, 9)]
    t = fit_additive(samples, m_bin=4)
    assert all(m % 4 == 0 for m in t.m_probes)


def test_fit_additive_errors() -> None:
    with pytest.raises(CostTableError, match="no samples"):
        fit_additive([])
    with pytest.raises(CostTableError, match="bad sample"):
        fit_additive([(1, 0, float("nan"))])
    with pytest.raises(CostTableError, match="bias_seconds"):
        # a strong (bs x M) interaction: the additive intercept comes out negative
        fit_additive([(1, 1, 0.001), (1, 2, 1.0), (2, 0, 1.0), (2, 1, 3.0)])


@pytest.mark.parametrize(
    ("alpha", "theta", "where"),
    [
        ([0.0, -0.02], [0.0, 0.001], "T(bs=16, K=0)"),  # alpha sinks below the bias
        ([0.0, 0.0], [0.0, -0.02], "T(bs=1, K=63)"),  # theta does at large M
    ],
)
def test_tables_predicting_a_negative_step_time_are_refused(
    tmp_path: Path, alpha: list, theta: list, where: str
) -> None:
    data = {
        "bias_seconds": 0.01,
        "bs_probes": [1, 16],
        "alpha_seconds": alpha,
        "m_probes": [1, 64],
        "theta_seconds": theta,
    }
    path = _write(tmp_path, json.dumps(data))
    with pytest.raises(CostTableError, match=rf"{path}.*{re.escape(where)}.* is not > 0"):
        CostTable.load(path)


def test_negative_terms_that_keep_every_step_time_positive_are_kept() -> None:
    # theta < 0 only at M = 0, which no step reaches (M = bs + K >= 1)
    table = AdditiveCostTable(0.5, (1,), (0.0,), (0, 1024), (-0.5, 511.5))
    assert table.step_seconds(1, 0) > 0
    shipped = Path(__file__).resolve().parents[1] / "runtime/cost_tables/smollm2_cpu.json"
    assert CostTable.load(shipped).step_seconds(16, 80) > 0


def test_huge_integers_and_nesting_are_clear_errors(tmp_path: Path) -> None:
    cases = (
        (
            '{"sample_batch_tokens": [1, 1' + "0" * 30 + '], "sample_steps_per_sec": [1, 2], '
            '"max_batch_tokens": 4}',
            "outside 0..",
        ),
        (
            '{"bias_seconds": 1, "bs_probes": [1], "alpha_seconds": [1' + "0" * 400 + "], "
            '"m_probes": [1], "theta_seconds": [0]}',
            "beyond",
        ),
        ("[" * 100_000 + "]" * 100_000, "nested deeper"),
        ("1" * 5000, "not valid JSON"),
    )
    for text, needle in cases:
        path = _write(tmp_path, text)
        with pytest.raises(CostTableError, match=needle):
            CostTable.load(path)
    bad = tmp_path / "bin.json"
    bad.write_bytes(b'{"bias_seconds": \xff\xfe}')
    with pytest.raises(CostTableError, match=r"bin\.json: not UTF-8"):
        CostTable.load(bad)


@pytest.mark.parametrize(
    "data, fresh",
    [
        (
            {"bias_seconds": 0.001, "bs_probes": [1, 8], "alpha_seconds": [0.0, 0.002],
             "m_probes": [1, 16, 64], "theta_seconds": [0.0, 0.003, 0.02]},
            lambda t, bs, tau: tau / t.predicted_step_seconds(bs, np.arange(len(tau))),
        ),
        (
            {"sample_batch_tokens": [1, 8, 24], "sample_steps_per_sec": [300.0, 250.0, 90.0],
             "max_batch_tokens": 64},
            lambda t, bs, tau: tau * np.array([t.steps_per_sec(bs + b) for b in range(len(tau))]),
        ),
    ],
    ids=["additive", "steps-per-sec"],
)  # fmt: skip
def test_objective_keeps_one_read_only_curve_per_batch_size_and_matches_uncached(
    data: dict, fresh
) -> None:
    """The planner's curve is kept per (bs, length) for either kind; what ``objective``
    returns equals the kind's formula computed afresh, and the kept curve cannot be
    written through."""
    table = CostTable.from_dict(data)
    tau = 4 + np.cumsum(np.linspace(1.0, 0.1, 21))
    first = table.objective(4, tau)
    again = table.objective(4, tau * 2)
    assert np.array_equal(first, fresh(table, 4, tau))
    assert np.array_equal(again, fresh(table, 4, tau * 2))
    curve = table._kept_curve(4, 21)
    assert curve is table._kept_curve(4, 21)
    with pytest.raises(ValueError):
        curve[0] = 1.0
    assert not np.array_equal(table.objective(5, tau), first)  # another batch, another curve
    assert table == CostTable.from_dict(table.to_dict())  # the cache is not part of equality
