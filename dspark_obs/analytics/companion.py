"""Pair a compact run with its cap-accept companion: the measured acceptance ceiling.

cap-accept verifies the whole block but commits only up to the window, so at every step it
commits what compact commits and also reports cap_trim = drafts accepted past the window.
ceiling = acc_len + cap_trim is what a full-block verify would have committed;
utilization = committed / ceiling; tokens left on the table = sum cap_trim.

Pairing is per request (rid, the same in both runs) and per step order within the request
(the k-th verify step of rid in one run against the k-th in the other; forward_ct values
may differ between runs). Under greedy decoding both runs must commit identical tokens at
identical steps: any difference is listed and raised as a :class:`CompanionDivergence`
warning, because every ceiling number after it is meaningless. Under sampling the runs
diverge by design; per-workload ceilings (from the cap-accept run alone) stay valid as
distributions, the per-step pairing does not.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dspark_obs.analytics._frames import FrameLike, as_frame, column, is_missing, text_column

DIVERGENCE_COLUMNS = ("rid", "step", "field", "compact", "cap_accept")
STEP_FIELDS = ("verify_len", "correct_drafts", "acc_len", "bonus_token", "draft_tokens")
REQUEST_FIELDS = ("output_tokens", "completion_tokens", "finish_reason")


class CompanionDivergence(UserWarning):
    """A greedy compact run and its cap-accept companion committed different things."""


@dataclass
class CompanionResult:
    """Paired steps, divergences, and the per-workload ceiling table."""

    steps: pd.DataFrame  # one row per (rid, step) present in either run
    divergences: pd.DataFrame  # rid, step (-1: request level), field, compact, cap_accept
    per_workload: pd.DataFrame  # see ceiling_summary
    greedy: bool | None  # None: no temperature information
    identical: bool  # no divergence at all
    alarm: bool  # greedy and not identical: the loud flag
    message: str


def find_companion(runs: FrameLike, compact_run_id: str) -> str | None:
    """run_id of the cap-accept run whose companion_of is ``compact_run_id`` (first if several)."""
    rf = as_frame(runs)
    if len(rf) == 0 or "companion_of" not in rf.columns:
        return None
    m = (rf["companion_of"] == compact_run_id) & (rf.get("mode", "cap-accept") == "cap-accept")
    ids = sorted(rf.loc[m, "run_id"].astype(str).tolist())
    return ids[0] if ids else None


def ordered_steps(req_steps: FrameLike) -> pd.DataFrame:
    """req_steps sorted per request by forward_ct, with ``step`` = 0, 1, ... per rid."""
    df = as_frame(req_steps)
    if "run_id" in df.columns and df["run_id"].nunique() > 1:
        raise ValueError(f"expected the rows of one run, got runs {sorted(df['run_id'].unique())}")
    df = df.copy()
    df["rid"] = text_column(df, "rid", "")
    df["workload"] = text_column(df, "workload", "unknown")
    df["forward_ct"] = column(df, "forward_ct", -1).astype(np.int64)
    df = df.sort_values(["rid", "forward_ct"], kind="stable").reset_index(drop=True)
    df["step"] = df.groupby("rid", sort=False).cumcount().astype(np.int64)
    return df


def step_ceilings(cap_req_steps: FrameLike) -> pd.DataFrame:
    """Per cap-accept step: committed (acc_len), cap_trim, ceiling = acc_len + cap_trim."""
    df = ordered_steps(cap_req_steps)
    acc = column(df, "acc_len", np.nan)
    trim = column(df, "cap_trim", 0)
    correct = column(df, "correct_drafts", np.nan)
    out = pd.DataFrame(
        {
            "rid": df["rid"],
            "workload": df["workload"],
            "step": df["step"],
            "forward_ct": df["forward_ct"],
            "verify_len": column(df, "verify_len", np.nan),
            "committed": acc,
            "cap_trim": trim,
            "ceiling": acc + trim,
            # SGLang's estimator convention: not cut by EOS / the length limit
            "ceiling_uncut": correct + 1.0 + trim,
        }
    )
    with np.errstate(invalid="ignore", divide="ignore"):
        out["utilization"] = out["committed"] / out["ceiling"]
    return out


def ceiling_summary(step_table: pd.DataFrame, by: Sequence[str] = ("workload",)) -> pd.DataFrame:
    """Per group: committed and ceiling totals and means, utilization two ways, tokens left.

    utilization = sum committed / sum ceiling (token-weighted: what throughput sees);
    mean_step_utilization = mean over steps of committed / ceiling (every step counts once).
    """
    by = list(by)
    cols = [
        *by,
        "steps",
        "requests",
        "committed",
        "ceiling",
        "tokens_left",
        "utilization",
        "mean_step_utilization",
        "mean_committed",
        "mean_ceiling",
        "mean_ceiling_uncut",
        "share_steps_trimmed",
    ]
    f = step_table.dropna(subset=["committed", "ceiling"])
    if len(f) == 0:
        return pd.DataFrame(columns=cols)
    f = f.assign(trimmed=f["cap_trim"] > 0, _all="all")
    if "ceiling_uncut" not in f.columns:
        f = f.assign(ceiling_uncut=np.nan)
    keys = by or ["_all"]
    out = (
        f.groupby(keys, sort=True)
        .agg(
            steps=("ceiling", "size"),
            requests=("rid", "nunique"),
            committed=("committed", "sum"),
            ceiling=("ceiling", "sum"),
            tokens_left=("cap_trim", "sum"),
            mean_step_utilization=("utilization", "mean"),
            mean_committed=("committed", "mean"),
            mean_ceiling=("ceiling", "mean"),
            mean_ceiling_uncut=("ceiling_uncut", "mean"),
            share_steps_trimmed=("trimmed", "mean"),
        )
        .reset_index()
    )
    out["utilization"] = out["committed"] / out["ceiling"]
    return out[cols]


def _same(a: object, b: object) -> bool:
    if is_missing(a) and is_missing(b):
        return True
    if is_missing(a) or is_missing(b):
        return False
    if isinstance(a, list | tuple | np.ndarray) or isinstance(b, list | tuple | np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


def _plain(v: object) -> object:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def _infer_greedy(*frames: pd.DataFrame | None) -> bool | None:
    temps: list[float] = []
    for f in frames:
        if f is not None and len(f) and "temperature" in f.columns:
            temps += [float(t) for t in f["temperature"] if not is_missing(t)]
    if not temps:
        return None
    return all(t == 0.0 for t in temps)


def pair_companion(
    compact_req_steps: FrameLike,
    cap_req_steps: FrameLike,
    compact_requests: FrameLike | None = None,
    cap_requests: FrameLike | None = None,
    greedy: bool | None = None,
    by: Sequence[str] = ("workload",),
) -> CompanionResult:
    """Pair the two runs step by step, check they committed the same, summarize ceilings."""
    a = ordered_steps(compact_req_steps)
    b = ordered_steps(cap_req_steps)
    ra = as_frame(compact_requests) if compact_requests is not None else None
    rb = as_frame(cap_requests) if cap_requests is not None else None
    if greedy is None:
        greedy = _infer_greedy(a, b, ra, rb)

    fields = [f for f in STEP_FIELDS if f in a.columns and f in b.columns]
    left = a[["rid", "step", "workload", "forward_ct", *fields]]
    right = b[["rid", "step", "workload", "forward_ct", *fields]]
    m = left.merge(right, on=["rid", "step"], how="outer", suffixes=("_c", "_a"), indicator=True)
    m = m.sort_values(["rid", "step"], kind="stable").reset_index(drop=True)

    div: list[dict] = []
    for r in m.to_dict("records"):
        if r["_merge"] != "both":
            side = "compact" if r["_merge"] == "left_only" else "cap-accept"
            div.append(
                {
                    "rid": r["rid"],
                    "step": int(r["step"]),
                    "field": "step",
                    "compact": side == "compact",
                    "cap_accept": side == "cap-accept",
                }
            )
            continue
        for f in fields:
            if not _same(r[f"{f}_c"], r[f"{f}_a"]):
                div.append(
                    {
                        "rid": r["rid"],
                        "step": int(r["step"]),
                        "field": f,
                        "compact": _plain(r[f"{f}_c"]),
                        "cap_accept": _plain(r[f"{f}_a"]),
                    }
                )
    if ra is not None and rb is not None and len(ra) and len(rb):
        rfields = [f for f in REQUEST_FIELDS if f in ra.columns and f in rb.columns]
        rm = ra.assign(rid=text_column(ra, "rid", "")).merge(
            rb.assign(rid=text_column(rb, "rid", "")),
            on="rid",
            how="outer",
            suffixes=("_c", "_a"),
            indicator=True,
        )
        for r in rm.sort_values("rid").to_dict("records"):
            if r["_merge"] != "both":
                div.append(
                    {
                        "rid": r["rid"],
                        "step": -1,
                        "field": "request",
                        "compact": r["_merge"] == "left_only",
                        "cap_accept": r["_merge"] == "right_only",
                    }
                )
                continue
            for f in rfields:
                if not _same(r[f"{f}_c"], r[f"{f}_a"]):
                    div.append(
                        {
                            "rid": r["rid"],
                            "step": -1,
                            "field": f,
                            "compact": _plain(r[f"{f}_c"]),
                            "cap_accept": _plain(r[f"{f}_a"]),
                        }
                    )
    divergences = pd.DataFrame(div, columns=list(DIVERGENCE_COLUMNS))

    caps = step_ceilings(b)
    steps = m[["rid", "step"]].copy()
    steps["workload"] = m["workload_a"].where(m["workload_a"].notna(), m["workload_c"])
    steps["forward_ct_compact"] = m["forward_ct_c"]
    steps["forward_ct_cap"] = m["forward_ct_a"]
    steps["acc_len_compact"] = m["acc_len_c"] if "acc_len_c" in m.columns else np.nan
    steps = steps.merge(
        caps.drop(columns=["workload", "forward_ct"]), on=["rid", "step"], how="left"
    )

    identical = len(divergences) == 0
    alarm = bool(greedy) and not identical
    n_req = divergences["rid"].nunique() if len(divergences) else 0
    if identical:
        message = "compact and cap-accept committed identical tokens at every paired step"
    elif greedy:
        first = divergences.iloc[0]
        message = (
            f"DIVERGENCE under greedy decoding: {len(divergences)} difference(s) in {n_req} "
            f"request(s); first: rid={first['rid']} step={first['step']} field={first['field']}. "
            "Ceilings paired per step are not trustworthy."
        )
        warnings.warn(message, CompanionDivergence, stacklevel=2)
    else:
        message = (
            f"{len(divergences)} difference(s) in {n_req} request(s); expected under sampling "
            "(per-workload ceilings remain valid, per-step pairing does not)"
        )
    return CompanionResult(
        steps=steps,
        divergences=divergences,
        per_workload=ceiling_summary(caps, by),
        greedy=greedy,
        identical=identical,
        alarm=alarm,
        message=message,
    )
