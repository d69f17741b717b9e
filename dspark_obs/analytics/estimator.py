"""Block-accept estimator: the acceptance ceiling from a ``compact`` run alone.

What SGLang 0.5.23 does (dspark_components/dspark_block_accept_estimator.py), read line by
line and restated here as the contract this module reproduces:

* One record per request per verify step: ``w`` = verify_len - 1 (drafts verified; the
  anchor is not counted), ``cl`` = correct drafts (0..w), ``ct`` = cap_trim, ``fct``.
* A block is *censored* when cl == w < gamma: the whole window was accepted and drafts
  w+1..gamma (1-based) were never verified. It opens a pending block and the record carries
  ``trimmed_tokens`` = draft_tokens[w:gamma] (0-based slice, i.e. draft positions
  w+1..gamma) and ``q_lp`` = the drafter's log-prob of each of them (log-softmax of the
  drafter's corrected logits at the draft temperature).
* Offsets k are 1-based draft positions of the block (SGLang's, and schema.PG_TYPE's): the
  pending block starts at k = w+1, and trimmed_tokens[k - w - 1] is the draft at k. The
  draft at k sits at absolute position anchor_pos + k, anchor_pos = prefix_len - 1 of the
  opening step (SGLang's prefix_lens count the anchor).
* Resolution: at every later step of the request (and at the opening step itself: its own
  bonus token lands on offset w+1) each pending block, oldest first, walks k upward while
  the target position is among the tokens committed this step: row = anchor_pos + k -
  prefix_len_now (row 0 = the anchor row of the current verify, predicting the first new
  position), resolvable while row <= cl_now. Each resolved offset appends a ``pg`` entry
  ``[src_fct, k, target_logprob, draft_token, realized_token]`` to the *current* step's
  record, where target_logprob = log-softmax(target logits at that row / max(T, 1e-5)) of
  the trimmed draft token and realized_token = (drafts[:cl] + [bonus])[row] of the current
  step. The walk for a block stops at the first k whose realized token differs from the
  draft (that k *is* resolved and counted), or at k = gamma.
* Per resolved k: a_k = min(1, exp(target_logprob - q_lp[k - w - 1])), P = running product
  over the block's resolved offsets (diverging one included), lo = w + 1 + sum P.
* Finalization and categories (hi = lo + tail):
  - ``exact_in_window``: cl < w or w == gamma: lo = hi = cl + 1, nothing pending.
  - ``resolved``: every offset up to gamma resolved without divergence: tail 0.
  - ``diverged``: walk stopped at a mismatch k_div: tail = P * (gamma - k_div).
  - ``eos``: request ended on a natural stop with the block pending (SGLang writes
    ``{"rid", "eos_end": [fct, ...]}`` listing them): tail 0, nothing follows EOS.
  - ``at_end``: still pending otherwise (length limit, abort, a seq-len discontinuity or a
    skipped step, state expiry): tail = P * (gamma - k_last), k_last = last resolved offset
    (w when none), i.e. P times the number of unresolved offsets.
  SGLang averages lo and hi over blocks (one block per request-step) and logs
  ``est uncap acc len: mid [lo, hi]`` with mid = (lo + hi) / 2. It writes no record for
  greedy or top-k/top-p/min-p rows and skips whole steps with penalties, grammar or logit
  bias; ``ct`` is a measurement only in cap-accept runs.

Offline, the same numbers come from the records alone: group ``pg`` entries by (request,
src_fct), sort by k, walk. Floating point follows SGLang's order (double precision,
lo = (w + 1.0) + running sum), so parity is exact, not approximate.

Two conventions for "the ceiling" of a step, and which number uses which:
* SGLang's bracket counts from cl + 1 (exact blocks) and w + 1 (censored blocks) even on a
  request's last step, whose commit EOS or the length limit may have cut. Its
  apples-to-apples truth is the *uncut* companion ceiling correct_drafts + 1 + cap_trim.
* DESIGN.md's ceiling is acc_len + cap_trim (what SGLang's spec_block_accept_length
  reports too). ``point`` and ``greedy_*`` use it: their base is the committed length.
The two differ only on cut final steps.

Beyond SGLang:
* ``greedy_*``: under greedy decoding the realized token at offset k equals the draft iff a
  full-block verify would have accepted it (both are the target's argmax after the same
  prefix), so the number of matched offsets *is* the companion's cap_trim: resolved and
  diverged blocks give the ceiling exactly, ``greedy_ceiling`` = committed + matched;
  at_end and eos blocks are bounded by [greedy_lo, greedy_hi] (the bound ignores SGLang's
  "nothing after EOS", because cap_trim does not stop at EOS either).
* ``point``: committed + sum P + P times the expected leading accepts of the unresolved
  tail, whose conditional acceptance comes from a tail model
  (:mod:`dspark_obs.analytics.estimator_tail`; default ``auto``: chosen from the data,
  usually ``calibrated``, which maps each block's own confidence to acceptance with a fit on
  this run's verified positions and resolved trimmed offsets, so the low-confidence blocks
  compact trims are not filled with the acceptance of the ones it kept). Resolved blocks get
  no fill; eos blocks do (the companion's cap_trim does not stop at EOS). Outside cut final
  steps and eos blocks it lies within [lo, hi].
* ``chain_p`` per block: the conditional acceptance probabilities of the offsets after
  the committed base (resolved a_k, then the tail model's rates; empty for exact blocks),
  so the realized ceiling is committed + number of leading accepted offsets and ``point``
  is its expectation; ``tail_conf`` holds the block's confidences at the tail offsets, so
  summaries can redraw the tail model (see :mod:`dspark_obs.analytics.estimator_summary`
  for point_ci / pred_ci / companion_ci).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from dspark_obs.analytics._frames import (
    FrameLike,
    as_frame,
    column,
    is_missing,
    list_matrix,
    request_key,
    request_key_array,
    text_column,
)
from dspark_obs.analytics.calibration import position_labels
from dspark_obs.analytics.estimator_jsonl import (  # noqa: F401 - re-exported
    JsonlError,
    parse_estimator_lines,
    read_estimator_jsonl,
)
from dspark_obs.analytics.estimator_recorder import (  # noqa: F401 - re-exported
    BlockAcceptRecorder,
    sglang_skip_mask,
    sglang_skips_estimator,
)
from dspark_obs.analytics.estimator_summary import (  # noqa: F401 - re-exported
    CATEGORIES,
    SUMMARY_COLUMNS,
    BlockEstimate,
    chain_survival,
    draw_leading,
    sample_ceilings,
    summarize_blocks,
)
from dspark_obs.analytics.estimator_tail import OBS_COLUMNS, TAIL_MODELS, TailModel, fit_tail
from dspark_obs.analytics.estimator_validation import (  # noqa: F401 - re-exported
    coverage,
    validate_estimator,
)
from dspark_obs.analytics.sts import apply_sts, logit

BLOCK_COLUMNS = (
    "run_id",
    "rid",
    "workload",
    "forward_ct",
    "step",
    "gamma",
    "verified",
    "correct",
    "committed",
    "censored",
    "category",
    "n_resolved",
    "last_k",
    "p_last",
    "lo",
    "hi",
    "mid",
    "tail_fill",
    "point",
    "greedy_lo",
    "greedy_hi",
    "greedy_ceiling",
    "greedy_exact",
    "chain_p",
    "tail_conf",
)


# ---------------------------------------------------------------- consumer side


def _pg_tuple(e: Any) -> tuple[int, int, float, int, int]:
    if isinstance(e, Mapping):
        return (
            int(e["src_fct"]),
            int(e["k"]),
            float(e["target_logprob"]),
            int(e["draft_token"]),
            int(e["realized_token"]),
        )
    a, b, c, d, f = e
    return int(a), int(b), float(c), int(d), int(f)


def _seq(v: Any) -> list | None:
    if is_missing(v):
        return None
    return list(v)


def _row_confidence(
    df: pd.DataFrame, width: int, sts_temperatures: Sequence[float] | None
) -> np.ndarray:
    """Each row's c_j [n, width] (NaN where absent), optionally re-scaled by STS temperatures."""
    if "confidence" not in df.columns:
        return np.full((len(df), width), np.nan)
    conf = list_matrix(df["confidence"], width)
    if sts_temperatures is not None:
        t = np.asarray(sts_temperatures, dtype=np.float64)
        if t.size != width:
            raise ValueError(f"{t.size} STS temperatures for gamma {width}")
        ok = ~np.isnan(conf)
        conf = np.where(ok, apply_sts(logit(np.nan_to_num(conf, nan=0.5)), t), np.nan)
    return conf


