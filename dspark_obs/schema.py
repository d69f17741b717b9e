"""The record types every producer emits and every consumer reads.

Five tables, each an Arrow schema:

* ``runs``      one row per run (mode, gamma, model, drafter, sampling, companion link).
* ``steps``     one row per decode step per DP rank: a superset of SGLang 0.5.23's
                ``DecodeStepRecord`` (same field names, same meaning, -1 / null when unset).
* ``req_steps`` one row per request per step: a superset of SGLang's ``ReqDetail`` plus the
                block-accept estimator fields SGLang writes to its JSONL (``trimmed_tokens``,
                ``q_lp``, ``pg``).
* ``requests``  one row per finished request (prompt, output, finish reason, timings).
* ``req_step_amends`` the estimator fields of a request-step whose estimator line arrived
                after the row was stored (keyed like ``req_steps``); the ``req_steps`` view
                merges them onto their row (``store/views.py`` states the rule).

Declarations only (tables, keys, fields, types, the store's name for a run): turning rows
into these tables and checking them is ``dspark_obs/validation.py``, the rules it applies
are ``dspark_obs/rules.py``.
"""

from __future__ import annotations

from urllib.parse import quote

import pyarrow as pa

SOURCES = ("engine", "sglang", "bench")  # bench: a `dspark-obs bench` run over HTTP
MODES = ("static", "compact", "cap-accept")

# --- SGLang 0.5.23 DecodeStepRecord: every field, same names. -1 means "unset" for ints.
SGLANG_STEP_INT_FIELDS = (
    "bs",
    "budget",
    "lag_steps",
    "num_running_reqs",
    "num_verify_tokens",
    "verify_tokens_local",
    "verify_tokens_dp_synced",
    "verify_tokens_graph_key",
)
SGLANG_STEP_FLOAT_FIELDS = (
    "predicted_step_ms",
    "predicted_theta",
    "step_cpu_ms",
    "step_gpu_ms",
    "draft_gpu_ms",
    "target_verify_gpu_ms",
)
# --- SGLang 0.5.23 ReqDetail.
SGLANG_REQ_INT_FIELDS = (
    "req_pool_index",
    "prefix_len",
    "verify_len",
    "acc_len",
    "correct_drafts",
    "cap_trim",
    "bonus_token",
)

PG_TYPE = pa.struct(
    [
        ("src_fct", pa.int64()),  # forward_ct of the step whose block was censored
        ("k", pa.int32()),  # 1-based draft position in that block (SGLang): verify_len..gamma
        ("target_logprob", pa.float32()),  # target log-prob of the trimmed draft token
        ("draft_token", pa.int32()),
        ("realized_token", pa.int32()),
    ]
)

RUNS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("mode", pa.string(), nullable=False),
        pa.field("gamma", pa.int32(), nullable=False),
        ("model", pa.string()),
        ("drafter", pa.string()),
        ("workload", pa.string()),  # a single workload label, or "mixed"
        ("temperature", pa.float32()),
        ("top_p", pa.float32()),
        ("top_k", pa.int32()),
        ("seed", pa.int64()),
        ("companion_of", pa.string()),  # the compact run a cap-accept run shadows
        ("lag_steps", pa.int32()),
        ("dp_size", pa.int32()),
        ("started_at", pa.timestamp("us", tz="UTC")),
        ("config", pa.string()),  # JSON: everything else (cost table path, STS, host...)
    ]
)

STEPS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("dp_rank", pa.int32(), nullable=False),
        pa.field("forward_ct", pa.int64(), nullable=False),
        ("source", pa.string()),
        ("mode", pa.string()),
        *[(f, pa.int64()) for f in SGLANG_STEP_INT_FIELDS],
        *[(f, pa.float64()) for f in SGLANG_STEP_FLOAT_FIELDS],
        ("ts", pa.timestamp("us", tz="UTC")),
    ]
)

