"""Every metric dspark-obs exports: name, type, labels, help, buckets (the published contract).

Dashboards and alert rules are built on these names; they stay stable. Counters carry their
exposed name (with ``_total``); a histogram's name is the base of its ``_bucket`` / ``_sum`` /
``_count`` series. Only counters and histograms: ratios are PromQL's job, e.g.

* acceptance per position (observed positions only; a trimmed position is never a rejection)::

    sum by (position) (rate(dspark_position_accepted_total[5m]))
      / sum by (position) (rate(dspark_position_observed_total[5m]))

* mean verify window per workload::

    sum by (workload) (rate(dspark_verify_window_tokens_sum[5m]))
      / sum by (workload) (rate(dspark_verify_window_tokens_count[5m]))

* utilization (committed / ceiling, cap-accept or static runs)::

    sum(rate(dspark_ceiling_committed_tokens_total[5m]))
      / sum(rate(dspark_ceiling_tokens_total[5m]))

* ECE per position (SGLang's 15 equal-width bins of S_j)::

    sum by (position) (abs(
        sum by (position, bin) (increase(dspark_calibration_predicted_probability_total[1h]))
      - sum by (position, bin) (increase(dspark_calibration_accepted_total[1h]))))
    / sum by (position) (increase(dspark_calibration_observations_total[1h]))

Label sets are bounded (model, mode, workload, dp_rank, position, bin, table, reason, and
``tail``: the estimator's tail model, one of four values);
no request id and no run id ever becomes a label. ``position`` is the draft position j = 1..gamma
on every metric (DESIGN.md's numbering; vLLM's own per-position counter is 0-based, ours is not).
Token histograms end in ``_tokens``, time histograms in ``_seconds``; counters in ``_total``.

The recipes are exact under ``increase()`` / ``rate()``: the exporter shows every new series
at 0 on the first scrape that sees it (:mod:`dspark_obs.sinks.prometheus`), so no first
increment is lost. Names renamed from the previous release: :data:`RENAMED`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BACKPRESSURE_METRICS",
    "CALIBRATION_BINS",
    "GENAI_DURATION_BUCKETS",
    "GENAI_TPOT_BUCKETS",
    "GENAI_TOKEN_USAGE_BUCKETS",
    "GENAI_TTFT_BUCKETS",
    "METRICS",
    "RENAMED",
    "Metric",
    "NAMESPACE",
    "STEP_SECONDS_BUCKETS",
    "by_name",
    "token_buckets",
]

NAMESPACE = "dspark"
CALIBRATION_BINS = 15  # SGLang's STS fitter: bin = floor(S_j * 15), clamped to 0..14
DEFAULT_MAX_GAMMA = 8  # token histograms get integer buckets 1..max_gamma+1 (gamma 5 -> 1..6 used)

# Latency buckets (seconds): the OpenTelemetry GenAI semantic conventions' advice, extended
# at both ends so one set covers an H200 (TPOT of a few ms) and the embedded CPU engine (TTFT
# of tens of seconds, TPOT of seconds): the GenAI boundaries stay, so the advice's quantiles
# are still readable, and no CPU p99 is pinned at the advice's top bucket.
# gen_ai.server.time_to_first_token (advice 1 ms .. 10 s) + 15 s .. 10 min:
GENAI_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# gen_ai.server.request.duration (advice: powers of two from 10 ms to 81.92 s) + 3 more:
GENAI_DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
    163.84, 327.68, 655.36,
)  # fmt: skip
# gen_ai.server.time_per_output_token (advice 10 ms .. 2.5 s) + 1 ms .. 7.5 ms and 5 s .. 30 s:
GENAI_TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
)  # fmt: skip
# gen_ai.client.token.usage (advice: powers of four from 1):
GENAI_TOKEN_USAGE_BUCKETS = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
STEP_SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
)  # fmt: skip

STEP_LABELS = ("model", "mode", "dp_rank")
REQ_LABELS = ("model", "mode", "workload", "dp_rank")


def token_buckets(max_gamma: int = DEFAULT_MAX_GAMMA) -> tuple[float, ...]:
    """Integer buckets 1..max_gamma+1 for windows / accept lengths (le="3" counts <= 3)."""
    return tuple(float(k) for k in range(1, max_gamma + 2))


@dataclass(frozen=True)
class Metric:
    """One exported metric. ``source``: the schema table whose rows feed it."""

    name: str
    kind: str  # "counter" | "histogram"
    labels: tuple[str, ...]
    help: str
    source: str
    buckets: tuple[float, ...] | None = None  # histograms; None for token histograms: see above
    unit: str = ""

    @property
    def family(self) -> str:
        """The name prometheus_client families take (a counter without ``_total``)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name


def _c(name: str, labels: tuple[str, ...], source: str, help: str, unit: str = "") -> Metric:
    return Metric(f"{NAMESPACE}_{name}_total", "counter", labels, help, source, unit=unit)