def _verified_observations(
    df: pd.DataFrame, conf: np.ndarray, runs: Any, mode: str | None
) -> pd.DataFrame:
    """Tail-model observations from verified positions: at risk (drafts 1..j-1 accepted),
    label 1 when draft j was accepted. Censoring-aware: unverified positions are absent."""
    labels = position_labels(df, runs=runs, mode=mode)
    lab = labels.loc[labels["at_risk"].to_numpy(bool)]
    key = pd.MultiIndex.from_arrays([df["run_id"], df["rid"], column(df, "forward_ct", -1)])
    row = key.get_indexer(pd.MultiIndex.from_arrays([lab["run_id"], lab["rid"], lab["forward_ct"]]))
    pos = lab["position"].to_numpy(np.int64)
    c = np.where(row >= 0, conf[np.maximum(row, 0), pos - 1], np.nan) if len(lab) else pos * 1.0
    return pd.DataFrame(
        {
            "request": request_key_array(
                lab["run_id"].to_numpy(dtype=object), lab["rid"].to_numpy(dtype=object)
            ),
            "workload": lab["workload"].to_numpy(),
            "position": pos,
            "conf": c,
            "y": lab["label"].to_numpy(np.float64),
            "resolved": np.zeros(len(lab), dtype=bool),
        },
        columns=list(OBS_COLUMNS),
    )


