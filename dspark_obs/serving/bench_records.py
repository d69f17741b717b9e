"""Bench runs as store records (a ``runs`` row of source ``bench`` + ``requests`` rows), and back.

The runs row's ``config`` JSON holds ``{"kind": "bench", "url", "api", the load settings,
"server": what /server_info said, "summary": BenchSummary.to_dict()}``, so a stored run can
be compared (``dspark-obs gate RUN_A RUN_B``) without its chunk timelines. Per-request
rows keep the output token ids, the three wall-clock instants (arrival = send, first
token, finish) and SGLang's spec meta_info; TPOT and accept length are recomputed from them.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pandas as pd

from dspark_obs.schema import MODES
from dspark_obs.serving.bench_stats import FRAME_COLUMNS, BenchSummary
from dspark_obs.serving.client import GenerationRequest, RequestResult

__all__ = ["bench_records", "load_bench_run", "server_meta"]


def server_meta(info: dict | None) -> dict[str, Any]:
    """Mode, gamma, model and drafter from SGLang's /server_info (None where not said)."""
    info = info or {}
    meta: dict[str, Any] = {
        "model": info.get("model_path") or info.get("served_model_name"),
        "drafter": info.get("speculative_draft_model_path"),
        "algorithm": info.get("speculative_algorithm"),
        "mode": None,
        "gamma": None,
    }
    draft_tokens = info.get("speculative_num_draft_tokens")
    if isinstance(draft_tokens, int) and draft_tokens > 1:
        meta["gamma"] = draft_tokens - 1
    extra = info.get("dspark_obs") if isinstance(info.get("dspark_obs"), dict) else {}
    meta["mode"] = extra.get("mode")  # dspark-obs engine-server says it here too
    for state in info.get("internal_states") or []:
        record = (state or {}).get("dspark_info_record") if isinstance(state, dict) else None
        if isinstance(record, dict):
            meta["mode"] = record.get("mode", meta["mode"])
            meta["gamma"] = record.get("gamma", meta["gamma"])
            break
    return meta


def bench_records(
    run_id: str,
    requests: list[GenerationRequest],
    results: list[RequestResult],
    summary: BenchSummary,
    config: dict[str, Any],
    server: dict[str, Any],
) -> tuple[dict, list[dict]]:
    """The runs row and the requests rows of one bench run."""
    by_rid = {r.rid: r for r in requests}
    workloads = {r.workload for r in requests}
    first = requests[0]
    mode = server.get("mode") if server.get("mode") in MODES else "static"
    run = {
        "run_id": run_id,
        "source": "bench",
        "mode": mode,
        "gamma": int(server.get("gamma") or 1),
        "model": server.get("model"),
        "drafter": server.get("drafter"),
        "workload": workloads.pop() if len(workloads) == 1 else "mixed",
        "temperature": first.temperature,
        "top_p": first.top_p,
        "top_k": first.top_k,
        "seed": config.get("seed"),
        "started_at": dt.datetime.fromtimestamp(
            min((r.send_time for r in results), default=0.0), tz=dt.UTC),
        "config": json.dumps({"kind": "bench", **config, "server": server,
                              "summary": summary.to_dict()}, default=str),
    }
    rows = []
    for res in results:
        req = by_rid[res.rid]
        ttft = res.ttft
        rows.append({
            "run_id": run_id,
            "rid": res.rid,
            "workload": req.workload,
            "prompt": req.text if req.text is not None else (
                json.dumps(req.messages) if req.messages is not None else None),
            "prompt_tokens": res.prompt_tokens if res.prompt_tokens is not None else (
                len(req.input_ids) if req.input_ids is not None else None),
            "output_tokens": res.output_ids,
            "completion_tokens": res.completion_tokens,
            "finish_reason": res.finish_reason if res.ok else "abort",
            "max_new_tokens": req.max_new_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "seed": req.seed,
            "arrival_time": res.send_time,
            "first_token_time": None if ttft is None else res.send_time + ttft,
            "finish_time": res.send_time + res.e2e,
            "spec_verify_ct": res.spec.get("spec_verify_ct"),
            "spec_accept_length": res.spec.get("spec_accept_length"),
            "spec_correct_drafts_histogram": res.spec.get("spec_correct_drafts_histogram"),
            "spec_cap_lens_histogram": res.spec.get("spec_cap_lens_histogram"),
        })
    return run, rows


class BenchRunError(LookupError):
    """The store holds no bench run of that id."""


def load_bench_run(store, run_id: str) -> tuple[pd.DataFrame, dict, pd.DataFrame]:
    """(request frame as :func:`stats.request_frame` makes it, config, stored requests rows)."""
    quoted = run_id.replace("'", "''")
    runs = store.query(f"SELECT source, config FROM runs WHERE run_id = '{quoted}'").to_pylist()
    if not runs:
        raise BenchRunError(f"no run {run_id!r} in the store")
    config = json.loads(runs[0]["config"] or "{}")
    if runs[0]["source"] != "bench" or config.get("kind") != "bench":
        raise BenchRunError(f"run {run_id!r} is not a bench run (source {runs[0]['source']!r})")
    rows = store.query(
        "SELECT rid, workload, finish_reason, arrival_time, first_token_time, finish_time, "
        "completion_tokens, spec_verify_ct, spec_accept_length, output_tokens, temperature "
        f"FROM requests WHERE run_id = '{quoted}' ORDER BY rid"
    ).to_pandas()
    frame = pd.DataFrame({
        "rid": rows["rid"],
        "workload": rows["workload"],
        "ok": rows["finish_reason"] != "abort",
        "send_s": rows["arrival_time"] - rows["arrival_time"].min(),
        "ttft_s": rows["first_token_time"] - rows["arrival_time"],
        "tpot_s": (rows["finish_time"] - rows["first_token_time"])
        / (rows["completion_tokens"] - 1).where(rows["completion_tokens"] > 1),
        "e2e_s": rows["finish_time"] - rows["arrival_time"],
        "completion_tokens": rows["completion_tokens"],
        "accept_length": (rows["completion_tokens"] / rows["spec_verify_ct"]).astype(float),
        "spec_verify_ct": rows["spec_verify_ct"].astype(float),
    }, columns=list(FRAME_COLUMNS))
    return frame, config, rows
