"""bench/bench_throughput.py: queue building, aggregation, plotting, the HF reference, a smoke run.

The smoke run serves a real (tiny) queue with SmolLM2 + the shipped drafter on the CPU, one
torch thread: batch 1 and 2, 3 prompts, 8 new tokens, one repetition, HF included. It is most
of this file's time (about 15-20 s on a quiet 2-core box; minutes when other jobs load the
CPU) and is skipped when the GGUF cannot be had.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

from dspark_obs.testing.throughput_bench import (
    POOLED,
    Measurement,
    RequestStat,
    aggregate,
    build_queue,
    hf_llama_from_target,
    markdown_tables,
    match_outputs,
    plot_results,
    queue_size,
    request_stats,
    summarize,
)
from dspark_obs.workloads import WORKLOADS, load_prompts

ROOT = Path(__file__).resolve().parents[1]


def _bench_module():
    spec = importlib.util.spec_from_file_location(
        "bench_throughput", ROOT / "bench" / "bench_throughput.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_throughput", mod)
    spec.loader.exec_module(mod)
    return mod


# -- queue ------------------------------------------------------------------------------


def test_queue_equal_shares_deterministic_and_prefix_stable() -> None:
    q = build_queue(24, new_tokens=16)
    assert len(q) == 24
    counts = {w: sum(t.prompt.workload == w for t in q) for w in WORKLOADS}
    assert counts == dict.fromkeys(WORKLOADS, 8)
    # every prefix of a multiple of 3 has equal shares (what a smaller batch's queue takes)
    for k in range(3, 25, 3):
        pre = {w: sum(t.prompt.workload == w for t in q[:k]) for w in WORKLOADS}
        assert set(pre.values()) == {k // 3}
    assert all(t.arrival_step == 0 and t.temperature == 0.0 for t in q)
    assert all(t.max_new_tokens == 16 for t in q)
    assert len({t.rid for t in q}) == 24
    assert [t.rid for t in q] == sorted(t.rid for t in q)  # engine admission order = queue
    again = build_queue(24, new_tokens=16)
    assert [(t.rid, t.prompt.text, t.seed) for t in again] == [
        (t.rid, t.prompt.text, t.seed) for t in q
    ]
    longer = build_queue(48, new_tokens=16)
    assert [t.rid for t in longer[:24]] == [t.rid for t in q]
    other = build_queue(24, new_tokens=16, seed=1)
    assert [t.prompt.id for t in other] != [t.prompt.id for t in q]
    # the prompts are the eval split's
    for w in WORKLOADS:
        ids = {p.id for p in load_prompts(w, "eval", 8, 0)}
        assert {t.prompt.id for t in q if t.prompt.workload == w} == ids


def test_queue_rejects_unequal_shares() -> None:
    for n in (0, 2, 25):
        with pytest.raises(ValueError, match="multiple of 3"):
            build_queue(n, new_tokens=8)
    with pytest.raises(ValueError):
        build_queue(3, new_tokens=0)


def test_queue_size_keeps_slots_busy() -> None:
    assert queue_size(24, 1) == 24
    assert queue_size(24, 8) == 24
    assert queue_size(24, 16) == 33  # >= 2 requests per slot, equal shares
    assert queue_size(24, 64) == 129
    assert queue_size(6, 2, factor=1) == 6
    assert all(queue_size(24, b) >= max(24, 2 * b) for b in (1, 2, 4, 8, 16, 32, 64))
    assert all(queue_size(24, b) % 3 == 0 for b in (1, 2, 4, 8, 16, 32, 64))


# -- aggregation ------------------------------------------------------------------------


def _m(variant, batch, rep, seconds, speeds, outputs=None, acc=(0, 0), verify=0):
    """Three requests, one per workload, each 11 tokens; ``speeds`` per request."""
    reqs = []
    for i, (w, s) in enumerate(zip(WORKLOADS, speeds, strict=True)):
        steps, acc_sum = acc
        reqs.append(RequestStat(f"r{i}", w, 11, None if s is None else 10 / s,
                                steps, acc_sum, verify))
    outs = outputs or {f"r{i}": list(range(11)) for i in range(3)}
    return Measurement(variant, batch, rep, seconds, 33, 10, reqs, outs)


def test_summarize_and_request_stats() -> None:
    rows = [
        {"rid": "a", "workload": "math", "completion_tokens": 9, "first_token_time": 10.0,
         "finish_time": 12.0},
        {"rid": "b", "workload": "chat", "completion_tokens": 1, "first_token_time": 5.0,
         "finish_time": 5.0},
    ]
    steps = [{"rid": "a", "acc_len": a, "verify_len": v} for a, v in ((3, 6), (4, 6), (1, 3))]
    stats = request_stats(rows, steps)
    a, b = stats
    assert (a.steps, a.acc_sum, a.verify_sum) == (3, 8, 15)
    assert a.speed == pytest.approx(8 / 2.0)  # first token excluded
    assert b.speed is None and b.steps == 0
    m = Measurement("static", 1, 0, 2.5, 10, 3, stats)
    s = summarize(m)
    assert s["tokens_per_s"] == pytest.approx(4.0)
    assert s["per_request_tok_s"] == pytest.approx(4.0)
    assert s["accept_len"] == pytest.approx(8 / 3)
    assert s["verify_len"] == pytest.approx(5.0)
    assert summarize(m, "chat")["tokens"] == 1 and summarize(m, "chat")["accept_len"] is None
    # a variant without per-request times falls back to its step rate
    m2 = Measurement("nospec", 1, 0, 2.0, 10, 8, [RequestStat("a", "math", 9)],
                     step_rate=4.0)
    assert summarize(m2)["per_request_tok_s"] == 4.0


def test_aggregate_medians_ratios_and_matches() -> None:
    ms = []
    base_secs, static_secs, compact_secs = (3.0, 2.0, 4.0), (1.0, 1.9, 2.1), (1.0, 1.1, 1.2)
    for rep in range(3):
        ms.append(_m("nospec", 1, rep, base_secs[rep], (10, 10, 10)))
        ms.append(_m("static", 1, rep, static_secs[rep], (20, 30, 40), acc=(4, 10), verify=24))
        bad = {"r0": list(range(11)), "r1": [0, 1, 2, 99, 4, 5, 6, 7, 8, 9, 10],
               "r2": list(range(8))}
        ms.append(_m("compact", 1, rep, compact_secs[rep], (30, 30, 30),
                     outputs=bad if rep == 1 else None, acc=(4, 9), verify=16))
    ms.append(_m("hf", 1, 0, 6.0, (5, 5, 5)))
    out = aggregate(ms)

    def cell(v, scope=POOLED):
        (c,) = [c for c in out["cells"] if (c["variant"], c["scope"]) == (v, scope)]
        return c

    def ratio(num, den, scope=POOLED):
        (r,) = [r for r in out["ratios"] if (r["num"], r["den"], r["scope"]) == (num, den, scope)]
        return r

    assert cell("nospec")["tokens_per_s"] == pytest.approx(33 / 3.0)
    assert cell("static")["tokens_per_s"] == pytest.approx(33 / 1.9)
    assert cell("static")["per_request_tok_s"] == pytest.approx(30)  # median of 20/30/40
    assert cell("static", "poetry")["per_request_tok_s"] == pytest.approx(40)
    assert cell("static", "math")["tokens_per_s"] == pytest.approx(11 / 1.9)  # queue share
    assert cell("static")["accept_len"] == pytest.approx(2.5)
    assert cell("compact")["accept_len"] == pytest.approx(2.25)
    assert cell("compact")["verify_len"] == pytest.approx(4.0)
    assert cell("nospec")["accept_len"] is None
    assert cell("static")["reps"] == 3
    # ratios are per repetition, then medianed (not a ratio of medians)
    want = statistics.median(b / s for b, s in zip(base_secs, static_secs, strict=True))
    assert ratio("static", "nospec")["total"] == pytest.approx(want)
    assert ratio("static", "nospec")["total"] != pytest.approx(3.0 / 1.9)  # ratio of medians
    want = statistics.median(s / c for s, c in zip(static_secs, compact_secs, strict=True))
    assert ratio("compact", "static")["total"] == pytest.approx(want)
    assert ratio("compact", "nospec")["per_request"] == pytest.approx(3.0)
    assert ratio("nospec", "hf")["total"] == pytest.approx(6.0 / 3.0)
    assert ratio("nospec", "hf")["reps"] == 1
    # token match: identical everywhere except compact's rep 1 (1 of 11 wrong in r1, r2 cut)
    assert cell("static")["match_rate"] == 1.0 and cell("static")["exact_share"] == 1.0
    c = cell("compact")
    assert c["match_rate"] == 1.0  # median over reps
    assert c["match_rate_min"] == pytest.approx(29 / 30)
    assert cell("compact", "chat")["match_rate_min"] == pytest.approx(10 / 11)
    assert cell("compact", "poetry")["match_reps"][1]["exact_share"] == 0.0
    assert cell("compact", "poetry")["match_reps"][1]["match_rate"] == 1.0  # shorter: prefix
    assert cell("hf")["match_rate"] == 1.0
    assert "match_rate" not in cell("nospec")
    md = markdown_tables(out)
    assert "| 1 | 11.0 | 17.4 | 1.90x |" in md
    assert "HF generate tok/s" in md and "| 1 | poetry | compact |" in md


def test_match_outputs() -> None:
    ref = {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7]}
    got = {"a": [1, 2, 9, 4], "b": [5, 6, 7], "d": [1]}
    m = match_outputs(ref, got, ["a", "b", "c", "d"])
    assert m["requests"] == 2 and m["positions"] == 6
    assert m["match_rate"] == pytest.approx(5 / 6)
    assert m["prefix_rate"] == pytest.approx(4 / 6)  # a: 2 of 4, b: 2 of 2
    assert m["exact_share"] == 0.0
    assert m["first_divergence"] == 2
    assert match_outputs(ref, ref, ref)["exact_share"] == 1.0
    assert match_outputs(ref, {}, ["a"])["match_rate"] is None


def test_plots_and_table_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    ms = [_m(v, b, 0, s * b ** -0.5, (10 / b, 12 / b, 14 / b))
          for v, s in (("nospec", 3.0), ("static", 2.0), ("compact", 1.5)) for b in (1, 2, 4)]
    ms.append(_m("hf", 1, 0, 4.0, (8, 8, 8)))
    paths = plot_results(aggregate(ms), tmp_path / "plots" / "bt", "test")
    assert [p.name for p in paths] == ["bt_pareto.png", "bt_batch.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


# -- the HF reference and the no-spec baseline --------------------------------------------


def test_hf_conversion_matches_target_and_run_no_spec() -> None:
    from dspark_obs.engine.model import ModelConfig, Target
    from dspark_obs.engine.no_spec import run_no_spec
    from dspark_obs.engine.types import GenRequest

    torch.manual_seed(0)
    target = Target(ModelConfig.tiny(tie_embeddings=False)).eval()
    target.reset_parameters(std=0.2)  # peaked logits: no argmax near-ties
    hf = hf_llama_from_target(target)
    ids = torch.randint(0, 128, (17,))
    want = target.forward([ids], [target.new_cache(32)]).logits[0]
    with torch.no_grad():
        got = hf(ids[None]).logits[0]
    torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4)

    reqs = [GenRequest(f"r{i}", torch.randint(0, 128, (5 + 3 * i,)).tolist(), 12)
            for i in range(5)]
    res = run_no_spec(target, reqs, max_batch=2, stop_ids=(0,), backend="reference")
    outputs, times, steps = res.outputs, res.times, res.steps
    assert set(outputs) == {r.rid for r in reqs}
    assert all(f <= e for f, e in times.values())
    for r in reqs:
        seq = hf.generate(torch.tensor([r.prompt_ids]), max_new_tokens=12, do_sample=False,
                          eos_token_id=[0], pad_token_id=0)
        assert outputs[r.rid] == seq[0, len(r.prompt_ids):].tolist()
        assert len(outputs[r.rid]) == 12 or outputs[r.rid][-1] == 0
    assert steps >= max(len(o) for o in outputs.values()) - 1


# -- smoke run --------------------------------------------------------------------------


def test_smoke_run_smollm2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Real model, tiny queue: main() completes, writes JSON + Markdown, CPU outputs agree."""
    from dspark_obs.engine.weights import ModelFetchError, fetch_model

    try:
        fetch_model(progress=False)
    except ModelFetchError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")
    bench = _bench_module()
    out = tmp_path / "bt.json"
    threads = torch.get_num_threads()
    try:  # one thread: a shared 2-core box oversubscribed by OpenMP runs this 5-10x slower
        rc = bench.main(["--device", "cpu", "--batch", "1,2", "--prompts", "3",
                         "--queue-factor", "1", "--new-tokens", "8", "--reps", "1",
                         "--warmup-factor", "0", "--threads", "1", "--no-plots",
                         "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["dtype"] == "float32"
    assert data["torch"] == torch.__version__ and "bench_throughput.py" in data["command"]
    assert data["queue_sizes"] == {"1": 3, "2": 3}
    cells = {(c["variant"], c["batch"]): c for c in data["summary"]["cells"]
             if c["scope"] == POOLED}
    assert set(cells) == {("nospec", 1), ("static", 1), ("compact", 1), ("hf", 1),
                          ("nospec", 2), ("static", 2), ("compact", 2)}
    for (v, _), c in cells.items():
        assert c["tokens_per_s"] > 0 and c["requests"] == 3
        assert c["per_request_tok_s"] is not None and c["per_request_tok_s"] > 0
        if v in ("static", "compact"):
            assert c["match_rate"] == 1.0 and c["exact_share"] == 1.0  # CPU fp32: identical
            assert 1.0 <= c["accept_len"] <= 6.0 and 1.0 <= c["verify_len"] <= 6.0
    assert cells[("static", 1)]["verify_len"] == 6.0  # gamma 5 + anchor
    assert not data["checks"]["mismatch"]
    md = out.with_suffix(".md").read_text()
    assert "| batch | no-spec tok/s |" in md and "| 2 |" in md
    assert "| batch | no-spec tok/s |" in capsys.readouterr().out


def test_merge_joins_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--merge: runs split by batch size (and repeated) become one report, no model loaded."""
    bench = _bench_module()
    meta = {"device": "cpu", "dtype": "float32", "model": "m", "drafter": "d", "gamma": 5,
            "new_tokens": 11, "reps": 1, "nospec_impl": "x", "cost_table": None,
            "device_name": "cpu", "command": "c", "started_at": "t", "warmups": []}
    files = []
    for i, batches in enumerate(((1, 2), (2, 4))):
        ms = [_m(v, b, 0, (3.0 if v == "nospec" else 2.0) + i, (10, 10, 10)).to_dict()
              for v in ("nospec", "static") for b in batches]
        p = tmp_path / f"run{i}.json"
        p.write_text(json.dumps({**meta, "queue_sizes": {str(b): 3 for b in batches},
                                 "measurements": ms}))
        files.append(str(p))
    out = tmp_path / "merged.json"
    assert bench.main(["--merge", *files, "--out", str(out), "--no-plots"]) == 0
    data = json.loads(out.read_text())
    assert [f["path"] for f in data["merged_from"]] == files
    cells = {(c["variant"], c["batch"]): c for c in data["summary"]["cells"]
             if c["scope"] == POOLED}
    assert set(cells) == {(v, b) for v in ("nospec", "static") for b in (1, 2, 4)}
    assert cells[("static", 2)]["reps"] == 2  # batch 2 was in both files: two repetitions
    assert cells[("static", 2)]["tokens_per_s_reps"] == [33 / 2.0, 33 / 3.0]
    ratios = [r for r in data["summary"]["ratios"]
              if (r["num"], r["den"], r["batch"], r["scope"]) == ("static", "nospec", 2, POOLED)]
    assert ratios[0]["total_reps"] == [pytest.approx(1.5), pytest.approx(4 / 3)]
    assert cells[("static", 4)]["match_rate"] == 1.0
    assert "| 4 |" in out.with_suffix(".md").read_text()
    capsys.readouterr()
