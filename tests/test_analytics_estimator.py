"""Block-accept estimator: SGLang parity, greedy exactness, JSONL parsing, validation."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pandas as pd
import pytest

from dspark_obs.analytics import (
    BlockAcceptRecorder,
    coverage,
    estimate_blocks,
    exact_greedy_ceiling,
    pair_companion,
    parse_estimator_lines,
    read_estimator_jsonl,
    summarize_blocks,
    validate_estimator,
)
from dspark_obs.analytics._frames import bootstrap_indices
from dspark_obs.analytics.estimator import chain_survival, sample_ceilings
from dspark_obs.testing.synthetic import simulate_pair

# ---------------------------------------------------------------- SGLang's recorder, re-read


class OnlineReference:
    """SGLang 0.5.23's online block-accept bookkeeping, transcribed in the test's own words.

    Per step and request: a window fully accepted below gamma opens a pending block;
    pending blocks walk their offsets over this step's committed rows (row = anchor +
    offset - prefix_len <= cl), each walk step logging [src_fct, k, p_lp, draft, realized]
    and multiplying a = min(1, exp(p_lp - q_lp)) into the running product; the walk stops
    after a mismatch. Finalization adds (lo, hi) per block: exact rows at once, blocks when
    diverged / fully resolved / dropped on a prefix jump / the request finishes.
    """

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma
        self.states: dict[str, dict] = {}
        self.lines: list[str] = []
        self.final: dict[tuple[str, int], tuple[float, float]] = {}

    def step(self, fct, rid, prefix_len, w, cl, drafts, q_all, bonus, p_at, ct=0):
        g = self.gamma
        st = self.states.setdefault(rid, {"expect": -1, "pending": []})
        if st["expect"] >= 0 and prefix_len != st["expect"]:
            for b in st["pending"]:
                self._at_end(rid, b)
            st["pending"] = []
        st["expect"] = prefix_len + cl + 1
        rec = {"rid": rid, "fct": fct, "w": w, "cl": cl, "ct": ct}
        if cl == w and w < g:
            blk = {
                "fct": fct,
                "anchor": prefix_len - 1,
                "w": w,
                "tok": drafts[w:g],
                "q": q_all[w:g],
                "next": w + 1,
                "prod": 1.0,
                "extra": 0.0,
            }
            st["pending"].append(blk)
            rec["trimmed_tokens"] = blk["tok"]
            rec["q_lp"] = blk["q"]
        else:
            self.final[(rid, fct)] = (cl + 1.0, cl + 1.0)
        realized = drafts[:cl] + [bonus]
        pg, keep = [], []
        for b in st["pending"]:
            div = False
            while b["next"] <= g:
                row = b["anchor"] + b["next"] - prefix_len
                if row > cl:
                    break
                tok = b["tok"][b["next"] - b["w"] - 1]
                lp = p_at(row, tok)
                pg.append([b["fct"], b["next"], lp, tok, realized[row]])
                b["prod"] *= min(1.0, math.exp(lp - b["q"][b["next"] - b["w"] - 1]))
                b["extra"] += b["prod"]
                b["next"] += 1
                if realized[row] != tok:
                    div = True
                    break
            if not div and b["next"] <= g:
                keep.append(b)
                continue
            lo = b["w"] + 1.0 + b["extra"]
            last = b["next"] - 1
            tail = b["prod"] * (g - last) if div and last < g else 0.0
            self.final[(rid, b["fct"])] = (lo, lo + tail)
        st["pending"] = keep
        if pg:
            rec["pg"] = pg
        self.lines.append(json.dumps(rec))

    def _at_end(self, rid, b):
        lo = b["w"] + 1.0 + b["extra"]
        self.final[(rid, b["fct"])] = (lo, lo + b["prod"] * (self.gamma - b["next"] + 1))

    def finish(self, rid, natural_stop):
        st = self.states.pop(rid, None)
        if st is None:
            return
        for b in st["pending"]:
            if natural_stop:
                lo = b["w"] + 1.0 + b["extra"]
                self.final[(rid, b["fct"])] = (lo, lo)
            else:
                self._at_end(rid, b)
        if natural_stop and st["pending"]:
            self.lines.append(
                json.dumps({"rid": rid, "eos_end": [b["fct"] for b in st["pending"]]})
            )


def table_lp(values):
    """p_at(row, token) from a dict {(row, token): lp}, default -0.5."""
    return lambda row, tok: values.get((row, tok), -0.5)


def run_offline(ref):
    frame, errors = parse_estimator_lines(ref.lines, gamma=ref.gamma)
    assert errors == []
    est = estimate_blocks(frame, tail="none")
    return est, {(r.rid, r.forward_ct): r for r in est.blocks.itertuples()}


# ---------------------------------------------------------------- crafted sequences


def test_crafted_cases_match_sglang_line_by_line():
    g = 4
    ref = OnlineReference(g)
    q = [-1.0, -0.2, -0.7, -0.4]
    # exact: rejection inside the window (w=3, cl=1)
    ref.step(1, "ex", 10, 3, 1, [5, 6, 7, 8], q, 9, table_lp({}))
    # full block verified (w == gamma)
    ref.step(1, "full", 10, 4, 4, [5, 6, 7, 8], q, 9, table_lp({}))
    # resolved: w=1, cl=1; own bonus resolves k=2 (row 1), next step k=3,4 (rows 0,1)
    ref.step(1, "res", 10, 1, 1, [5, 6, 7, 8], q, 6, table_lp({(1, 6): -0.1}))
    ref.step(2, "res", 12, 2, 1, [7, 1, 2, 3], q, 8, table_lp({(0, 7): -0.9, (1, 8): 0.0}))
    # diverged at k=3 (realized 4 != draft 7): tail = P * (4 - 3)
    ref.step(1, "div", 10, 1, 1, [5, 6, 7, 8], q, 6, table_lp({(1, 6): -0.3}))
    ref.step(2, "div", 12, 2, 0, [1, 1, 1, 1], q, 4, table_lp({(0, 7): -2.0}))
    # diverged on its own bonus at k = w+1 = gamma: tail 0
    ref.step(1, "divg", 10, 3, 3, [5, 6, 7, 8], q, 2, table_lp({(3, 8): -0.05}))
    # at_end: request stops on the length limit with the block pending
    ref.step(1, "end", 10, 0, 0, [5, 6, 7, 8], q, 5, table_lp({(0, 5): -1.5}))
    ref.finish("end", natural_stop=False)
    # eos: natural stop with the block pending -> tail 0 and an eos_end marker
    ref.step(1, "eos", 10, 2, 2, [5, 6, 7, 8], q, 7, table_lp({(2, 7): -0.25}))
    ref.finish("eos", natural_stop=True)
    # two pending blocks resolved in one step, and a prefix jump that drops one (at_end)
    ref.step(1, "two", 20, 1, 1, [1, 2, 3, 4], q, 2, table_lp({}))
    ref.step(2, "two", 22, 0, 0, [3, 4, 9, 9], q, 3, table_lp({(0, 3): -0.6}))
    ref.step(3, "two", 23, 1, 0, [5, 5, 5, 5], q, 4, table_lp({(0, 4): -0.1}))
    ref.step(4, "two", 40, 1, 0, [1, 1, 1, 1], q, 1, table_lp({}))
    ref.finish("two", natural_stop=False)

    two_step2 = next(json.loads(x) for x in ref.lines if '"two"' in x and '"fct": 2' in x)
    assert sorted({e[0] for e in two_step2["pg"]}) == [1, 2]  # two blocks settled in one step
    est, blocks = run_offline(ref)
    expect_cat = {
        ("ex", 1): "exact_in_window",
        ("full", 1): "exact_in_window",
        ("res", 1): "resolved",
        ("res", 2): "exact_in_window",
        ("div", 1): "diverged",
        ("divg", 1): "diverged",
        ("end", 1): "at_end",
        ("eos", 1): "eos",
        ("two", 1): "resolved",
        ("two", 2): "at_end",
        ("two", 3): "exact_in_window",
        ("two", 4): "exact_in_window",
    }
    for key, cat in expect_cat.items():
        assert blocks[key].category == cat, key
    assert set(ref.final) == set(blocks)
    for key, (lo, hi) in ref.final.items():
        assert blocks[key].lo == lo and blocks[key].hi == hi, key  # exact, not approximate
    # hand values
    a2 = min(1.0, math.exp(-0.1 - -0.2))
    a3 = min(1.0, math.exp(-0.9 - -0.7))
    a4 = min(1.0, math.exp(0.0 - -0.4))
    assert blocks[("res", 1)].lo == pytest.approx(2 + a2 + a2 * a3 + a2 * a3 * a4)
    d2, d3 = min(1.0, math.exp(-0.3 + 0.2)), min(1.0, math.exp(-2.0 + 0.7))
    assert blocks[("div", 1)].hi - blocks[("div", 1)].lo == pytest.approx(d2 * d3 * 1)
    assert blocks[("divg", 1)].hi == blocks[("divg", 1)].lo
    assert blocks[("end", 1)].hi == pytest.approx(
        blocks[("end", 1)].lo + min(1, math.exp(-1.5 + 1.0)) * 3
    )
    assert blocks[("eos", 1)].hi == blocks[("eos", 1)].lo
    assert blocks[("ex", 1)].lo == 2.0 and blocks[("full", 1)].hi == 5.0
    assert est.problems == []


def _random_trajectories(seed, gamma, n_req=25):
    rng = np.random.default_rng(seed)
    ref = OnlineReference(gamma)
    lp_cache: dict = {}
    fct = 0
    for r in range(n_req):
        rid = f"r{r}"
        prefix = int(rng.integers(5, 50))
        for _ in range(int(rng.integers(1, 12))):
            fct += int(rng.integers(1, 3))
            w = int(rng.integers(0, gamma + 1))
            cl = w if rng.random() < 0.5 else int(rng.integers(0, w + 1))
            drafts = [int(t) for t in rng.integers(0, 3, size=gamma)]  # small vocab: matches happen
            q_all = [float(np.float32(x)) for x in rng.uniform(-3, 0, size=gamma)]
            bonus = int(rng.integers(0, 3))

            def p_at(row, tok, f=fct):
                key = (f, row, tok)
                if key not in lp_cache:
                    lp_cache[key] = float(np.float32(rng.uniform(-3.5, 0.0)))
                return lp_cache[key]

            ref.step(
                fct,
                rid,
                prefix,
                w,
                cl,
                drafts,
                q_all,
                bonus,
                p_at,
                ct=int(rng.integers(0, gamma - cl + 1)),
            )
            prefix += cl + 1
            if rng.random() < 0.05:
                prefix += 3  # a discontinuity: SGLang drops pending blocks as at_end
        ref.finish(rid, natural_stop=bool(rng.random() < 0.5))
    return ref


@pytest.mark.parametrize(("seed", "gamma"), [(0, 5), (1, 4), (2, 7)])
def test_random_sequences_match_sglang_bracket_exactly(seed, gamma):
    ref = _random_trajectories(seed, gamma)
    est, blocks = run_offline(ref)
    assert set(ref.final) == set(blocks)
    for key, (lo, hi) in ref.final.items():
        assert (blocks[key].lo, blocks[key].hi) == (lo, hi), key
    cats = est.blocks["category"].value_counts()
    assert {"resolved", "diverged", "at_end", "eos", "exact_in_window"} <= set(cats.index)
    # SGLang's logged "est uncap acc len: mid [lo, hi]" = means over blocks
    summ = summarize_blocks(est.blocks, by=(), n_boot=0).iloc[0]
    lo_mean = np.mean([v[0] for v in ref.final.values()])
    hi_mean = np.mean([v[1] for v in ref.final.values()])
    assert summ["mean_lo"] == pytest.approx(lo_mean, abs=1e-12)
    assert summ["mean_mid"] == pytest.approx(0.5 * (lo_mean + hi_mean), abs=1e-12)


def test_recorder_produces_what_sglang_would_write():
    """The producer helper an engine uses must emit the same records as SGLang's recorder."""
    rng = np.random.default_rng(9)
    g = 5
    ref = OnlineReference(g)
    rec = BlockAcceptRecorder(g)
    lines = []
    fct = 0
    for r in range(15):
        rid, prefix = f"r{r}", 7
        for _ in range(int(rng.integers(1, 10))):
            fct += 1
            w = int(rng.integers(0, g + 1))
            cl = w if rng.random() < 0.6 else int(rng.integers(0, w + 1))
            drafts = [int(t) for t in rng.integers(0, 3, size=g)]
            q_all = [float(x) for x in rng.uniform(-2, 0, size=g)]
            bonus = int(rng.integers(0, 3))
            lps = {
                (row, tok): float(rng.uniform(-2, 0)) for row in range(g + 1) for tok in range(3)
            }
            p_at = table_lp(lps)
            ref.step(fct, rid, prefix, w, cl, drafts, q_all, bonus, p_at)
            out = rec.observe(rid, fct, prefix, w + 1, cl, drafts, q_all, bonus, p_at)
            line = {"rid": rid, "fct": fct, "w": w, "cl": cl, "ct": 0}
            if out["trimmed_tokens"] is not None:
                line["trimmed_tokens"], line["q_lp"] = out["trimmed_tokens"], out["q_lp"]
            if out["pg"]:
                line["pg"] = [
                    [
                        e["src_fct"],
                        e["k"],
                        e["target_logprob"],
                        e["draft_token"],
                        e["realized_token"],
                    ]
                    for e in out["pg"]
                ]
            lines.append(json.dumps(line))
            prefix += cl + 1
        stop = bool(rng.random() < 0.5)
        ref.finish(rid, stop)
        eos = rec.finish(rid, stop)
        if eos:
            lines.append(json.dumps({"rid": rid, "eos_end": eos}))
    assert lines == ref.lines


