"""The estimator on real engine records: compact alone recovers the companion's ceiling."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_obs.analytics import estimate_blocks, pair_companion, validate_estimator
from tests.test_engine_loop import _models, _requests, _run, _trimming_table


def _pair(temperature: float, seed: int):
    target, drafter = _models(seed)
    reqs = _requests(8, seed=seed, temperature=temperature)
    table = _trimming_table()
    _, compact = _run(target, drafter, "compact", reqs, 4, table, "c")
    _, cap = _run(target, drafter, "cap-accept", reqs, 4, table, "c-cap")
    return compact, cap


def test_greedy_estimate_from_compact_alone_equals_companion_truth() -> None:
    compact, cap = _pair(0.0, 5)
    rs = compact.table("req_steps").to_pandas()
    req = compact.table("requests").to_pandas()
    est = estimate_blocks(rs, req, gamma=5)
    assert est.problems.empty if hasattr(est.problems, "empty") else not est.problems
    blocks = est.blocks.sort_values(["rid", "forward_ct"]).reset_index(drop=True)
    truth = cap.table("req_steps").to_pandas().sort_values(["rid", "forward_ct"])
    truth = truth.reset_index(drop=True)
    assert len(blocks) == len(truth)
    exact = blocks.greedy_exact.to_numpy(bool)
    assert exact.mean() > 0.8
    # DESIGN's ceiling: acc_len + cap_trim (a cut final step counts what it committed).
    ceiling = (truth.acc_len + truth.cap_trim).to_numpy()
    assert np.array_equal(blocks.greedy_ceiling.to_numpy()[exact], ceiling[exact])
    # Where not exact (the request ended first), the truth lies inside the greedy bounds.
    lo, hi = blocks.greedy_lo.to_numpy(), blocks.greedy_hi.to_numpy()
    assert np.all((lo[~exact] <= ceiling[~exact]) & (ceiling[~exact] <= hi[~exact]))


def test_companion_pairs_identically_and_bracket_holds_truth_under_sampling() -> None:
    compact, cap = _pair(1.0, 6)
    pair = pair_companion(
        compact.table("req_steps"),
        cap.table("req_steps"),
        compact.table("requests"),
        cap.table("requests"),
        greedy=True,
    )
    assert pair.identical, pair.message
    est = estimate_blocks(
        compact.table("req_steps").to_pandas(), compact.table("requests").to_pandas(), gamma=5
    )
    val = validate_estimator(est, pair, n_boot=50)
    assert len(val) >= 1
    assert bool(val.filter(like="inside").all(axis=None)), val.T


# ------------------------------------------------------------ truncated sampling (issue 8.1)


def _sampled_pair(seed: int, config: dict | None = None, **sampling):
    from dataclasses import replace

    from dspark_obs.engine.loop import Engine
    from dspark_obs.engine.types import EngineConfig
    from dspark_obs.fanout import FanOut, MemorySink

    target, drafter = _models(seed)
    reqs = [replace(r, **sampling) for r in _requests(8, seed=seed, temperature=1.0)]
    sinks = []
    for mode, run_id in (("compact", "c"), ("cap-accept", "c-cap")):
        sink = MemorySink()
        fan = FanOut([sink])
        cfg = EngineConfig(
            mode=mode, gamma=5, max_batch=4, cost_table=_trimming_table(), **(config or {})
        )
        Engine(target, drafter, cfg).run(reqs, fan.emit, run_id)
        assert fan.errors == []
        sinks.append(sink)
    return sinks


def _validated(compact, cap):
    pair = pair_companion(
        compact.table("req_steps"),
        cap.table("req_steps"),
        compact.table("requests"),
        cap.table("requests"),
        greedy=True,
    )
    assert pair.identical, pair.message
    est = estimate_blocks(
        compact.table("req_steps").to_pandas(), compact.table("requests").to_pandas(), gamma=5
    )
    assert not est.problems
    return est, validate_estimator(est, pair, n_boot=50).iloc[0]


def _companion_full(cap) -> dict[tuple[str, int], int]:
    k = cap.table("req_steps").to_pandas()
    return {(r.rid, r.forward_ct): r.correct_drafts + r.cap_trim for r in k.itertuples()}


def test_estimator_is_exact_under_top_k_and_top_p_as_under_pure_temperature() -> None:
    """top_k=1 / top_p=0.9 rows: point within the tolerance of pure-temperature rows, truth
    inside [lo, hi] just as often (log p of the processed target distribution is recorded)."""
    from dspark_obs.analytics.estimator_recorder import TARGET_LOGPROB_FLOOR

    results = {}
    for label, sampling in (("pure", {}), ("top_k=1", {"top_k": 1}), ("top_p=0.9", {"top_p": 0.9})):
        for seed in (6, 7):
            compact, cap = _sampled_pair(seed, **sampling)
            est, val = _validated(compact, cap)
            results[(label, seed)] = val
            if label == "pure":
                continue
            # A draft the filter removed from the target's distribution is never accepted:
            # it is stored at the floor (a_k = 0), and the companion indeed rejected it.
            full = _companion_full(cap)
            outside = 0
            for row in compact.table("req_steps").to_pylist():
                for e in row["pg"] or []:
                    if e["target_logprob"] <= TARGET_LOGPROB_FLOOR:
                        outside += 1
                        assert full[(row["rid"], e["src_fct"])] < e["k"], e
            assert outside > 0, label
            if label == "top_k=1":  # every a_k is 0 or 1: the bracket is the truth itself
                b = est.blocks[est.blocks.category.isin(["resolved", "diverged"])]
                assert len(b) > 20
                truth = {k: v + 1 for k, v in full.items()}
                assert np.allclose(
                    b.lo, [truth[(r, f)] for r, f in zip(b.rid, b.forward_ct, strict=True)]
                )
    pure_err = max(results[("pure", s)].point_pct_err for s in (6, 7))
    for (label, seed), val in results.items():
        assert bool(val.inside_bracket), (label, seed, val)
        assert bool(val.interval_covers) and bool(val.pred_interval_covers), (label, seed)
        # within the estimator's 2% goal (issue 21), or as close as pure-temperature rows are
        # (the tail model is fit per run, so errors differ a little from run to run)
        limit = max(pure_err + 0.5, 2.0)
        assert val.point_pct_err <= limit, (label, seed, val.point_pct_err, pure_err)


def test_sglang_parity_switch_skips_greedy_and_truncated_rows() -> None:
    from dspark_obs.analytics.estimator import sglang_skipped_rows

    compact, _ = _sampled_pair(6, {"estimator_rows": "sglang"}, top_p=0.9)
    rs = compact.table("req_steps").to_pandas()
    assert rs.trimmed_tokens.isna().all() and rs.q_lp.isna().all() and rs.pg.isna().all()
    assert sglang_skipped_rows(rs).all()
    assert len(estimate_blocks(rs, gamma=5, rows_from="sglang").blocks) == 0
    # pure-temperature rows are recorded exactly as without the switch
    parity, _ = _sampled_pair(6, {"estimator_rows": "sglang"})
    exact, _ = _sampled_pair(6)
    a = parity.table("req_steps").to_pandas()
    b = exact.table("req_steps").to_pandas()
    assert a.trimmed_tokens.notna().sum() > 0
    for col in ("trimmed_tokens", "q_lp", "pg"):
        assert a[col].astype(str).tolist() == b[col].astype(str).tolist(), col
    assert not sglang_skipped_rows(a).any()


# ------------------------------------------------ one run gives both sides (issue 21's sweep)


def _sweep_module():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_estimator_sweep.py"
    spec = importlib.util.spec_from_file_location("bench_estimator_sweep", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_estimator_sweep", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("temperature", "sampling"), [(0.0, {}), (1.0, {}), (0.7, {"top_p": 0.9}), (1.0, {"top_k": 3})]
)
def test_sweep_companion_rows_are_the_compact_rows_plus_cap_trim(temperature, sampling) -> None:
    """bench_estimator_sweep runs only the cap-accept companion with compact's estimator
    fields switched on; that is sound only if those rows equal a compact run's, field for
    field, under a forced budget (the sweep's trimming), for every sampling setting."""
    from dataclasses import replace

    from dspark_obs.engine.loop import Engine
    from dspark_obs.engine.types import EngineConfig
    from dspark_obs.fanout import FanOut, MemorySink

    sweep = _sweep_module()
    target, drafter = _models(11)
    reqs = [
        replace(r, temperature=temperature, **sampling)
        for r in _requests(6, seed=11, temperature=temperature)
    ]
    tables = {}
    for mode, cls in (("compact", Engine), ("cap-accept", sweep.companion_engine_class())):
        sink = MemorySink()
        fan = FanOut([sink])
        eng = cls(target, drafter, EngineConfig(mode=mode, gamma=5, max_batch=3, overlap=False))
        eng.scheduler.forced_budget_frac = 0.4
        eng.run(reqs, fan.emit, "run")
        assert fan.errors == []
        tables[mode] = sink.table("req_steps").to_pandas().sort_values(["rid", "forward_ct"])
    compact, cap = (t.reset_index(drop=True) for t in (tables["compact"], tables["cap-accept"]))
    fields = ["rid", "forward_ct", "prefix_len", "verify_len", "acc_len", "correct_drafts",
              "bonus_token", "draft_tokens", "confidence", "trimmed_tokens", "q_lp",
              "pg"]  # fmt: skip

    def norm(v):
        if v is None or (isinstance(v, float) and np.isnan(v)):
            return None
        return v.tolist() if hasattr(v, "tolist") else v

    for f in fields:
        assert [norm(v) for v in compact[f]] == [norm(v) for v in cap[f]], f
    censored = compact["trimmed_tokens"].notna()
    assert censored.any()  # the forced budget really trims
    assert (compact["cap_trim"] == 0).all() and (cap["cap_trim"] >= 0).all()
    assert censored[cap["cap_trim"] > 0].all()  # a hidden accept needs a fully accepted window


# ------------------------------------------------ one block-accept recorder (issue 22)


@pytest.mark.parametrize(("temperature", "sampling"), [(1.0, {}), (0.0, {}), (0.7, {"top_p": 0.9})])
def test_engine_rows_equal_what_block_accept_recorder_writes(temperature, sampling) -> None:
    """The engine's decode loop and :class:`BlockAcceptRecorder` (what any other producer
    uses) must write the same estimator fields for the same steps: fed the engine's own
    per-step facts, the recorder gives back the engine's trimmed_tokens, q_lp and pg."""
    from dataclasses import replace

    from dspark_obs.analytics.estimator_recorder import BlockAcceptRecorder
    from dspark_obs.engine.loop import Engine
    from dspark_obs.engine.types import EngineConfig
    from dspark_obs.fanout import FanOut, MemorySink

    target, drafter = _models(12)
    reqs = [
        replace(r, temperature=temperature, **sampling)
        for r in _requests(6, seed=12, temperature=temperature)
    ]
    sink = MemorySink()
    fan = FanOut([sink])
    eng = Engine(target, drafter, EngineConfig(mode="compact", gamma=5, max_batch=3, overlap=False))
    eng.scheduler.forced_budget_frac = 0.4
    eng.run(reqs, fan.emit, "run")
    assert fan.errors == []
    rows = sink.table("req_steps").to_pylist()
    rows.sort(key=lambda r: (r["rid"], r["forward_ct"]))
    anchor_of = {(r["rid"], r["forward_ct"]): r["prefix_len"] - 1 for r in rows}
    rec = BlockAcceptRecorder(5)
    n_pg = 0
    for r in rows:
        # log p the engine stored for this step's resolutions, at (row, token): draft k of a
        # block opened at anchor a sits at a + k, and row i predicts this anchor + 1 + i; the
        # recorder must ask exactly for those (a KeyError is a row the engine never read)
        here = r["prefix_len"] - 1
        logp = {
            (anchor_of[(r["rid"], e["src_fct"])] + e["k"] - here - 1, e["draft_token"]): e[
                "target_logprob"
            ]
            for e in r["pg"] or []
        }
        w = r["verify_len"] - 1
        q = [float("nan")] * w + list(r["q_lp"] or [])
        got = rec.observe(
            r["rid"], r["forward_ct"], r["prefix_len"], r["verify_len"], r["correct_drafts"],
            r["draft_tokens"], q, r["bonus_token"], lambda i, tok, lp=logp: lp[(i, tok)],
        )  # fmt: skip
        assert got["trimmed_tokens"] == r["trimmed_tokens"], r
        assert got["q_lp"] == (None if r["q_lp"] is None else pytest.approx(r["q_lp"])), r
        want = r["pg"] or None
        if want is not None:
            want = [{**e, "target_logprob": pytest.approx(e["target_logprob"])} for e in want]
            n_pg += len(want)
        assert got["pg"] == want, r
        if r["is_last"]:
            rec.finish(r["rid"], natural_stop=False)
    assert n_pg > 0  # the forced budget censored blocks that later steps resolved