def _h(
    name: str,
    labels: tuple[str, ...],
    source: str,
    help: str,
    buckets: tuple[float, ...] | None,
    unit: str = "",
) -> Metric:
    return Metric(f"{NAMESPACE}_{name}", "histogram", labels, help, source, buckets, unit)


POS = ("position",)
PB = ("position", "bin")

METRICS: tuple[Metric, ...] = (
    # --- steps
    _c("steps", STEP_LABELS, "steps", "Decode steps (one per DP rank per forward)."),
    _c("step_requests", STEP_LABELS, "steps",
       "Sum over steps of the running batch size bs: mean batch = this / steps."),
    _c("step_budget_tokens", STEP_LABELS, "steps",
       "Sum over steps of the scheduler's extra verify-token budget (steps with a budget)."),
    _h("step_seconds", STEP_LABELS, "steps",
       "Measured step time (GPU time when recorded, else CPU wall time).",
       STEP_SECONDS_BUCKETS, "seconds"),
    _c("step_predicted_steps", STEP_LABELS, "steps",
       "Steps with both a cost-table prediction and a measured time."),
    _c("step_predicted_seconds", STEP_LABELS, "steps",
       "Sum of the cost table's predicted step time over those steps.", "seconds"),
    _c("step_measured_seconds", STEP_LABELS, "steps",
       "Sum of the measured step time over the same steps.", "seconds"),
    _c("step_prediction_abs_error_seconds", STEP_LABELS, "steps",
       "Sum of |measured - predicted| step time: mean abs error = this / predicted steps.",
       "seconds"),
    # --- request-steps (one per request per step)
    _c("req_steps", REQ_LABELS, "req_steps", "Verify steps of requests (request x step)."),
    _c("committed_tokens", REQ_LABELS, "req_steps",
       "Tokens committed (acc_len, bonus included)."),
    _c("verified_tokens", REQ_LABELS, "req_steps",
       "Target positions verified (verify_len, anchor included)."),
    _c("drafted_tokens", REQ_LABELS, "req_steps", "Draft tokens offered (gamma per step)."),
    _c("accepted_drafts", REQ_LABELS, "req_steps",
       "Draft tokens accepted inside the verified window (correct_drafts)."),
    _c("position_drafted", (*REQ_LABELS, *POS), "req_steps",
       "Drafts offered at position j (1-based)."),
    _c("position_observed", (*REQ_LABELS, *POS), "req_steps",
       "Positions whose prefix label is known: verified, or settled by an earlier rejection "
       "(the acceptance denominator)."),
    _c("position_accepted", (*REQ_LABELS, *POS), "req_steps",
       "Observed positions with drafts 1..j all accepted (prefix label 1)."),
    _c("position_censored", (*REQ_LABELS, *POS), "req_steps",
       "Positions never verified because the whole window before them was accepted "
       "(compact); neither accepted nor rejected."),
    # vLLM-compatible family: same meaning as vllm:spec_decode_* (0-based position).
    _c("spec_decode_num_drafts", REQ_LABELS, "req_steps",
       "vLLM-compatible: speculation rounds (request-steps that carried drafts)."),
    _c("spec_decode_num_draft_tokens", REQ_LABELS, "req_steps",
       "vLLM-compatible: draft tokens proposed (gamma per round); divides trimmed drafts "
       "as rejections, as vLLM does: prefer dspark_position_*."),
    _c("spec_decode_num_accepted_tokens", REQ_LABELS, "req_steps",
       "vLLM-compatible: draft tokens accepted (bonus excluded)."),
    _c("spec_decode_num_accepted_tokens_per_pos", (*REQ_LABELS, *POS), "req_steps",
       "vLLM-compatible: accepted drafts per position (position 1-based like every dspark "
       "metric; vLLM numbers from 0)."),
    # --- histograms per request-step / request
    _h("verify_window_tokens", REQ_LABELS, "req_steps",
       "Verify window verify_len per request-step (1..gamma+1, anchor included).", None,
       "tokens"),
    _h("committed_per_step_tokens", REQ_LABELS, "req_steps",
       "Tokens committed per request-step (acc_len).", None, "tokens"),
    _h("ceiling_per_step_tokens", REQ_LABELS, "req_steps",
       "Ceiling acc_len + cap_trim per request-step (exact: cap-accept and static runs).",
       None, "tokens"),
    _h("request_accept_length_tokens", REQ_LABELS, "req_steps",
       "Per finished request: committed tokens / verify steps.", None, "tokens"),
    # --- calibration (observed positions only)
    _c("calibration_observations", (*REQ_LABELS, *PB), "req_steps",
       "Observed positions per (position, S_j bin)."),
    _c("calibration_predicted_probability", (*REQ_LABELS, *PB), "req_steps",
       "Sum of predicted survival S_j (clamped to [1e-8, 1-1e-8]) per (position, bin)."),
    _c("calibration_accepted", (*REQ_LABELS, *PB), "req_steps",
       "Prefix label 1 per (position, bin)."),
    # --- ceiling, exact (cap-accept and static)
    _c("ceiling_steps", REQ_LABELS, "req_steps",
       "Request-steps with an exact ceiling (cap-accept and static)."),
    _c("ceiling_committed_tokens", REQ_LABELS, "req_steps",
       "Committed tokens on those steps (numerator of utilization)."),
    _c("ceiling_tokens", REQ_LABELS, "req_steps",
       "Ceiling tokens acc_len + cap_trim on those steps (denominator of utilization)."),
    _c("cap_trim_tokens", REQ_LABELS, "req_steps",
       "Tokens trimming left behind (cap_trim, cap-accept)."),
    # --- ceiling, estimated (compact; added when the request finishes)
    _c("window_fully_accepted", REQ_LABELS, "req_steps",
       "Compact request-steps whose whole window (< gamma drafts) was accepted: each left "
       "at least one token behind (an exact lower bound on trimmed tokens)."),
    _c("estimator_blocks", REQ_LABELS, "req_steps",
       "Compact blocks (request-steps) finalized by the block-accept estimator."),
    _c("estimator_committed_tokens", REQ_LABELS, "req_steps",
       "Committed tokens of those blocks (numerator of estimated utilization)."),
    _c("estimator_lo_tokens", REQ_LABELS, "req_steps",
       "Sum of the estimator's lower bracket of the ceiling (SGLang's lo)."),
    _c("estimator_point_tokens", (*REQ_LABELS, "tail"), "req_steps",
       "Sum of the estimator's point estimate of the ceiling; tail = the tail model that "
       "filled unresolved offsets (calibrated | confidence | empirical | none: the store's "
       "and the report's auto selection, per run)."),
    _c("estimator_hi_tokens", REQ_LABELS, "req_steps",
       "Sum of the estimator's upper bracket of the ceiling (SGLang's hi)."),
    # --- requests
    _c("requests", (*REQ_LABELS[:3], "finish_reason"), "requests",
       "Finished requests by finish reason (stop | length | abort)."),
    _c("prompt_tokens", REQ_LABELS[:3], "requests", "Prompt tokens of finished requests."),
    _c("completion_tokens", REQ_LABELS[:3], "requests",
       "Completion tokens of finished requests."),
    _h("time_to_first_token_seconds", REQ_LABELS[:3], "requests",
       "TTFT: first token time - arrival (GenAI buckets).", GENAI_TTFT_BUCKETS, "seconds"),
    _h("time_per_output_token_seconds", REQ_LABELS[:3], "requests",
       "TPOT excluding the first token: (finish - first token) / (completion tokens - 1), "
       "as SGLang's bench_serving (GenAI buckets).", GENAI_TPOT_BUCKETS, "seconds"),
    _h("request_duration_seconds", REQ_LABELS[:3], "requests",
       "End-to-end request latency: finish - arrival (GenAI buckets).",
       GENAI_DURATION_BUCKETS, "seconds"),
    # --- ingestion
    _c("records_rejected", ("table", "reason"), "errors",
       "Rows refused by schema validation, by table and reason (never reached a sink)."),
)  # fmt: skip