# ---------------------------------------------------------------- greedy exactness


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_ceiling_equals_cap_accept_truth(seed):
    sim = simulate_pair(n_requests=30, seed=seed, temperature=0.0)
    comp = pair_companion(
        sim.compact_req_steps, sim.cap_req_steps, sim.compact_requests, sim.cap_requests
    )
    assert comp.identical
    est = estimate_blocks(sim.compact_req_steps, sim.compact_requests)
    g = exact_greedy_ceiling(est).merge(comp.steps[["rid", "step", "ceiling"]], on=["rid", "step"])
    assert len(g) == len(sim.cap_req_steps)
    exact = g[g.greedy_exact]
    assert len(exact) >= 0.95 * len(g)
    assert (exact["greedy_ceiling"] == exact["ceiling"]).all()
    rest = g[~g.greedy_exact]
    assert ((rest.greedy_lo <= rest.ceiling) & (rest.ceiling <= rest.greedy_hi)).all()
    assert set(rest["category"]) <= {"at_end", "eos"}
    # SGLang's bracket is exact for resolved/diverged blocks under greedy (a is 0 or 1)
    b = est.blocks.merge(comp.steps[["rid", "step", "ceiling_uncut"]], on=["rid", "step"])
    settled = b[b.category.isin(["resolved", "diverged", "exact_in_window"])]
    assert np.allclose(settled["lo"], settled["ceiling_uncut"], atol=1e-9)
    assert np.allclose(settled["hi"], settled["ceiling_uncut"], atol=1e-9)


