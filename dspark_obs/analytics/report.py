"""One report over a run (or several): what it holds and its three renderings.

JSON for machines, Markdown for PRs and notebooks, rich tables for the terminal. The numbers
are computed by :func:`~dspark_obs.analytics.report_build.build_report`; the CLI
(``dspark-obs report``) only loads frames from the store and calls it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from dspark_obs.analytics._frames import format_cell, jsonable, markdown_table
from dspark_obs.analytics.estimator_cells import describe_tail

WORKLOAD_KEYS = ("run_id", "workload")
WORKLOAD_CEILING = (
    "steps",
    "mean_window",
    "share_max_window",
    "share_window_le3",
    "mean_committed",
    "mean_ceiling",
    "utilization",
    "tokens_left",
)
WORKLOAD_ESTIMATE = (
    "est_lo",
    "est_mid",
    "est_hi",
    "bracket_truth",
    "truth_in_bracket",
    "est_point",
    "est_ci_lo",
    "est_ci_hi",
    "ece_raw",
    "ece_sts_before",
    "ece_sts",
    "sts_note",
)
WORKLOAD_TABLE = (*WORKLOAD_KEYS, *WORKLOAD_CEILING, *WORKLOAD_ESTIMATE)

# Short headers for the terminal and Markdown renderings of the workload table.
HEADERS = {
    "run_id": "run",
    "workload": "workload",
    "steps": "steps",
    "mean_window": "window",
    "share_max_window": "at max",
    "share_window_le3": "<=3",
    "mean_committed": "committed",
    "mean_ceiling": "ceiling",
    "utilization": "util",
    "tokens_left": "left",
    "est_lo": "est lo",
    "est_mid": "est mid",
    "est_hi": "est hi",
    "est_point": "est point",
    "est_ci_lo": "ci lo",
    "est_ci_hi": "ci hi",
    "bracket_truth": "uncut ceiling",
    "truth_in_bracket": "in [lo,hi]",
    "ece_raw": "ECE raw",
    "ece_sts_before": "ECE judged raw",
    "ece_sts": "ECE judged STS",
    "sts_note": "STS note",
}


@dataclass
class Report:
    """Everything the report shows, as frames; render with to_json / to_markdown / to_rich."""

    workloads: pd.DataFrame
    windows: pd.DataFrame
    window_histogram: pd.DataFrame
    budgets: pd.DataFrame
    calibration: pd.DataFrame
    conditional_acceptance: pd.DataFrame
    companion: pd.DataFrame
    divergences: pd.DataFrame
    estimator: pd.DataFrame
    validation: pd.DataFrame
    sts: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return jsonable(
            {
                "meta": self.meta,
                "warnings": self.warnings,
                "problems": self.problems,
                "workloads": self.workloads,
                "windows": self.windows,
                "window_histogram": self.window_histogram,
                "budgets": self.budgets,
                "calibration": self.calibration,
                "conditional_acceptance": self.conditional_acceptance,
                "sts": self.sts,
                "companion": self.companion,
                "divergences": self.divergences,
                "estimator": self.estimator,
                "validation": self.validation,
            }
        )

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def to_markdown(self) -> str:
        parts = ["# dspark-obs report", ""]
        if self.meta:
            parts += [
                f"- {k}: {format_cell(v)}"
                for k, v in self.meta.items()
                if not isinstance(v, dict | list)
            ]
            parts.append("")
        for w in self.warnings:
            parts.append(f"> **WARNING** {w}")
        if self.warnings:
            parts.append("")
        parts += ["## Per workload", "", markdown_table(self.workloads.rename(columns=HEADERS)), ""]
        parts += [
            "window = mean verify_len (anchor included); ceiling = acc_len + cap_trim from the "
            "cap-accept companion; est = block-accept estimate from the compact run alone (SGLang "
            "bracket [lo, hi], point and its bootstrap interval over requests). 'in [lo,hi]' is "
            "judged against the value printed beside it, the companion's *uncut* ceiling "
            "(correct_drafts + 1 + cap_trim, SGLang's convention; it differs from 'ceiling' only "
            "on requests' EOS- or length-cut final steps); point and its interval are judged "
            "against 'ceiling'. ECE: SGLang's 15-bin definition pooled over observed positions "
            "(raw: all requests); 'ECE judged raw' -> 'ECE judged STS' are on the same requests "
            "(held-out ones unless a calibration was given); 'STS note' flags too few of them "
            "or an ECE that got worse.",
            "",
        ]
        sections = [
            ("Calibration per position", self.calibration),
            ("Conditional acceptance per position", self.conditional_acceptance),
            ("Companion ceilings", self.companion),
            ("Estimator", self.estimator),
            ("Estimator vs companion truth", self.validation),
            ("Budgets per step", self.budgets),
        ]
        for title, frame in sections:
            if frame is not None and len(frame):
                parts += [f"## {title}", "", markdown_table(frame), ""]
        if self.meta.get("tail_models"):
            parts += ["## Estimator tail model", ""]
            parts += [f"- {line}" for line in self.tail_model_lines()] + [""]
        if self.sts:
            parts += ["## STS", ""]
            for run, info in self.sts.items():
                temps = ", ".join(f"{t:.3g}" for t in info.get("temperatures", []))
                ci = info.get("ece_after_ci")
                ci_text = f" [95%: {format_cell(ci[0])}, {format_cell(ci[1])}]" if ci else ""
                parts.append(
                    f"- {run}: temperatures [{temps}]; "
                    f"ECE {format_cell(info.get('ece_before'))} -> "
                    f"{format_cell(info.get('ece_after'))}{ci_text} "
                    f"({info.get('evaluation', '')}); verdict: **{info.get('verdict', 'ok')}**"
                )
                parts += [f"  - **CAVEAT** {c}" for c in info.get("caveats", [])]
            parts.append("")
        if len(self.divergences):
            parts += [
                "## Divergences (first 50)",
                "",
                markdown_table(self.divergences.head(50)),
                "",
            ]
        if self.problems:
            parts += ["## Data problems", ""] + [f"- {p}" for p in self.problems[:100]] + [""]
        return "\n".join(parts)

    def tail_model_lines(self) -> list[str]:
        """Per compact run: which tail model filled unresolved offsets, and the sweep cell
        (bench/bench_estimator_sweep.py) that measured the estimator where the run sits."""
        return [
            f"{run}: {describe_tail(info)}"
            for run, info in self.meta.get("tail_models", {}).items()
        ]

    def to_rich(self) -> Any:
        """A rich renderable (Group of tables): ``rich.print(report.to_rich())``."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        items: list[Any] = []
        for w in self.warnings:
            items.append(Text(f"WARNING: {w}", style="bold red"))

        def table(title: str, frame: pd.DataFrame, headers: dict[str, str] | None = None) -> Table:
            t = Table(title=title, show_lines=False)
            for c in frame.columns:
                t.add_column(
                    (headers or {}).get(c, str(c)),
                    justify="left" if frame[c].dtype == object else "right",
                )
            for row in frame.itertuples(index=False):
                t.add_row(*[format_cell(v) for v in row])
            return t

        # Two narrow tables rather than one wide one: readable in an 80-column terminal.
        w = self.workloads
        keys = [c for c in WORKLOAD_KEYS if c in w.columns]
        first = [c for c in WORKLOAD_CEILING if c in w.columns]
        second = [c for c in w.columns if c not in keys and c not in first]
        items.append(table("Windows and ceiling per workload", w[keys + first], HEADERS))
        items.append(table("Estimate (compact alone) and calibration", w[keys + second], HEADERS))
        if len(self.validation):
            v = self.validation
            vcols = [
                c
                for c in (
                    "run_id",
                    "workload",
                    "mean_lo",
                    "mean_hi",
                    "truth_mean_uncut",
                    "inside_bracket",
                    "mean_point",
                    "point_ci_lo",
                    "point_ci_hi",
                    "truth_mean_ceiling",
                    "point_pct_err",
                    "interval_covers",
                )
                if c in v.columns
            ]
            items.append(table("Estimator vs companion truth", v[vcols]))
        for line in self.tail_model_lines():
            items.append(Text(f"Estimator tail model: {line}"))
        if len(self.calibration):
            cols = [
                c
                for c in (
                    "run_id",
                    "workload",
                    "position",
                    "n",
                    "pred_mean",
                    "label_mean",
                    "ece",
                    "ece_lo",
                    "ece_hi",
                    "brier",
                    "auroc",
                )
                if c in self.calibration.columns
            ]
            items.append(table("Calibration per position", self.calibration[cols]))
        if self.problems:
            items.append(
                Text(f"{len(self.problems)} data problem(s); see JSON/Markdown", style="yellow")
            )
        return Group(*items)

    def print_rich(self, console: Any = None) -> None:
        from rich.console import Console

        (console or Console()).print(self.to_rich())
