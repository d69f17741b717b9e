"""STS: SGLang's fitter (loop twin), JSON and shard formats, held-out improvement."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dspark_obs.analytics import (
    apply_sts,
    fit_sts,
    fit_sts_heldout,
    load_sts_shards,
    logit,
    position_ece,
    save_sts_shard,
    sts_data_from_req_steps,
    temperature_grid,
)
from dspark_obs.analytics.sts import StsData
from dspark_obs.sts_file import StsCalibration, StsFileError
from dspark_obs.testing.synthetic import simulate_pair


def loop_ece(p, y, n_bins=15):
    count, ps, ys = [0] * n_bins, [0.0] * n_bins, [0.0] * n_bins
    for pi, yi in zip(p, y, strict=True):
        pc = min(max(float(pi), 1e-8), 1 - 1e-8)
        b = min(int(math.floor(pc * n_bins)), n_bins - 1)
        count[b] += 1
        ps[b] += pc
        ys[b] += float(yi)
    n = sum(count)
    if n == 0:
        return float("nan")
    return (
        sum(abs(ps[b] / count[b] - ys[b] / count[b]) * count[b] for b in range(n_bins) if count[b])
        / n
    )


def loop_fit(z, y, grid, n_bins=15):
    """Straight reading of the fitter: position by position, strict improvement wins."""
    n, g = len(z), len(z[0])
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    fitted = [1.0] * n
    raw = [1.0] * n
    temps, before, after = [], [], []
    for k in range(g):
        raw = [raw[i] * sig(z[i][k]) for i in range(n)]
        labels = [y[i][k] for i in range(n)]
        before.append(loop_ece(raw, labels, n_bins))
        best = None
        for t in grid:
            cand = [fitted[i] * sig(z[i][k] / t) for i in range(n)]
            e = loop_ece(cand, labels, n_bins)
            if best is None or e < best[0]:
                best = (e, t, cand)
        temps.append(best[1])
        after.append(best[0])
        fitted = best[2]
    return temps, before, after


def miscalibrated(n, gamma, seed, scale=3.0):
    """True logits u; labels: prefix products of Bernoulli(sigmoid(u)); returns z = scale * u."""
    rng = np.random.default_rng(seed)
    u = rng.normal(1.0, 1.2, size=(n, gamma))
    acc = rng.random((n, gamma)) < 1 / (1 + np.exp(-u))
    prefix = np.cumprod(acc, axis=1).astype(float)
    return scale * u, prefix


def test_grid_is_sglangs_float32_logspace():
    g = temperature_grid()
    assert g.size == 41
    assert g[0] == float(np.float32(0.1)) and g[0] != 0.1
    assert g[-1] == pytest.approx(10.0, rel=1e-6)
    assert g[20] == pytest.approx(1.0, rel=1e-6)
    assert np.allclose(np.diff(np.log10(g)), 0.05, atol=1e-6)


def test_fit_matches_loop_twin_exactly():
    z, y = miscalibrated(150, 4, seed=1, scale=2.5)
    grid = temperature_grid()
    cal = fit_sts(z, y)
    temps, before, after = loop_fit(z.tolist(), y.tolist(), grid.tolist())
    assert cal.temperatures == temps
    assert cal.ece_before == pytest.approx(before, abs=1e-12)
    assert cal.ece_after == pytest.approx(after, abs=1e-12)
    assert cal.num_samples == 150


def test_fit_lowers_ece_on_overconfident_data_and_recovers_scale():
    z, y = miscalibrated(4000, 5, seed=2, scale=3.0)
    cal = fit_sts(z, y)
    assert all(a < b for a, b in zip(cal.ece_after, cal.ece_before, strict=True))
    assert cal.temperatures[0] == pytest.approx(3.0, rel=0.3)
    # judged on fresh data from the same process
    z2, y2 = miscalibrated(4000, 5, seed=3, scale=3.0)
    before = position_ece(z2, y2)
    after = position_ece(z2, y2, cal.temperatures)
    assert (after < before).all()


def test_observed_mask_ignores_unobserved_positions():
    z, y = miscalibrated(600, 3, seed=4)
    obs = np.ones_like(y, dtype=bool)
    obs[:300, 2] = False
    y_bad = y.copy()
    y_bad[:300, 2] = 0.0  # what a naive reader of compact data would store
    masked = fit_sts(z, y_bad, observed=obs)
    assert masked.temperatures == fit_sts(z, y, observed=obs).temperatures
    # with no mask the result is SGLang's (all rows count)
    assert fit_sts(z, y).temperatures == fit_sts(z, y, observed=np.ones_like(obs)).temperatures
    # a position with no observed sample keeps T = 1
    obs2 = obs.copy()
    obs2[:, 1] = False
    cal = fit_sts(z, y, observed=obs2)
    assert cal.temperatures[1] == 1.0 and math.isnan(cal.ece_after[1])


def test_apply_sts_and_logit():
    c = apply_sts(np.array([[0.0, 2.0]]), [1.0, 2.0])
    assert c[0].tolist() == pytest.approx([0.5, 1 / (1 + math.exp(-1.0))])
    assert np.isfinite(logit(np.array([0.0, 1.0]))).all()
    with pytest.raises(ValueError, match="positions"):
        apply_sts(np.zeros((2, 3)), [1.0, 1.0])
    with pytest.raises(ValueError, match="> 0"):
        apply_sts(np.zeros((2, 2)), [1.0, 0.0])


# ---------------------------------------------------------------- JSON


def test_json_round_trip(tmp_path):
    cal = StsCalibration([0.5, 1.25, 3.0], "shards/*.pt", 1234, [0.1, 0.2, 0.3], [0.01, 0.02, 0.03])
    path = tmp_path / "sts.json"
    cal.save(path)
    raw = json.loads(path.read_text())
    assert set(raw) == {"temperatures", "dataset", "num_samples", "ece_before", "ece_after"}
    assert isinstance(raw["num_samples"], int)
    back = StsCalibration.load(path, gamma=3)
    assert back == cal
    # SGLang writes only what differs from defaults; its minimal file must load
    minimal = tmp_path / "min.json"
    minimal.write_text('{"temperatures": [1, 2.5]}')
    assert StsCalibration.load(minimal).temperatures == [1.0, 2.5]


def test_json_with_nan_ece_stays_loadable_by_sglang():
    cal = StsCalibration([1.0, 2.0], ece_before=[0.1, float("nan")], ece_after=[0.05, 0.02])
    d = json.loads(cal.to_json())
    assert "ece_before" not in d and d["ece_after"] == [0.05, 0.02]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"dataset": "x"}', "missing required key 'temperatures'"),
        ('{"temperatures": []}', "non-empty"),
        ('{"temperatures": [1.0, 0.0]}', r"temperatures\[1\] = 0.0 must be finite and > 0"),
        ('{"temperatures": [1.0, -2]}', r"temperatures\[1\]"),
        ('{"temperatures": [1.0, "2"]}', "is not a number"),
        ('{"temperatures": [true]}', "is not a number"),
        ('{"temperatures": [NaN]}', "finite"),
        ('{"temperatures": [1.0], "num_samples": -1}', "num_samples"),
        ('{"temperatures": [1.0], "num_samples": 1.5}', "num_samples"),
        (
            '{"temperatures": [1.0, 2.0], "ece_after": [0.1]}',
            "'ece_after' has 1 values but there are 2",
        ),
        ('{"temperatures": [1.0], "ece_before": "x"}', "'ece_before' must be a list"),
        ('{"temperatures": [1.0], "dataset": 3}', "'dataset' must be a string"),
    ],
)
def test_json_errors_name_file_and_problem(tmp_path, text, problem):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(StsFileError, match=problem) as exc:
        StsCalibration.load(path)
    assert str(path) in str(exc.value)


def test_json_gamma_and_missing_file(tmp_path):
    path = tmp_path / "sts.json"
    StsCalibration([1.0, 2.0]).save(path)
    with pytest.raises(StsFileError, match="has 2 temperatures but gamma is 5"):
        StsCalibration.load(path, gamma=5)
    with pytest.raises(StsFileError, match="cannot read"):
        StsCalibration.load(tmp_path / "nope.json")


# ---------------------------------------------------------------- shards


def test_shards_round_trip_and_errors(tmp_path):
    z, y = miscalibrated(50, 4, seed=5)
    save_sts_shard(tmp_path / "col.0.pt", z[:30], y[:30])
    save_sts_shard(tmp_path / "col.1.pt", z[30:], y[30:])
    data = load_sts_shards(str(tmp_path / "col.*.pt"))
    assert data.logits.shape == (50, 4)
    assert np.allclose(data.logits, z.astype(np.float32))
    assert np.array_equal(data.prefix_mask, y)
    save_sts_shard(tmp_path / "col.2.pt", z[:5, :3], y[:5, :3])
    with pytest.raises(StsFileError, match=r"col\.2\.pt: gamma 3 disagrees"):
        load_sts_shards(str(tmp_path / "col.*.pt"))
    (tmp_path / "junk.0.pt").write_bytes(b"not a torch file")
    with pytest.raises(StsFileError, match="junk.0.pt: cannot load"):
        load_sts_shards([tmp_path / "junk.0.pt"])
    with pytest.raises(StsFileError, match="no STS shard matched"):
        load_sts_shards(str(tmp_path / "none.*.pt"))


# ---------------------------------------------------------------- from req_steps, held-out


def test_from_req_steps_and_heldout():
    sim = simulate_pair(n_requests=30, seed=4, temperature=0.0)
    data = sts_data_from_req_steps(sim.compact_req_steps, mode="compact")
    assert data.logits.shape[1] == 5 and len(data.request) == len(data.logits)
    # censored positions are unobserved, and labels there carry no rejection
    assert (~data.observed).any()
    ho = fit_sts_heldout(data, heldout_frac=0.3, seed=0)
    assert ho.fit_requests + ho.heldout_requests == 30
    assert len(ho.ece_after) == 5
    assert set(ho.by_workload["workload"]) <= {"math", "chat", "poetry"}


def test_heldout_improves_on_synthetic_requests():
    z, y = miscalibrated(3000, 4, seed=6, scale=3.0)
    req = np.array([f"r{i // 10}" for i in range(3000)])
    ho = fit_sts_heldout(StsData(z, y, np.ones_like(y, dtype=bool), req), heldout_frac=0.3, seed=1)
    assert ho.heldout_requests == 90
    assert ho.pooled_after < ho.pooled_before


def test_ties_keep_the_first_temperature_like_sglang():
    # every candidate T < 2.7 drives the survival into the clamp: equal ECE, the first wins
    cal = fit_sts(np.full((10, 1), 50.0), np.ones((10, 1)))
    assert cal.temperatures[0] == temperature_grid()[0]