def test_greedy_point_and_means_match_truth_when_requests_end_cleanly():
    sim = simulate_pair(n_requests=30, seed=5, temperature=0.0, max_new_tokens=60)
    comp = pair_companion(sim.compact_req_steps, sim.cap_req_steps)
    est = estimate_blocks(sim.compact_req_steps, sim.compact_requests)
    b = est.blocks.merge(comp.steps[["rid", "step", "ceiling"]], on=["rid", "step"])
    ex = b[b.greedy_exact]
    assert np.allclose(ex["point"], ex["ceiling"], atol=1e-9)
    v = validate_estimator(est, comp)
    assert (v["greedy_mean"].isna() | (v["greedy_err"].abs() < 1e-12)).all()


def test_jsonl_of_a_run_gives_the_same_brackets_as_its_rows():
    sim = simulate_pair(n_requests=20, seed=7, temperature=0.7)
    frame, errors = parse_estimator_lines(sim.compact_jsonl)
    assert errors == []
    a = estimate_blocks(frame, tail="none").blocks
    b = estimate_blocks(sim.compact_req_steps, sim.compact_requests, tail="none").blocks
    m = a.merge(b, on=["rid", "forward_ct"], suffixes=("_j", "_r"))
    assert len(m) == len(b)
    assert (m.lo_j == m.lo_r).all() and (m.hi_j == m.hi_r).all()
    assert (m.category_j == m.category_r).all()