SINK = ("sink",)  # the sink's class name, numbered when repeated: bounded by the sinks of a run

BACKPRESSURE_METRICS: tuple[Metric, ...] = (
    # --- the sink queues of a threaded FanOut (sinks/backpressure.py's LaneCollector, which
    # the process driving the FanOut registers beside the other metrics)
    _c("sink_batches", SINK, "fanout", "Batches the sink acknowledged (its write returned)."),
    _c("sink_rows", SINK, "fanout", "Rows handed to the sink's queue."),
    _c("sink_failed_batches", SINK, "fanout",
       "Batches never written: the sink had failed."),
    _c("sink_blocked", SINK, "fanout", "Puts that waited on the sink's full queue."),
    _c("sink_blocked_seconds", SINK, "fanout",
       "Seconds the producer waited on the sink's full queue (backpressure).", "seconds"),
)  # fmt: skip
"""Not in :data:`METRICS`: they describe the process's sink queues, not the records, so they
are exposed by the registry of whoever drives the FanOut, not by the record sinks."""

# Previous name -> current name (one release: the README's alias table lists the same pairs).
RENAMED: dict[str, str] = {
    "dspark_verify_window": "dspark_verify_window_tokens",
    "dspark_committed_per_step": "dspark_committed_per_step_tokens",
    "dspark_ceiling_per_step": "dspark_ceiling_per_step_tokens",
    "dspark_request_accept_length": "dspark_request_accept_length_tokens",
    "dspark_calibration_predicted_sum_total": "dspark_calibration_predicted_probability_total",
}


def by_name() -> dict[str, Metric]:
    """The catalog keyed by exposed name."""
    return {m.name: m for m in METRICS}
