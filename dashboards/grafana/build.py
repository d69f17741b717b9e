"""The Grafana dashboard, as code: ``python dashboards/grafana/build.py`` writes the JSON.

Why code: every panel's PromQL is data here (``PANELS``), so the test suite can run each one
against a real Prometheus, check that each metric it names is in the telemetry catalog
(dspark_obs/sinks/catalog.py), and check that the committed JSON is what this file builds.

Conventions every query follows:

* ratios are computed in PromQL from counters, and every denominator is guarded with
  ``> 0``: with no traffic a panel shows "no data", never NaN or +Inf;
* ``$model``, ``$mode`` and ``$workload`` are regex variables (All = ``.*``);
* the ceiling, acceptance, window, ECE and step-time panels read the monitoring mixin's
  recorded series (runtime/prometheus/rules/dspark-recording.yml), split by mode and
  workload: a compact run and its cap-accept companion are never summed;
* a compact run's utilization is the estimator's (labelled estimated, with its interval);
  measured utilization exists only where the whole block was verified.

Built with grafana-foundation-sdk (pinned in pyproject.toml). Its classic ``Dashboard``
builder (and the v2beta1 model that every panel builder imports) emits a DeprecationWarning
("Prefer using dashboardv2.Dashboard") at class definition, i.e. on import. The v2 schema
needs Grafana 12 with the kubernetesDashboards feature, while file provisioning of every
current Grafana reads the classic JSON, so the classic builder is the right one here and that
one warning is silenced at import, narrowly.
"""

from __future__ import annotations

import json
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import yaml

with warnings.catch_warnings():  # see the module docstring: the one warning, at import
    warnings.filterwarnings("ignore", "Prefer using dashboardv2", DeprecationWarning)
    from grafana_foundation_sdk.builders import bargauge, heatmap, prometheus, stat, timeseries
    from grafana_foundation_sdk.builders import common as gcommon
    from grafana_foundation_sdk.builders import dashboard as gdash
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common as mcommon
    from grafana_foundation_sdk.models import dashboard as mdash
    from grafana_foundation_sdk.models.prometheus import PromQueryFormat

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboards" / "dspark-obs.json"
UID = "dspark-obs"
DS = mdash.DataSourceRef(type_val="prometheus", uid="${datasource}")

SEL = 'model=~"$model", mode=~"$mode", workload=~"$workload"'
SEL_NO_MODE = 'model=~"$model", workload=~"$workload"'
STEP_SEL = 'model=~"$model", mode=~"$mode"'
RATE = "$__rate_interval"


RULES_FILE = HERE.parents[1] / "runtime" / "prometheus" / "rules" / "dspark-recording.yml"
RECORDED_NAME = r"\b([a-z_]+:dspark_[a-z0-9_]+:[a-z0-9_]+)\b"


def _recording_rules() -> dict[str, str]:
    """record name -> expression, from the monitoring mixin the panels read."""
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}


RECORDING_RULES = _recording_rules()


def _recorded(name: str, sel: str = SEL) -> str:
    """A recorded series of the mixin, filtered by the dashboard's variables."""
    if name not in RECORDING_RULES:
        raise KeyError(f"{name} is not recorded by {RULES_FILE.name}")
    return f"{name}{{{sel}}}"


def _rate(metric: str, by: str, sel: str = SEL, window: str = RATE, fn: str = "rate") -> str:
    return f"sum by ({by}) ({fn}({metric}{{{sel}}}[{window}]))"


def _ratio(num: str, den: str, by: str, sel: str = SEL, window: str = RATE, fn: str = "rate"):
    """num / den per group; groups whose denominator is 0 drop out (no NaN, no +Inf)."""
    return f"{_rate(num, by, sel, window, fn)}\n  / ({_rate(den, by, sel, window, fn)} > 0)"


def _quantile(q: float, metric: str, by: str, sel: str = SEL) -> str:
    """histogram_quantile over groups that saw observations (else no data, not NaN)."""
    buckets = _rate(f"{metric}_bucket", f"le, {by}", sel)
    seen = _rate(f"{metric}_count", by, sel)
    return f"histogram_quantile({q}, {buckets}\n  and on ({by}) ({seen} > 0))"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    instant: bool = False
    heatmap: bool = False