# ---------------------------------------------------------------- point, intervals, validation


def test_point_estimate_fills_tails_inside_bracket():
    sim = simulate_pair(n_requests=30, seed=2, temperature=0.8, eos_token=None)
    for tail in ("empirical", "confidence"):
        b = estimate_blocks(sim.compact_req_steps, sim.compact_requests, tail=tail).blocks
        uncut = b[b.committed == b.correct + 1]
        assert (uncut.point >= uncut.lo - 1e-12).all() and (uncut.point <= uncut.hi + 1e-12).all()
        assert (b.loc[b.category.isin(["resolved", "exact_in_window"]), "tail_fill"] == 0).all()
        assert (b.loc[b.category == "at_end", "tail_fill"] > 0).any() or (
            b.category != "at_end"
        ).all()
    none = estimate_blocks(sim.compact_req_steps, tail="none").blocks
    assert (none.tail_fill == 0).all()
    # STS temperatures of 1 change nothing; large temperatures flatten confidences
    base = estimate_blocks(sim.compact_req_steps, tail="confidence").blocks
    same = estimate_blocks(
        sim.compact_req_steps, tail="confidence", sts_temperatures=[1.0] * 5
    ).blocks
    assert np.allclose(base.point, same.point, atol=1e-3)


def test_bootstrap_interval_matches_loop_resampling():
    sim = simulate_pair(n_requests=15, seed=8, temperature=0.8)
    b = estimate_blocks(sim.compact_req_steps, sim.compact_requests).blocks
    n_boot, seed = 80, 3
    s = summarize_blocks(b, by=(), n_boot=n_boot, seed=seed).iloc[0]
    keys = sorted(set(zip(b.run_id, b.rid, strict=True)))
    per = {k: b[(b.run_id == k[0]) & (b.rid == k[1])] for k in keys}
    means_point, means_lo = [], []
    for draw in bootstrap_indices(len(keys), n_boot, seed):
        sample = pd.concat([per[keys[i]] for i in draw])
        means_point.append(sample.point.mean())
        means_lo.append(sample.lo.mean())
    assert s["point_ci_lo"] == pytest.approx(np.quantile(means_point, 0.025), abs=1e-12)
    assert s["point_ci_hi"] == pytest.approx(np.quantile(means_point, 0.975), abs=1e-12)
    assert s["bracket_ci_lo"] == pytest.approx(np.quantile(means_lo, 0.025), abs=1e-12)


def test_validation_and_coverage_under_sampling():
    vals = []
    for seed in range(4):
        sim = simulate_pair(n_requests=40, seed=seed, temperature=0.8, eos_token=None)
        comp = pair_companion(sim.compact_req_steps, sim.cap_req_steps)
        est = estimate_blocks(sim.compact_req_steps, sim.compact_requests)
        v = validate_estimator(est, comp, by=(), n_boot=100)
        vals.append(v)
    cov = coverage(vals, by=())
    assert cov["replicates"].iloc[0] == 4
    assert cov["inside_bracket_rate"].iloc[0] >= 0.75
    assert cov["mean_pct_err"].iloc[0] < 10.0
    # validation also takes the cap-accept req_steps directly
    v2 = validate_estimator(est, sim.cap_req_steps)
    assert set(v2["workload"]) == {"math", "chat", "poetry"}