def sglang_skipped_rows(df: pd.DataFrame) -> np.ndarray:
    """Rows SGLang's estimator recorder writes nothing for (:func:`sglang_skip_mask`).

    Columns that are absent (e.g. SGLang's own JSONL, which holds only recorded rows) skip
    nothing. SGLang's min-p test has no counterpart: the engine does not sample with min-p.
    """

    def col(name: str) -> np.ndarray:
        if name not in df.columns:
            return np.full(len(df), np.nan)
        return pd.to_numeric(df[name], errors="coerce").to_numpy(np.float64)

    return sglang_skip_mask(col("temperature"), col("top_k"), col("top_p"))


def estimate_blocks(
    rows: FrameLike,
    requests: FrameLike | None = None,
    gamma: int | None = None,
    tail: str = "auto",
    sts_temperatures: Sequence[float] | None = None,
    runs: Any = None,
    mode: str | None = None,
    rows_from: str = "all",
    seed: int = 0,
    tail_model: TailModel | None = None,
) -> BlockEstimate:
    """One block per request-step: SGLang's bracket, the greedy ceiling and a point estimate.

    ``rows``: req_steps of a compact run (schema columns: rid, forward_ct, verify_len,
    correct_drafts, gamma, trimmed_tokens, q_lp, pg, workload, acc_len, confidence) or the
    frame of :func:`read_estimator_jsonl`. EOS: a boolean ``eos_end`` column when present
    (JSONL), else ``requests.finish_reason == "stop"`` marks a request's still-pending blocks.
    ``tail``: one of ``TAIL_MODELS`` (what fills unresolved offsets of point; see
    :mod:`dspark_obs.analytics.estimator_tail`); the fitted model is ``.tail_model``.
    ``chain_p`` (per block): conditional acceptance probabilities of offsets after the
    committed base, resolved a_k then tail rates; point = committed + sum of their running
    products, a realization = committed + leading accepted (see pred_ci / companion_ci).
    ``rows_from``: "all" (every row: the engine records log p of the processed target
    distribution, exact under top-k / top-p too) or "sglang" (drop greedy and top-k / top-p
    rows first, as SGLang's recorder never writes them: SGLang-parity numbers).
    ``seed``: the tail model's cross-validation folds (``auto``).
    ``tail_model``: a tail model fitted elsewhere (:func:`fit_tail`), used as it is instead of
    fitting one on these rows: a live sink fits a run's model at fixed points of the run's
    request count, so its sums do not depend on when its passes ran. These rows'
    observations are returned in ``.observations`` either way.
    """
    if rows_from not in ("all", "sglang"):
        raise ValueError(f"rows_from must be 'all' or 'sglang', got {rows_from!r}")
    if tail not in TAIL_MODELS:
        raise ValueError(f"tail must be one of {list(TAIL_MODELS)}, got {tail!r}")
    df = as_frame(rows)
    for c in ("rid", "forward_ct", "verify_len", "correct_drafts"):
        if c not in df.columns:
            raise ValueError(f"estimator input lacks column {c!r}")
    df = df.copy()
    if rows_from == "sglang":
        df = df[~sglang_skipped_rows(df)]
    df["run_id"] = text_column(df, "run_id", "")
    df["rid"] = text_column(df, "rid", "")
    df["workload"] = text_column(df, "workload", "unknown")
    if gamma is not None:
        df["gamma"] = int(gamma)
    elif "gamma" not in df.columns:
        raise ValueError("gamma is neither a column nor given")
    df = df.sort_values(["run_id", "rid", "forward_ct"], kind="stable").reset_index(drop=True)
    problems: list[str] = []

    n = len(df)
    run_id = df["run_id"].to_numpy()
    rid = df["rid"].to_numpy()
    fct = column(df, "forward_ct", -1).astype(np.int64)
    g_arr = column(df, "gamma", 0).astype(np.int64)
    v_arr = column(df, "verify_len", 1).astype(np.int64) - 1
    c_arr = column(df, "correct_drafts", 0).astype(np.int64)
    acc = column(df, "acc_len", np.nan)
    committed = np.where(np.isnan(acc), c_arr + 1.0, acc)
    step = df.groupby(["run_id", "rid"], sort=False).cumcount().to_numpy()
    width = int(g_arr.max()) if n else 0
    conf = _row_confidence(df, width, sts_temperatures)

    # EOS: explicit markers, or the request's finish reason
    if "eos_end" in df.columns:
        eos_row = np.array([bool(v) if not is_missing(v) else False for v in df["eos_end"]])
        eos_req: set[str] = set()
    else:
        eos_row = np.zeros(n, dtype=bool)
        rq = as_frame(requests)
        eos_req = set()
        if len(rq) and "finish_reason" in rq.columns:
            rr = rq.assign(run_id=text_column(rq, "run_id", ""), rid=text_column(rq, "rid", ""))
            eos_req = {
                request_key(a, b)
                for a, b, f in zip(rr["run_id"], rr["rid"], rr["finish_reason"], strict=True)
                if f == "stop"
            }

    # pg entries gathered per (request, src_fct), in record order
    entries: dict[tuple[str, str, int], list[tuple[int, float, int, int]]] = {}
    if "pg" in df.columns:
        for i, pg in enumerate(df["pg"]):
            if is_missing(pg):
                continue
            for e in pg:
                try:
                    src, k, lp, dtok, rtok = _pg_tuple(e)
                except (KeyError, TypeError, ValueError):
                    problems.append(f"rid={rid[i]} fct={fct[i]}: malformed pg entry {e!r}")
                    continue
                entries.setdefault((run_id[i], rid[i], src), []).append((k, lp, dtok, rtok))

    wl_arr = df["workload"].to_numpy()
    out = {
        c: np.full(n, np.nan)
        for c in (
            "p_last",
            "lo",
            "hi",
            "tail_fill",
            "point",
            "greedy_lo",
            "greedy_hi",
            "greedy_ceiling",
        )
    }
    category = np.empty(n, dtype=object)
    chain: list[list[float]] = [[] for _ in range(n)]
    tail_conf: list[list[float]] = [[] for _ in range(n)]
    n_res = np.zeros(n, dtype=np.int64)
    last_k = np.zeros(n, dtype=np.int64)
    censored = np.zeros(n, dtype=bool)
    exact = np.zeros(n, dtype=bool)
    trimmed_col = df["trimmed_tokens"] if "trimmed_tokens" in df.columns else [None] * n
    qlp_col = df["q_lp"] if "q_lp" in df.columns else [None] * n
    used: set[tuple[str, str, int]] = set()
    resolved_obs: list[tuple[str, str, int, float, float]] = []

    for i in range(n):
        g, w, cl = int(g_arr[i]), int(v_arr[i]), int(c_arr[i])
        if cl < w or w >= g:
            category[i] = "exact_in_window"
            out["lo"][i] = out["hi"][i] = cl + 1.0
            out["p_last"][i] = 1.0
            last_k[i] = w
            out["tail_fill"][i] = 0.0
            out["point"][i] = committed[i]
            out["greedy_lo"][i] = out["greedy_hi"][i] = out["greedy_ceiling"][i] = committed[i]
            exact[i] = True
            continue
        censored[i] = True
        key = (run_id[i], rid[i], int(fct[i]))
        used.add(key)
        trimmed, q = _seq(trimmed_col[i]), _seq(qlp_col[i])
        ents = sorted(entries.get(key, []), key=lambda e: e[0])
        if trimmed is None or q is None or len(trimmed) != g - w or len(q) != g - w:
            problems.append(
                f"rid={rid[i]} fct={fct[i]}: censored block (w={w}, cl={cl}, gamma={g}) lacks "
                f"trimmed_tokens/q_lp of length {g - w}; its offsets count as unresolved"
            )
            trimmed, q, ents = None, None, []
        prod, extra, k_last, matched, diverged = 1.0, 0.0, w, 0, False
        probs: list[float] = []
        req = request_key(run_id[i], rid[i])
        for k, lp, dtok, rtok in ents:
            if k != k_last + 1:
                hint = (
                    " (k looks 0-based within trimmed_tokens; SGLang's k is the 1-based draft"
                    " position w+1..gamma)"
                    if k_last == w and k == 0
                    else ""
                )
                problems.append(
                    f"rid={rid[i]} block fct={fct[i]}: pg offset {k} after {k_last} "
                    f"(expected {k_last + 1}); rest ignored{hint}"
                )
                break
            if trimmed is not None and dtok != trimmed[k - w - 1]:
                problems.append(
                    f"rid={rid[i]} block fct={fct[i]}: pg draft_token {dtok} at k={k} "
                    f"!= trimmed token {trimmed[k - w - 1]}"
                )
            a = min(1.0, math.exp(lp - float(q[k - w - 1])))
            probs.append(a)
            resolved_obs.append((req, wl_arr[i], k, float(conf[i, k - 1]), a))
            prod *= a
            extra += prod
            k_last = k
            if rtok != dtok:
                diverged = True
                break
            matched += 1
        base = w + 1.0
        lo = base + extra
        eos = bool(eos_row[i]) or req in eos_req
        if diverged:
            cat, tail_n = "diverged", g - k_last
        elif k_last >= g:
            cat, tail_n = "resolved", 0
        elif eos:
            cat, tail_n = "eos", 0
        else:
            cat, tail_n = "at_end", g - k_last
        category[i] = cat
        n_res[i] = k_last - w
        last_k[i] = k_last
        out["p_last"][i] = prod
        out["lo"][i] = lo
        out["hi"][i] = lo + prod * tail_n if tail_n > 0 else lo
        # greedy: a realized token equal to the draft is exactly a full-verify accept, so
        # matched == the companion's cap_trim; the base is what was committed (DESIGN's
        # ceiling acc_len + cap_trim, also on a request's cut final step)
        glo = committed[i] + matched
        out["greedy_lo"][i] = glo
        if cat in ("resolved", "diverged"):
            out["greedy_hi"][i] = out["greedy_ceiling"][i] = glo
            exact[i] = True
        else:
            out["greedy_hi"][i] = glo + (g - k_last)
        chain[i] = probs
        # the tail the point estimate fills: SGLang's at_end / diverged tail, and eos blocks
        # too (the companion's cap_trim counts accepts past EOS)
        if k_last < g and (tail_n > 0 or eos):
            tail_conf[i] = [float(x) for x in conf[i, k_last:g]]
        out["point"][i] = committed[i] + extra
        out["tail_fill"][i] = 0.0

    for key in sorted(set(entries) - used):
        problems.append(
            f"rid={key[1]}: pg entries for src_fct={key[2]}, which is not a censored block here"
        )

    # fit the tail model on verified positions and resolved trimmed offsets, then fill
    obs = pd.concat(
        [
            _verified_observations(df, conf, runs, mode) if tail != "none" else None,
            pd.DataFrame(
                [(r, w, k, c, a, True) for r, w, k, c, a in resolved_obs],
                columns=list(OBS_COLUMNS),
            ),
        ],
        ignore_index=True,
    )
    model = tail_model if tail_model is not None else fit_tail(tail, obs, max(width, 1), seed=seed)
    has_tail = np.flatnonzero([len(t) > 0 for t in tail_conf])
    if has_tail.size:
        fill_tails(model, has_tail, last_k, tail_conf, wl_arr, chain, out)

    blocks = pd.DataFrame(
        {
            "run_id": run_id,
            "rid": rid,
            "workload": wl_arr,
            "forward_ct": fct,
            "step": step,
            "gamma": g_arr,
            "verified": v_arr,
            "correct": c_arr,
            "committed": committed,
            "censored": censored,
            "category": category,
            "n_resolved": n_res,
            "last_k": last_k,
            "p_last": out["p_last"],
            "lo": out["lo"],
            "hi": out["hi"],
            "mid": 0.5 * (out["lo"] + out["hi"]),
            "tail_fill": out["tail_fill"],
            "point": out["point"],
            "greedy_lo": out["greedy_lo"],
            "greedy_hi": out["greedy_hi"],
            "greedy_ceiling": out["greedy_ceiling"],
            "greedy_exact": exact,
            "chain_p": chain,
            "tail_conf": tail_conf,
        },
        columns=list(BLOCK_COLUMNS),
    )
    return BlockEstimate(blocks, problems, tail, model, obs)