@dataclass(frozen=True)
class PanelSpec:
    title: str
    kind: str  # timeseries | heatmap | bargauge | stat
    why: str  # first half of the description; the metrics are appended
    queries: tuple[Query, ...]
    unit: str = ""
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None

    @property
    def recorded(self) -> list[str]:
        """The mixin's recorded series its queries read."""
        return sorted({n for q in self.queries for n in re.findall(RECORDED_NAME, q.expr)})

    @property
    def metrics(self) -> list[str]:
        """The catalog metrics its queries read, directly or through recorded series (series
        suffixes stripped)."""
        exprs = [q.expr for q in self.queries]
        exprs += [RECORDING_RULES[n] for n in self.recorded]
        exprs += [RECORDING_RULES[m] for e in list(exprs) for m in re.findall(RECORDED_NAME, e)]
        names = set()
        for expr in exprs:
            for name in re.findall(r"(?<![\w:])(dspark_[a-z0-9_]+)(?=[{\[])", expr):
                names.add(re.sub(r"_(bucket|sum|count)$", "", name))
        return sorted(names)

    @property
    def description(self) -> str:
        via = (
            f" Recorded series (runtime/prometheus/rules): {', '.join(self.recorded)}."
            if (self.recorded)
            else ""
        )
        return f"{self.why}{via} Metrics: {', '.join(self.metrics)}."


def _latency_quantiles_panel(name: str, metric: str, why: str) -> PanelSpec:
    """p50 and p95 of a latency histogram (seconds) per mode and workload."""
    by = "mode, workload"
    return PanelSpec(
        f"{name} p50 / p95 (Prometheus histogram quantiles)",
        "timeseries",
        why,
        tuple(
            Query(_quantile(q, metric, by), f"p{round(q * 100)} {{{{mode}}}} {{{{workload}}}}")
            for q in (0.5, 0.95)
        ),
        unit="s",
    )


U = "model_mode_workload"  # the level of the mixin's per-workload recorded series
UP = "model_mode_workload_position"