# ---------------------------------------------------------------- predictive interval


def _one_block_two_offsets() -> pd.DataFrame:
    """One censored block, w=2 of gamma=4, both trimmed offsets resolved with a = 0.5."""
    half = math.log(0.5)
    line = {
        "rid": "a",
        "fct": 1,
        "w": 2,
        "cl": 2,
        "ct": 0,
        "trimmed_tokens": [7, 8],
        "q_lp": [0.0, 0.0],
        "pg": [[1, 3, half, 7, 7], [1, 4, half, 8, 8]],
    }
    frame, errors = parse_estimator_lines([json.dumps(line)], gamma=4)
    assert errors == []
    return estimate_blocks(frame).blocks


def test_chain_of_one_block_realizes_by_hand():
    b = _one_block_two_offsets()
    blk = b.iloc[0]
    assert blk.category == "resolved" and blk.committed == 3.0
    assert list(blk.chain_p) == pytest.approx([0.5, 0.5])
    assert blk.point == pytest.approx(3.0 + 0.5 + 0.25)  # point is the chain's expectation
    rng = np.random.default_rng(0)
    draws = sample_ceilings(b["committed"].to_numpy(), b["chain_p"], rng, 200_000)
    values, counts = np.unique(draws, return_counts=True)
    assert values.tolist() == [3.0, 4.0, 5.0]
    assert counts / draws.size == pytest.approx([0.5, 0.25, 0.25], abs=0.005)
    assert draws.mean() == pytest.approx(blk.point, abs=0.01)
    # one request, one block: point_ci collapses, pred_ci spans the realizations
    s = summarize_blocks(b, by=(), n_boot=400, seed=1).iloc[0]
    assert s.point_ci_lo == s.point_ci_hi == pytest.approx(3.75)
    assert (s.pred_ci_lo, s.pred_ci_hi) == (3.0, 5.0)
    # exact blocks have empty chains and realize to what they committed
    assert chain_survival([[], [1.0, 0.0, 0.7]]).tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_point_is_the_expectation_of_the_chain():
    sim = simulate_pair(n_requests=12, seed=3, temperature=1.0, shared_draws=True)
    for tail in ("empirical", "confidence", "none"):
        b = estimate_blocks(sim.compact_req_steps, sim.compact_requests, tail=tail).blocks
        expect = b["committed"] + chain_survival(b["chain_p"]).sum(axis=1)
        assert np.allclose(expect, b["point"], atol=1e-9)
        assert (b.loc[b.category == "exact_in_window", "chain_p"].map(len) == 0).all()


def test_predictive_interval_reduces_to_request_bootstrap_under_greedy():
    sim = simulate_pair(n_requests=24, seed=1, temperature=0.0)
    b = estimate_blocks(sim.compact_req_steps, sim.compact_requests, tail="none").blocks
    probs = np.concatenate([np.asarray(c, dtype=np.float64) for c in b["chain_p"]])
    assert np.isin(probs, (0.0, 1.0)).all()  # greedy: a_k is 0 or 1
    s = summarize_blocks(b, n_boot=150, seed=4)
    assert np.allclose(s["pred_ci_lo"], s["point_ci_lo"], atol=1e-12)
    assert np.allclose(s["pred_ci_hi"], s["point_ci_hi"], atol=1e-12)
    # without chains (e.g. an older blocks frame) there is no predictive interval
    old = summarize_blocks(b.drop(columns="chain_p"), n_boot=50)
    assert old["pred_ci_lo"].isna().all() and old["point_ci_lo"].notna().all()


@functools.cache
def _shared_draw_replicates() -> tuple:
    """The 60 seeded small sampled replicates (3 requests per workload) whose companion consumes
    the same draws, as the engine's does; simulated once for the two coverage tests below, which
    only read them."""
    return tuple(
        simulate_pair(
            n_requests=9, seed=seed, temperature=1.0, max_new_tokens=32, shared_draws=True
        )
        for seed in range(60)
    )


def test_predictive_interval_covers_realized_companion_truth():
    """Over seeded small sampled replicates (3 requests per workload; the companion consumes
    the same draws, as the engine's does), pred_ci holds the realized truth near the nominal
    95% where point_ci (expected mean only) falls short."""
    vals = []
    for seed, sim in enumerate(_shared_draw_replicates()):
        est = estimate_blocks(sim.compact_req_steps, sim.compact_requests)
        vals.append(validate_estimator(est, sim.cap_req_steps, n_boot=100, seed=seed))
    v = pd.concat(vals)
    assert {"pred_ci_lo", "pred_ci_hi", "pred_interval_covers"} <= set(v.columns)
    cov = coverage(vals, by=())
    pred, point = cov["pred_interval_coverage"].iloc[0], cov["interval_coverage"].iloc[0]
    assert 0.88 <= pred <= 0.99, cov.to_dict("records")
    assert pred >= point
    assert cov["pred_ci_width"].iloc[0] >= cov["point_ci_width"].iloc[0]
    # the predictive interval is centred like point_ci: it only adds realization noise
    mid_pred = 0.5 * (v.pred_ci_lo + v.pred_ci_hi)
    assert (mid_pred - v.mean_point).abs().mean() < 0.25 * (v.pred_ci_hi - v.pred_ci_lo).mean()