REQ_STEPS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("dp_rank", pa.int32(), nullable=False),
        pa.field("forward_ct", pa.int64(), nullable=False),
        pa.field("rid", pa.string(), nullable=False),
        pa.field("gamma", pa.int32(), nullable=False),
        *[(f, pa.int64()) for f in SGLANG_REQ_INT_FIELDS],
        ("draft_tokens", pa.list_(pa.int32())),
        ("confidence", pa.list_(pa.float32())),
        ("survival", pa.list_(pa.float32())),
        ("workload", pa.string()),
        ("temperature", pa.float32()),
        ("top_p", pa.float32()),
        ("top_k", pa.int32()),
        ("is_last", pa.bool_()),  # the request's final step (EOS / length may cut acc_len)
        # Block-accept estimator fields, SGLang JSONL names (null when not censored).
        ("trimmed_tokens", pa.list_(pa.int32())),
        ("q_lp", pa.list_(pa.float32())),
        ("pg", pa.list_(PG_TYPE)),
        ("ts", pa.timestamp("us", tz="UTC")),
    ]
)

REQUESTS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("rid", pa.string(), nullable=False),
        ("dp_rank", pa.int32()),
        ("workload", pa.string()),
        ("prompt", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("output_tokens", pa.list_(pa.int32())),
        ("completion_tokens", pa.int64()),
        ("finish_reason", pa.string()),  # "stop" (EOS) | "length" | "abort"
        ("max_new_tokens", pa.int64()),
        ("temperature", pa.float32()),
        ("top_p", pa.float32()),
        ("top_k", pa.int32()),
        ("seed", pa.int64()),
        # Wall-clock seconds since the epoch. TTFT = first_token_time - arrival_time;
        # TPOT = (finish_time - first_token_time) / (completion_tokens - 1), TTFT excluded.
        ("arrival_time", pa.float64()),
        ("first_token_time", pa.float64()),
        ("finish_time", pa.float64()),
        # SGLang's per-request speculative meta_info (null when the server gives none).
        ("spec_verify_ct", pa.int64()),
        ("spec_accept_length", pa.float64()),
        ("spec_correct_drafts_histogram", pa.list_(pa.int64())),
        ("spec_cap_lens_histogram", pa.list_(pa.int64())),
    ]
)

# A late estimator line: SGLang's recorder flushes its JSONL every 16 steps, so a line can
# reach the collector after its request-step was stored. Stored rows are immutable; the line
# becomes an amendment of that row. gamma and verify_len are the row's (the collector copies
# them), so an amendment is checked by the same estimator rules as an on-time line.
REQ_STEP_AMENDS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("dp_rank", pa.int32(), nullable=False),
        pa.field("forward_ct", pa.int64(), nullable=False),
        pa.field("rid", pa.string(), nullable=False),
        pa.field("gamma", pa.int32(), nullable=False),
        pa.field("verify_len", pa.int64(), nullable=False),
        ("trimmed_tokens", pa.list_(pa.int32())),
        ("q_lp", pa.list_(pa.float32())),
        ("pg", pa.list_(PG_TYPE)),
    ]
)
AMENDED_FIELDS = ("trimmed_tokens", "q_lp", "pg")  # the req_steps fields an amendment sets

TABLES: dict[str, pa.Schema] = {
    "runs": RUNS,
    "steps": STEPS,
    "req_steps": REQ_STEPS,
    "requests": REQUESTS,
    "req_step_amends": REQ_STEP_AMENDS,
}

# Idempotency keys: a row with the same key is the same fact, ingested at most once.
KEYS: dict[str, tuple[str, ...]] = {
    "runs": ("run_id",),
    "steps": ("run_id", "dp_rank", "forward_ct"),
    "req_steps": ("run_id", "dp_rank", "forward_ct", "rid"),
    "requests": ("run_id", "rid"),
    "req_step_amends": ("run_id", "dp_rank", "forward_ct", "rid"),
}

STEP_INT_UNSET = -1  # SGLang's "unset" for its int step fields

# A run's store directory is ``run_id=<percent-encoded run_id>``; the store adds at most 35
# bytes to that name (generation suffix, temp names), and file names have at most 255 bytes.
MAX_RUN_DIR_BYTES = 220
_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # DuckDB reads this hive value as NULL


def run_dir_name(run_id: str) -> str:
    """The directory name of one run in the store: ``run_id=<percent-encoded run_id>``."""
    enc = quote(run_id, safe="")
    if run_id == _HIVE_NULL:
        enc = "%5F" + enc[1:]
    return f"run_id={enc}"