PANELS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    (
        "Acceptance ceiling",
        (
            PanelSpec(
                "Utilization: measured (cap-accept) and estimated (compact)",
                "timeseries",
                "committed / ceiling. Measured where the whole block was verified (cap-accept "
                "companions, static runs); a compact run's ceiling is hidden, so its "
                "utilization is the block-accept estimator's point with its interval "
                "(committed / hi .. committed / lo), labelled estimated. Mode = All shows "
                "each mode as its own series (never summed).",
                (
                    Query(
                        _recorded(f"{U}:dspark_utilization:ratio_rate5m"),
                        "measured {{mode}} {{workload}}",
                    ),
                    Query(
                        _recorded(f"{U}:dspark_utilization_estimated:ratio_rate5m"),
                        "estimated {{mode}} {{workload}}",
                    ),
                    Query(
                        _recorded(f"{U}:dspark_utilization_estimated_lo:ratio_rate5m"),
                        "estimated lo {{mode}} {{workload}}",
                    ),
                    Query(
                        _recorded(f"{U}:dspark_utilization_estimated_hi:ratio_rate5m"),
                        "estimated hi {{mode}} {{workload}}",
                    ),
                ),  # fmt: skip
                unit="percentunit",
                min=0,
                max=1,
            ),
            PanelSpec(
                "Ceiling gap (share of the ceiling left on the table)",
                "timeseries",
                "1 - utilization over 5m: measured by cap-accept, estimated for compact (the "
                "series the DSparkCeilingGapEstimatedHigh alert watches).",
                (
                    Query(
                        _recorded(f"{U}:dspark_ceiling_gap:ratio_rate5m"),
                        "measured {{mode}} {{workload}}",
                    ),
                    Query(
                        _recorded(f"{U}:dspark_ceiling_gap_estimated:ratio_rate5m"),
                        "estimated {{mode}} {{workload}}",
                    ),
                ),  # fmt: skip
                unit="percentunit",
                min=0,
            ),
            PanelSpec(
                "Ceiling vs committed per step",
                "timeseries",
                "Mean ceiling (acc_len + cap_trim) and mean committed per request-step, exact "
                "steps only (cap-accept and static).",
                (
                    Query(
                        _ratio(
                            "dspark_ceiling_tokens_total",
                            "dspark_ceiling_steps_total",
                            "mode, workload",
                        ),
                        "ceiling {{mode}} {{workload}}",
                    ),
                    Query(
                        _ratio(
                            "dspark_ceiling_committed_tokens_total",
                            "dspark_ceiling_steps_total",
                            "mode, workload",
                        ),
                        "committed {{mode}} {{workload}}",
                    ),
                ),
                unit="short",
                min=0,
                width=8,
            ),
            PanelSpec(
                "Tokens left on the table /s",
                "timeseries",
                "Tokens trimming left behind per second (cap_trim, measured by cap-accept).",
                (
                    Query(
                        _rate("dspark_cap_trim_tokens_total", "mode, workload"),
                        "{{mode}} {{workload}}",
                    ),
                ),
                unit="short",
                min=0,
                width=8,
            ),
            PanelSpec(
                "Estimator vs companion truth",
                "timeseries",
                "Block-accept estimate of the mean ceiling from compact runs alone "
                "(SGLang's bracket lo / hi and the point estimate), beside the exact mean "
                "ceiling the cap-accept companion measured.",
                (
                    Query(
                        _ratio(
                            "dspark_estimator_lo_tokens_total",
                            "dspark_estimator_blocks_total",
                            "workload",
                            sel=f'{SEL_NO_MODE}, mode="compact"',
                        ),
                        "estimated lo {{workload}}",
                    ),
                    Query(
                        _ratio(
                            "dspark_estimator_point_tokens_total",
                            "dspark_estimator_blocks_total",
                            "workload",
                            sel=f'{SEL_NO_MODE}, mode="compact"',
                        ),
                        "estimated point {{workload}}",
                    ),
                    Query(
                        _ratio(
                            "dspark_estimator_hi_tokens_total",
                            "dspark_estimator_blocks_total",
                            "workload",
                            sel=f'{SEL_NO_MODE}, mode="compact"',
                        ),
                        "estimated hi {{workload}}",
                    ),
                    Query(
                        _ratio(
                            "dspark_ceiling_tokens_total",
                            "dspark_ceiling_steps_total",
                            "workload",
                            sel=f'{SEL_NO_MODE}, mode="cap-accept"',
                        ),
                        "measured {{workload}}",
                    ),
                ),
                unit="short",
                width=8,
            ),
        ),
    ),
    (
        "Acceptance and windows",
        (
            PanelSpec(
                "Acceptance per position",
                "timeseries",
                "P(drafts 1..j accepted) over observed positions only (a position trimmed "
                "away by compact is never counted as a rejection), per mode and workload: "
                "compact and its cap-accept companion serve the same requests, so their "
                "counts are never added up.",
                (
                    Query(
                        _recorded(f"{UP}:dspark_position_acceptance:ratio_rate5m"),
                        "{{mode}} {{workload}} j={{position}}",
                    ),
                ),
                unit="percentunit",
                min=0,
                max=1,
            ),
            PanelSpec(
                "Verify-window distribution",
                "heatmap",
                "How many request-steps verified each window size verify_len (1..gamma+1, "
                "anchor included) per interval: the scheduler's window choice over time.",
                (
                    Query(
                        f"sum by (le) (increase(dspark_verify_window_tokens_bucket{{{SEL}}}"
                        f"[{RATE}]))",
                        "{{le}}",
                        heatmap=True,
                    ),
                ),
            ),
            PanelSpec(
                "Mean window and budget",
                "timeseries",
                "Mean verify window per mode and workload (5m), and the scheduler's mean "
                "extra-token budget per step.",
                (
                    Query(
                        _recorded(f"{U}:dspark_verify_window_tokens:mean_rate5m"),
                        "window {{mode}} {{workload}}",
                    ),
                    Query(
                        _ratio(
                            "dspark_step_budget_tokens_total",
                            "dspark_steps_total",
                            "mode",
                            sel=STEP_SEL,
                        ),
                        "budget {{mode}}",
                    ),
                ),
                unit="short",
                min=0,
            ),
            PanelSpec(
                "Mean batch size",
                "timeseries",
                "Running requests per decode step.",
                (
                    Query(
                        _ratio(
                            "dspark_step_requests_total", "dspark_steps_total", "mode", sel=STEP_SEL
                        ),
                        "{{mode}}",
                    ),
                ),
                unit="short",
                min=0,
            ),
        ),
    ),
    (
        "Calibration and cost model",
        (
            PanelSpec(
                "ECE per position (last 1h)",
                "bargauge",
                "Expected calibration error of survival S_j per draft position over the last "
                "hour, per mode and workload: 15 equal-width bins, sum_b |sum pred - sum "
                "label| / N, as SGLang's STS fitter computes it.",
                (
                    Query(
                        _recorded(f"{UP}:dspark_calibration_ece:increase1h"),
                        "{{mode}} {{workload}} j={{position}}",
                        instant=True,
                    ),
                ),
                unit="short",
                min=0,
                max=0.5,
                width=8,
            ),
            PanelSpec(
                "Predicted vs measured step time",
                "timeseries",
                "Mean step time the cost table predicted and the measured mean over the same "
                "steps, their mean absolute error, and the relative error over 5m (the "
                "series the DSparkStepTimeDrift alert watches).",
                (
                    Query(
                        _ratio(
                            "dspark_step_predicted_seconds_total",
                            "dspark_step_predicted_steps_total",
                            "mode",
                            sel=STEP_SEL,
                        ),
                        "predicted {{mode}}",
                    ),
                    Query(
                        _ratio(
                            "dspark_step_measured_seconds_total",
                            "dspark_step_predicted_steps_total",
                            "mode",
                            sel=STEP_SEL,
                        ),
                        "measured {{mode}}",
                    ),
                    Query(
                        _ratio(
                            "dspark_step_prediction_abs_error_seconds_total",
                            "dspark_step_predicted_steps_total",
                            "mode",
                            sel=STEP_SEL,
                        ),
                        "abs error {{mode}}",
                    ),
                    Query(
                        _recorded("model_mode:dspark_step_prediction_error:ratio_rate5m", STEP_SEL),
                        "relative error {{mode}}",
                    ),  # fmt: skip
                ),
                unit="s",
                min=0,
                width=8,
            ),
            PanelSpec(
                "Rejected records",
                "stat",
                "Rows refused by schema validation over the time range, all tables and reasons "
                "(0 when none was refused).",
                (
                    Query(
                        "sum(increase(dspark_records_rejected_total[$__range])) or vector(0)",
                        "rejected",
                        instant=True,
                    ),
                ),
                unit="short",
                width=8,
            ),
        ),
    ),
    (
        "Throughput and latency",
        (
            PanelSpec(
                "Committed tokens/s",
                "timeseries",
                "Tokens committed per second (bonus included), per mode and workload.",
                (
                    Query(
                        _rate("dspark_committed_tokens_total", "mode, workload"),
                        "{{mode}} {{workload}}",
                    ),
                ),
                unit="short",
                width=8,
            ),
            PanelSpec(
                "Accept length",
                "timeseries",
                "Committed tokens per request-step (acc_len, bonus included); no data "
                "without traffic.",
                (
                    Query(
                        _ratio(
                            "dspark_committed_tokens_total",
                            "dspark_req_steps_total",
                            "mode, workload",
                        ),
                        "{{mode}} {{workload}}",
                    ),
                ),
                unit="short",
                width=8,
                min=0,
            ),
            PanelSpec(
                "Finished requests/s",
                "timeseries",
                "Requests finished per second by finish reason (stop | length | abort).",
                (
                    Query(
                        _rate("dspark_requests_total", "mode, finish_reason"),
                        "{{mode}} {{finish_reason}}",
                    ),
                ),
                unit="reqps",
                width=8,
            ),
            _latency_quantiles_panel(
                "TTFT",
                "dspark_time_to_first_token_seconds",
                "Time to first token (arrival to first token): histogram_quantile over the "
                "bucketed histogram, so an estimate within its bucket (buckets from 1 ms to "
                "10 min); the Streamlit pages show exact quantiles from the store.",
            ),
            _latency_quantiles_panel(
                "TPOT",
                "dspark_time_per_output_token_seconds",
                "Time per output token, first token excluded (SGLang bench_serving's TPOT): "
                "histogram_quantile over buckets from 1 ms to 30 s.",
            ),
        ),
    ),
)