def fill_tails(
    model: TailModel,
    idx: np.ndarray,
    last_k: np.ndarray,
    tail_conf: list[list[float]],
    workload: np.ndarray,
    chain: list[list[float]],
    out: dict[str, np.ndarray],
) -> None:
    """Append the tail model's rates to the chains of blocks ``idx`` and add P times the
    expected leading accepts of the tail to their point estimates."""
    lens = np.array([len(tail_conf[i]) for i in idx])
    width = int(lens.max())
    pos = last_k[idx][:, None] + 1 + np.arange(width)[None, :]
    cmat = np.array([tail_conf[i] + [np.nan] * (width - len(tail_conf[i])) for i in idx])
    valid = np.arange(width)[None, :] < lens[:, None]
    wl = np.broadcast_to(workload[idx][:, None], pos.shape)
    rates = np.where(valid, np.clip(model.rates(pos, cmat, wl), 0.0, 1.0), 0.0)
    fill = out["p_last"][idx] * np.cumprod(rates, axis=1).sum(axis=1)
    for j, i in enumerate(idx):
        chain[i] = chain[i] + [float(x) for x in rates[j, : lens[j]]]
    out["point"][idx] += fill
    out["tail_fill"][idx] = fill


def exact_greedy_ceiling(estimate: BlockEstimate | pd.DataFrame) -> pd.DataFrame:
    """Per block under greedy decoding: the exact ceiling where known, else [greedy_lo, greedy_hi].

    Valid only for greedy (temperature 0) runs; resolved, diverged and exact_in_window
    blocks are exact, at_end and eos blocks are bounded.
    """
    b = estimate.blocks if isinstance(estimate, BlockEstimate) else estimate
    return b[
        [
            "run_id",
            "rid",
            "workload",
            "forward_ct",
            "step",
            "category",
            "greedy_lo",
            "greedy_hi",
            "greedy_ceiling",
            "greedy_exact",
        ]
    ].copy()