# ---------------------------------------------------------------- JSONL errors and problems


def test_malformed_jsonl_lines_reported_with_numbers(tmp_path):
    good = [
        {
            "rid": "a",
            "fct": 1,
            "w": 2,
            "cl": 2,
            "ct": 0,
            "trimmed_tokens": [7, 8],
            "q_lp": [-0.5, -0.1],
            "pg": [[1, 3, -0.2, 7, 7]],
        },
        {"rid": "a", "fct": 2, "w": 1, "cl": 0, "ct": 0, "pg": [[1, 4, -0.3, 8, 9]]},
        {"rid": "b", "fct": 2, "w": 4, "cl": 4, "ct": 0},
    ]
    lines = [
        json.dumps(good[0]),  # 1
        "{bad json",  # 2
        json.dumps({"rid": "x", "fct": 1, "w": 1}),  # 3 missing cl, ct
        json.dumps({"rid": "x", "fct": 1, "w": "2", "cl": 0, "ct": 0}),  # 4 wrong type
        "",  # 5 blank: ignored
        json.dumps({"rid": "x", "fct": 1, "w": 1, "cl": 2, "ct": 0}),  # 6 cl > w
        json.dumps(good[1]),  # 7
        json.dumps({"rid": "x", "fct": 2, "w": 9, "cl": 1, "ct": 0}),  # 8 w > gamma
        json.dumps(
            {"rid": "x", "fct": 3, "w": 1, "cl": 1, "ct": 0, "trimmed_tokens": [1, 2, 3]}
        ),  # 9 no q_lp
        json.dumps(
            {"rid": "x", "fct": 4, "w": 1, "cl": 1, "ct": 0, "trimmed_tokens": [1], "q_lp": [0.0]}
        ),  # 10
        json.dumps(good[0]),  # 11 duplicate
        json.dumps({"rid": "x", "fct": True, "w": 1, "cl": 0, "ct": 0}),  # 12 bool
        json.dumps({"rid": "a", "eos_end": "1"}),  # 13 bad marker
        json.dumps(good[2]),  # 14
        json.dumps({"rid": "x", "fct": 5, "w": 1, "cl": 0, "ct": -1}),  # 15 negative ct
        json.dumps(
            {"rid": "x", "fct": 6, "w": 1, "cl": 0, "ct": 0, "pg": [[1, 2, 0.0]]}
        ),  # 16 short pg
        json.dumps({"rid": "x", "fct": 7, "w": 2, "cl": 2, "ct": 0}),  # 17 censored w/o trimmed
        json.dumps([1, 2]),  # 18 not an object
        json.dumps({"rid": "a", "eos_end": [99]}),  # 19 unknown block
    ]
    path = tmp_path / "est.jsonl"
    path.write_text("\n".join(lines) + "\n")
    frame, errors = read_estimator_jsonl(path)
    assert [e.line for e in errors] == [2, 3, 4, 6, 8, 9, 10, 11, 12, 13, 15, 16, 17, 18, 19]
    msg = {e.line: e.reason for e in errors}
    assert (
        "not valid JSON" in msg[2]
        and "missing key" in msg[3]
        and "'w' must be an integer" in msg[4]
    )
    assert "cl <= w" in msg[6] and "exceeds gamma=4" in msg[8] and "must come together" in msg[9]
    assert (
        "expected gamma - w = 3" in msg[10]
        and "duplicate" in msg[11]
        and "first on line 1" in msg[11]
    )
    assert "lacks trimmed_tokens" in msg[17] and "fct=99" in msg[19]
    assert str(errors[0]).startswith("line 2:")
    assert frame["line"].tolist() == [1, 7, 14]
    assert frame["gamma"].unique().tolist() == [4]  # inferred from w + len(trimmed_tokens)
    est = estimate_blocks(frame)
    blk = est.blocks.set_index(["rid", "forward_ct"])
    assert blk.loc[("a", 1), "category"] == "diverged" and blk.loc[("a", 1), "n_resolved"] == 2
    assert blk.loc[("b", 2), "category"] == "exact_in_window"


def test_eos_markers_and_explicit_gamma():
    lines = [
        json.dumps(
            {
                "rid": "a",
                "fct": 1,
                "w": 1,
                "cl": 1,
                "ct": 0,
                "trimmed_tokens": [4, 5, 6],
                "q_lp": [-1, -1, -1],
                "pg": [[1, 2, -1.0, 4, 4]],
            }
        ),
        json.dumps({"rid": "a", "eos_end": [1]}),
    ]
    frame, errors = parse_estimator_lines(lines)
    assert errors == [] and frame["eos_end"].tolist() == [True]
    b = estimate_blocks(frame).blocks.iloc[0]
    assert b.category == "eos" and b.lo == b.hi == 3.0
    _, errors = parse_estimator_lines(lines, gamma=5)
    assert [e.line for e in errors] == [1, 2]