def _target(q: Query, ref: str) -> prometheus.Dataquery:
    t = prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(ref).datasource(DS)
    if q.instant:
        t = t.instant()
    if q.heatmap:
        t = t.format(PromQueryFormat.HEATMAP)
    return t


def _panel(p: PanelSpec):
    if p.kind == "heatmap":
        b = (
            heatmap.Panel()
            .calculate(False)
            .color(heatmap.HeatmapColorOptions().scheme("Blues").steps(64))
            .y_axis(heatmap.YAxisConfig().unit("short"))
            .show_legend()
        )
    elif p.kind == "bargauge":
        b = (
            bargauge.Panel()
            .orientation(mcommon.VizOrientation.HORIZONTAL)
            .display_mode(mcommon.BarGaugeDisplayMode.GRADIENT)
            .reduce_options(gcommon.ReduceDataOptions().calcs(["lastNotNull"]))
        )
    elif p.kind == "stat":
        b = stat.Panel().reduce_options(gcommon.ReduceDataOptions().calcs(["lastNotNull"]))
    else:
        legend = (
            gcommon.VizLegendOptions()
            .show_legend(True)
            .display_mode(mcommon.LegendDisplayMode.LIST)
            .placement(mcommon.LegendPlacement.BOTTOM)
        )
        b = timeseries.Panel().line_width(1).fill_opacity(10).legend(legend)
    b = b.title(p.title).description(p.description).datasource(DS).span(p.width).height(p.height)
    if p.unit:
        b = b.unit(p.unit)
    if p.min is not None:
        b = b.min(p.min)
    if p.max is not None:
        b = b.max(p.max)
    for i, q in enumerate(p.queries):
        b = b.with_target(_target(q, chr(ord("A") + i)))
    return b


