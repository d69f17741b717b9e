"""Analytics: calibration + STS, verify windows, companion ceilings, block-accept estimator.

Pure functions over the schema's tables (pandas DataFrames or Arrow tables in, DataFrames
and dataclasses out), so the CLI, the dashboards and tests share one implementation.
"""

from dspark_obs.analytics.calibration import (
    auroc,
    auroc_binned,
    brier,
    calibration_metrics,
    calibration_table,
    conditional_acceptance,
    ece,
    ece_equal_mass,
    mce,
    position_labels,
    reliability_bins,
    reliability_table,
    request_confidence,
)
from dspark_obs.analytics.companion import (
    CompanionDivergence,
    CompanionResult,
    ceiling_summary,
    find_companion,
    pair_companion,
    step_ceilings,
)
from dspark_obs.analytics.estimator import (
    CATEGORIES,
    BlockAcceptRecorder,
    BlockEstimate,
    JsonlError,
    coverage,
    estimate_blocks,
    exact_greedy_ceiling,
    parse_estimator_lines,
    read_estimator_jsonl,
    summarize_blocks,
    validate_estimator,
)
from dspark_obs.analytics.estimator_jsonl import EstimatorFileError
from dspark_obs.analytics.report import Report
from dspark_obs.analytics.report_build import build_report
from dspark_obs.analytics.sts import (
    StsData,
    apply_sts,
    fit_sts,
    logit,
    pooled_ece,
    position_ece,
    sts_data_from_req_steps,
    temperature_grid,
)
from dspark_obs.analytics.sts_heldout import StsHeldout, fit_sts_heldout
from dspark_obs.analytics.sts_shards import load_sts_shards, save_sts_shard
from dspark_obs.analytics.sts_verdict import StsVerdict, sts_verdict
from dspark_obs.analytics.windows import budget_stats, window_histogram, window_stats

__all__ = [
    "CATEGORIES",
    "BlockAcceptRecorder",
    "BlockEstimate",
    "CompanionDivergence",
    "CompanionResult",
    "EstimatorFileError",
    "JsonlError",
    "Report",
    "StsData",
    "StsHeldout",
    "apply_sts",
    "auroc",
    "auroc_binned",
    "brier",
    "budget_stats",
    "build_report",
    "calibration_metrics",
    "calibration_table",
    "ceiling_summary",
    "conditional_acceptance",
    "coverage",
    "ece",
    "ece_equal_mass",
    "estimate_blocks",
    "exact_greedy_ceiling",
    "find_companion",
    "fit_sts",
    "fit_sts_heldout",
    "load_sts_shards",
    "logit",
    "mce",
    "pair_companion",
    "parse_estimator_lines",
    "pooled_ece",
    "position_ece",
    "position_labels",
    "read_estimator_jsonl",
    "reliability_bins",
    "reliability_table",
    "request_confidence",
    "save_sts_shard",
    "step_ceilings",
    "sts_data_from_req_steps",
    "sts_verdict",
    "StsVerdict",
    "summarize_blocks",
    "temperature_grid",
    "validate_estimator",
    "window_histogram",
    "window_stats",
]