def test_problems_are_reported_not_fatal():
    rows = pd.DataFrame(
        [
            {
                "rid": "a",
                "forward_ct": 1,
                "gamma": 4,
                "verify_len": 2,
                "correct_drafts": 1,
                "trimmed_tokens": [1, 2, 3],
                "q_lp": [-1.0, -1.0, -1.0],
                "pg": [
                    {
                        "src_fct": 1,
                        "k": 3,
                        "target_logprob": -1.0,
                        "draft_token": 2,
                        "realized_token": 2,
                    }
                ],
            },
            {
                "rid": "a",
                "forward_ct": 2,
                "gamma": 4,
                "verify_len": 3,
                "correct_drafts": 2,
                "trimmed_tokens": None,
                "q_lp": None,
                "pg": [
                    {
                        "src_fct": 77,
                        "k": 2,
                        "target_logprob": 0.0,
                        "draft_token": 1,
                        "realized_token": 1,
                    }
                ],
            },
        ]
    )
    est = estimate_blocks(rows, tail="none")
    text = "\n".join(est.problems)
    assert "pg offset 3 after 1" in text and "lacks trimmed_tokens" in text and "src_fct=77" in text
    assert est.blocks["category"].tolist() == ["at_end", "at_end"]
    assert est.blocks["hi"].tolist() == [2.0 + 3, 3.0 + 2]
    with pytest.raises(ValueError, match="tail"):
        estimate_blocks(rows, tail="magic")


# ---------------------------------------------------------------- tail models (issue 21)


def _tail_world(n: int, seed: int, alpha: float = -0.6, beta: float = 1.6):
    """Offsets with a head that is miscalibrated in a known way: the true acceptance is
    sigmoid(alpha + beta * logit(c)). The budget keeps the high-confidence offsets verified
    (0/1 labels) and trims the rest; later rows resolve some trimmed ones (soft label a_k =
    the true rate), as compact's selection does."""
    from dspark_obs.analytics.estimator_tail import OBS_COLUMNS

    rng = np.random.default_rng(seed)
    conf = rng.beta(2.0, 2.0, size=n)
    pos = rng.integers(1, 6, size=n)
    lc = np.log(conf) - np.log1p(-conf)
    rate = 1.0 / (1.0 + np.exp(-(alpha + beta * lc)))
    verified = conf > 0.45
    resolved = ~verified & (rng.random(n) < 0.3)
    keep = verified | resolved
    y = np.where(verified, (rng.random(n) < rate).astype(float), rate)
    obs = pd.DataFrame(
        {
            "request": [f"r{i % 40}" for i in range(n)],
            "workload": "chat",
            "position": pos,
            "conf": conf,
            "y": y,
            "resolved": resolved,
        },
        columns=list(OBS_COLUMNS),
    )[keep]
    trimmed = ~keep
    return obs, pos[trimmed], conf[trimmed], rate[trimmed]


def test_calibrated_tail_corrects_the_selection_effect_that_empirical_rates_miss():
    from dspark_obs.analytics.estimator_tail import fit_tail

    obs, pos, conf, truth = _tail_world(6000, seed=0)
    wl = np.full(pos.shape, "chat")
    cal = fit_tail("calibrated", obs, 5)
    assert cal.theta[-1] == pytest.approx(1.6, abs=0.15)  # the slope the head lacks
    err_cal = cal.rates(pos, conf, wl).mean() - truth.mean()
    err_emp = fit_tail("empirical", obs, 5).rates(pos, conf, wl).mean() - truth.mean()
    err_head = fit_tail("confidence", obs, 5).rates(pos, conf, wl).mean() - truth.mean()
    assert abs(err_cal) < 0.01
    assert err_emp > 0.15  # the verified (kept) offsets overstate the trimmed ones
    assert abs(err_head) > 0.05
    # auto picks by held-out log loss on resolved offsets, and says so
    auto = fit_tail("auto", obs, 5)
    assert auto.name == "calibrated"
    assert set(auto.selection) == {"calibrated", "confidence", "empirical"}
    assert auto.describe()["tail_model"] == "calibrated"


def test_calibrated_tail_falls_back_to_the_head_without_data():
    from dspark_obs.analytics.estimator_tail import OBS_COLUMNS, fit_tail

    empty = pd.DataFrame(columns=list(OBS_COLUMNS)).astype({"resolved": bool, "y": float})
    model = fit_tail("auto", empty, 5)
    assert model.name == "calibrated" and not model.selection  # too little to cross-validate
    c = np.array([0.2, 0.5, 0.9])
    assert np.allclose(model.rates(np.array([1, 2, 3]), c, np.full(3, "x")), c, atol=1e-9)
    with pytest.raises(ValueError, match="tail must be one of"):
        fit_tail("bogus", empty, 5)