def _label_variable(name: str, label: str, metric: str) -> gdash.QueryVariable:
    return (
        gdash.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query({"query": f"label_values({metric}, {name})", "refId": "vars"})
        .definition(f"label_values({metric}, {name})")
        .refresh(mdash.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(mdash.VariableOption(selected=True, text="All", value="$__all"))
        .sort(mdash.VariableSort.ALPHABETICAL_ASC)
    )


def build_dashboard() -> dict:
    """The dashboard as the JSON object Grafana's file provisioning reads."""
    d = (
        gdash.Dashboard("DSpark speculative decoding")
        .uid(UID)
        .description(
            "Live DSpark metrics from dspark-obs (dspark-obs serve /metrics): acceptance, "
            "windows, acceptance ceiling, estimator, calibration, cost model, latency."
        )
        .tags(["dspark", "speculative-decoding", "dspark-obs"])
        .editable()
        .timezone("browser")
        .time("now-30m", "now")
        .refresh("10s")
        .with_variable(
            gdash.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
        )
        .with_variable(_label_variable("model", "Model", "dspark_steps_total"))
        .with_variable(_label_variable("mode", "Mode", "dspark_steps_total"))
        .with_variable(_label_variable("workload", "Workload", "dspark_req_steps_total"))
    )
    for row, panels in PANELS:
        d = d.with_row(gdash.Row(row))
        for p in panels:
            d = d.with_panel(_panel(p))
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    """Write (default) or --check the committed JSON."""
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python {Path(__file__).relative_to(Path.cwd())}")
            return 1
        print(f"{OUT} is up to date")
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT} ({sum(len(p) for _, p in PANELS)} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