def test_tail_uncertainty_shrinks_with_data_and_widens_the_interval():
    from dspark_obs.analytics.estimator_tail import fit_tail

    small, pos, conf, _ = _tail_world(150, seed=1)
    big, _, _, _ = _tail_world(6000, seed=1)
    wl = np.full(pos.shape, "chat")
    spread = []
    for obs in (small, big):
        model = fit_tail("calibrated", obs, 5)
        means = [model.rates(pos, conf, wl, d).mean() for d in model.draws(300, seed=2)]
        spread.append(np.std(means))
    assert spread[0] > 2.5 * spread[1] > 0.0
    # fixed models carry no parameter draws
    assert fit_tail("confidence", small, 5).draws(3, 0) == [None, None, None]


def test_companion_interval_is_exact_where_every_block_is_settled():
    """Greedy and fully observed blocks: chains are 0/1, so point, companion_ci and the
    truth coincide (no tail, no coin flips)."""
    sim = simulate_pair(n_requests=30, seed=5, temperature=0.0, max_new_tokens=60)
    comp = pair_companion(sim.compact_req_steps, sim.cap_req_steps)
    est = estimate_blocks(sim.compact_req_steps, sim.compact_requests)
    settled = est.blocks[est.blocks.greedy_exact]
    s = summarize_blocks(settled, by=(), n_boot=50, tail_model=est.tail_model).iloc[0]
    truth = settled.merge(comp.steps[["rid", "step", "ceiling"]], on=["rid", "step"])["ceiling"]
    assert s.companion_ci_lo == pytest.approx(truth.mean(), abs=1e-12)
    assert s.companion_ci_hi == pytest.approx(truth.mean(), abs=1e-12)
    assert s.mean_point == pytest.approx(truth.mean(), abs=1e-12)


def test_companion_interval_covers_the_companion_of_the_same_run():
    """Seeded sampled replicates whose companion consumes the same draws: companion_ci (same
    blocks, tail parameters and coins redrawn) holds the companion's mean near 95%."""
    vals = []
    for seed, sim in enumerate(_shared_draw_replicates()):
        est = estimate_blocks(sim.compact_req_steps, sim.compact_requests, seed=seed)
        vals.append(validate_estimator(est, sim.cap_req_steps, by=(), n_boot=100, seed=seed))
    cov = coverage(vals, by=()).iloc[0]
    assert 0.88 <= cov["companion_interval_coverage"] <= 1.0, cov.to_dict()
    assert cov["companion_ci_width"] <= cov["pred_ci_width"]  # no request resampling


def test_validation_cell_is_the_nearest_cell_of_the_same_sampling_kind(tmp_path):
    from dspark_obs.analytics.estimator_cells import (
        describe_tail,
        load_cells,
        sampling_kind,
        validation_cell,
    )

    cells = [
        {"frac": f, "sampling": s, "workload": w, "censored_share": c, "replicates": 20,
         "point_error": e, "coverage": 0.95, "interval_width": 0.2}
        for f, s, w, c, e in [
            (0.75, "T1", "all", 0.1, 0.001), (0.33, "T1", "all", 0.5, 0.012),
            (0.33, "greedy", "all", 0.6, 0.0), (0.33, "T1", "chat", 0.45, 0.3),
        ]
    ]  # fmt: skip
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"cells": cells}))
    loaded = load_cells(path)
    assert len(loaded) == 3  # per-workload sub-cells are not what a run is matched against
    cell = validation_cell(0.42, "temperature", loaded)
    assert (cell["frac"], cell["point_error"]) == (0.33, 0.012)
    assert validation_cell(0.42, "top-k", loaded) is None
    assert load_cells(tmp_path / "absent.json") == []
    (tmp_path / "bad.json").write_text("{not json")
    assert load_cells(tmp_path / "bad.json") == []
    rows = pd.DataFrame({"temperature": [1.0, 1.0], "top_p": [1.0, 0.9], "top_k": [-1, -1]})
    assert sampling_kind(rows) == "top-p"
    assert sampling_kind(rows.assign(temperature=0.0)) == "greedy"
    line = describe_tail({"tail_model": "calibrated", "beta": 1.2, "validation_cell": cell})
    assert "calibrated" in line and "+1.2%" in line and "0.95" in line


def test_report_names_the_tail_model_of_each_compact_run():
    from dspark_obs.analytics import build_report

    sim = simulate_pair(n_requests=12, seed=2, temperature=1.0, shared_draws=True)
    runs = sim.runs
    rs = pd.concat([sim.compact_req_steps, sim.cap_req_steps])
    rq = pd.concat([sim.compact_requests, sim.cap_requests])
    rep = build_report(rs, rq, runs, n_boot=20)
    info = rep.meta["tail_models"]
    assert set(info) == set(runs.loc[runs["mode"] == "compact", "run_id"])
    assert all(v["tail_model"] in ("calibrated", "confidence", "empirical") for v in info.values())
    md = rep.to_markdown()
    assert "## Estimator tail model" in md and "tail model:" in md
    assert set(rep.estimator["tail_model"]) <= {"calibrated", "confidence", "empirical"}
