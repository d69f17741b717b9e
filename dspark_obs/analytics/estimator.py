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
* Offsets k are 1-based draft positions of the block: the pending block starts at
  k = w+1, and trimmed_tokens[k - w - 1] is the draft at k. (schema.PG_TYPE's comment calls
  k a 0-based offset inside the trimmed drafts; SGLang's is not, and this module follows
  SGLang.) The draft at k sits at absolute position anchor_pos + k, anchor_pos =
  prefix_len - 1 of the opening step (SGLang's prefix_lens count the anchor).
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
* ``point``: committed + sum P + the unresolved tail filled with conditional acceptance
  c_j (empirical per workload and position from the run's own censoring-aware labels, or
  the head's own confidences, optionally re-scaled by STS temperatures), times P; eos and
  resolved blocks get no fill. Outside cut final steps it lies within [lo, hi].
* a bootstrap interval over requests for the mean (seeded, percentile): ``point_ci``, an
  interval for the *expected* mean ceiling.
* ``chain_p`` per block: the conditional acceptance probabilities of the offsets after
  the committed base (resolved a_k, then the tail-fill rates; empty for exact blocks,
  nothing after EOS), so the realized ceiling is committed + number of leading accepted
  offsets and ``point`` is its expectation. ``pred_ci`` resamples requests *and* realizes
  every chain (seeded Monte Carlo): a predictive interval for the *realized* mean ceiling,
  which is what a cap-accept companion measures (each of its trims was a coin flip).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from dspark_obs.analytics._frames import (
    FrameLike,
    as_frame,
    bootstrap_indices,
    bootstrap_weights,
    column,
    is_missing,
    list_matrix,
    quantile_interval,
    request_key,
    text_column,
)
from dspark_obs.analytics.calibration import conditional_acceptance, position_labels
from dspark_obs.analytics.estimator_jsonl import (  # noqa: F401 - re-exported, moved here
    JsonlError,
    parse_estimator_lines,
    read_estimator_jsonl,
)
from dspark_obs.analytics.sts import apply_sts, logit

CATEGORIES = ("exact_in_window", "resolved", "diverged", "at_end", "eos")

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
)


# ---------------------------------------------------------------- producer side


@dataclass
class _Pending:
    src_fct: int
    anchor_pos: int
    verified: int
    trimmed: list[int]
    next_k: int


@dataclass
class _ReqState:
    expected_seq_len: int = -1
    pending: list[_Pending] = field(default_factory=list)


class BlockAcceptRecorder:
    """What an engine must write per request per step so its rows match SGLang's JSONL.

    Call :meth:`observe` once per request per verify step (after acceptance), and
    :meth:`finish` when the request ends. Unlike SGLang it also records greedy rows (that
    is what makes :func:`estimate_blocks`' greedy ceiling possible).
    """

    def __init__(self, gamma: int) -> None:
        self.gamma = int(gamma)
        self._states: dict[str, _ReqState] = {}

    def needed(self, rid: str, prefix_len: int, correct_drafts: int) -> list[tuple[int, int]]:
        """(row, token) pairs of *earlier* blocks whose target log-prob this step will need."""
        st = self._states.get(rid)
        if st is None or (st.expected_seq_len >= 0 and prefix_len != st.expected_seq_len):
            return []
        out = []
        for blk in st.pending:
            k = blk.next_k
            while k <= self.gamma:
                row = blk.anchor_pos + k - prefix_len
                if row > correct_drafts:
                    break
                out.append((row, blk.trimmed[k - blk.verified - 1]))
                k += 1
        return out

    def observe(
        self,
        rid: str,
        forward_ct: int,
        prefix_len: int,
        verify_len: int,
        correct_drafts: int,
        draft_tokens: Sequence[int],
        draft_logprobs: Sequence[float],
        bonus_token: int,
        target_logprob: Callable[[int, int], float],
    ) -> dict[str, Any]:
        """Settle this step; returns {"trimmed_tokens", "q_lp", "pg"} (None when absent).

        ``prefix_len``: sequence length before this step (SGLang's prefix_lens; the anchor
        is at prefix_len - 1). ``draft_logprobs``: log q of each drafted token at the draft
        temperature. ``target_logprob(row, token)``: log p of ``token`` at verify row
        ``row`` of this step (row 0 = the anchor's row) at the request's temperature
        (SGLang: log_softmax(logits / max(T, 1e-5))); only rows <= correct_drafts are asked.
        """
        g = self.gamma
        w = int(verify_len) - 1
        cl = int(correct_drafts)
        if not 0 <= cl <= w <= g:
            raise ValueError(
                f"need 0 <= correct_drafts <= verify_len-1 <= gamma, got {cl}, {w}, {g}"
            )
        st = self._states.setdefault(rid, _ReqState())
        if st.expected_seq_len >= 0 and prefix_len != st.expected_seq_len:
            st.pending = []  # SGLang finalizes them as at_end and writes nothing
        st.expected_seq_len = int(prefix_len) + cl + 1
        out: dict[str, Any] = {"trimmed_tokens": None, "q_lp": None, "pg": None}
        if cl == w and w < g:
            trimmed = [int(t) for t in draft_tokens[w:g]]
            out["trimmed_tokens"] = trimmed
            out["q_lp"] = [float(x) for x in draft_logprobs[w:g]]
            st.pending.append(_Pending(int(forward_ct), int(prefix_len) - 1, w, trimmed, w + 1))
        realized = [int(t) for t in draft_tokens[:cl]] + [int(bonus_token)]
        pg: list[dict[str, Any]] = []
        kept = []
        for blk in st.pending:
            diverged = False
            while blk.next_k <= g:
                row = blk.anchor_pos + blk.next_k - int(prefix_len)
                if row > cl:
                    break
                tok = blk.trimmed[blk.next_k - blk.verified - 1]
                pg.append(
                    {
                        "src_fct": blk.src_fct,
                        "k": blk.next_k,
                        "target_logprob": float(target_logprob(row, tok)),
                        "draft_token": tok,
                        "realized_token": realized[row],
                    }
                )
                blk.next_k += 1
                if realized[row] != tok:
                    diverged = True
                    break
            if not diverged and blk.next_k <= g:
                kept.append(blk)
        st.pending = kept
        out["pg"] = pg or None
        return out

    def finish(self, rid: str, natural_stop: bool) -> list[int]:
        """Forget the request; returns the src_fct of blocks still pending at a natural stop
        (SGLang's ``eos_end`` list), empty otherwise."""
        st = self._states.pop(rid, None)
        if st is None or not natural_stop:
            return []
        return [b.src_fct for b in st.pending]


# ---------------------------------------------------------------- consumer side


@dataclass
class BlockEstimate:
    """Per-block brackets and estimates, plus data problems found on the way."""

    blocks: pd.DataFrame
    problems: list[str]
    tail: str

    def summary(
        self,
        by: Sequence[str] = ("workload",),
        n_boot: int = 200,
        seed: int = 0,
        level: float = 0.95,
    ) -> pd.DataFrame:
        """:func:`summarize_blocks` of these blocks: point_ci bounds the expected mean
        ceiling, pred_ci the realized one (what a cap-accept companion measures)."""
        return summarize_blocks(self.blocks, by=by, n_boot=n_boot, seed=seed, level=level)


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


def _tail_rates(
    df: pd.DataFrame,
    tail: str,
    width: int,
    sts_temperatures: Sequence[float] | None,
    runs: Any,
    mode: str | None,
) -> tuple[np.ndarray | None, dict[str, np.ndarray], np.ndarray]:
    """Conditional acceptance for the tail fill: per row (confidence) or per workload."""
    labels = position_labels(df, runs=runs, mode=mode)
    pooled = np.full(width + 1, np.nan)
    per_wl: dict[str, np.ndarray] = {}
    ca = conditional_acceptance(labels, by=("workload", "position"))
    for r in ca.itertuples(index=False):
        per_wl.setdefault(str(r.workload), np.full(width + 1, np.nan))[int(r.position)] = (
            r.accept_rate
        )
    for r in conditional_acceptance(labels, by=("position",)).itertuples(index=False):
        pooled[int(r.position)] = r.accept_rate
    row_conf = None
    if tail == "confidence" and "confidence" in df.columns:
        row_conf = list_matrix(df["confidence"], width)
        if sts_temperatures is not None:
            t = np.asarray(sts_temperatures, dtype=np.float64)
            if t.size != width:
                raise ValueError(f"{t.size} STS temperatures for gamma {width}")
            ok = ~np.isnan(row_conf)
            row_conf = np.where(ok, apply_sts(logit(np.nan_to_num(row_conf, nan=0.5)), t), np.nan)
    return row_conf, per_wl, pooled


def sglang_skipped_rows(df: pd.DataFrame) -> np.ndarray:
    """Rows SGLang's estimator recorder writes nothing for: greedy, top-k or top-p sampling.

    Columns that are absent (e.g. SGLang's own JSONL, which holds only recorded rows) skip
    nothing. SGLang's min-p test has no counterpart: the engine does not sample with min-p.
    """
    skip = np.zeros(len(df), dtype=bool)
    if "temperature" in df.columns:
        t = pd.to_numeric(df["temperature"], errors="coerce").to_numpy(np.float64)
        skip |= ~np.isnan(t) & (t < 1e-6)  # SGLang's greedy threshold (_SAMPLING_EPS)
    if "top_k" in df.columns:
        k = pd.to_numeric(df["top_k"], errors="coerce").to_numpy(np.float64)
        skip |= ~np.isnan(k) & (k != -1)
    if "top_p" in df.columns:
        p = pd.to_numeric(df["top_p"], errors="coerce").to_numpy(np.float64)
        skip |= ~np.isnan(p) & (p != 1.0)
    return skip


def estimate_blocks(
    rows: FrameLike,
    requests: FrameLike | None = None,
    gamma: int | None = None,
    tail: str = "empirical",
    sts_temperatures: Sequence[float] | None = None,
    runs: Any = None,
    mode: str | None = None,
    rows_from: str = "all",
) -> BlockEstimate:
    """One block per request-step: SGLang's bracket, the greedy ceiling and a point estimate.

    ``rows``: req_steps of a compact run (schema columns: rid, forward_ct, verify_len,
    correct_drafts, gamma, trimmed_tokens, q_lp, pg, workload, acc_len, confidence) or the
    frame of :func:`read_estimator_jsonl`. EOS: a boolean ``eos_end`` column when present
    (JSONL), else ``requests.finish_reason == "stop"`` marks a request's still-pending blocks.
    ``tail``: "empirical" | "confidence" | "none" (what fills unresolved offsets of point).
    ``chain_p`` (per block): conditional acceptance probabilities of offsets after the
    committed base, resolved a_k then tail-fill rates; point = committed + sum of their
    running products, a realization = committed + leading accepted (see pred_ci).
    ``rows_from``: "all" (every row: the engine records log p of the processed target
    distribution, exact under top-k / top-p too) or "sglang" (drop greedy and top-k / top-p
    rows first, as SGLang's recorder never writes them: SGLang-parity numbers).
    """
    if rows_from not in ("all", "sglang"):
        raise ValueError(f"rows_from must be 'all' or 'sglang', got {rows_from!r}")
    if tail not in ("empirical", "confidence", "none"):
        raise ValueError(f"tail must be 'empirical', 'confidence' or 'none', got {tail!r}")
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

    row_conf, per_wl, pooled = (None, {}, np.full(width + 1, np.nan))
    if tail != "none":
        row_conf, per_wl, pooled = _tail_rates(df, tail, width, sts_temperatures, runs, mode)
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
    n_res = np.zeros(n, dtype=np.int64)
    last_k = np.zeros(n, dtype=np.int64)
    censored = np.zeros(n, dtype=bool)
    exact = np.zeros(n, dtype=bool)
    trimmed_col = df["trimmed_tokens"] if "trimmed_tokens" in df.columns else [None] * n
    qlp_col = df["q_lp"] if "q_lp" in df.columns else [None] * n
    used: set[tuple[str, str, int]] = set()

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
            prod *= a
            extra += prod
            k_last = k
            if rtok != dtok:
                diverged = True
                break
            matched += 1
        base = w + 1.0
        lo = base + extra
        if diverged:
            cat, tail_n = "diverged", g - k_last
        elif k_last >= g:
            cat, tail_n = "resolved", 0
        elif eos_row[i] or request_key(run_id[i], rid[i]) in eos_req:
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
        # point estimate: fill the unresolved offsets with conditional acceptance
        fill = 0.0
        if tail_n > 0 and tail != "none":
            rates = None
            if row_conf is not None and not np.isnan(row_conf[i, k_last:g]).any():
                rates = row_conf[i, k_last:g]
            else:
                wl = per_wl.get(wl_arr[i])
                cand = wl[k_last + 1 : g + 1] if wl is not None else np.full(g - k_last, np.nan)
                rates = np.where(np.isnan(cand), pooled[k_last + 1 : g + 1], cand)
                rates = np.nan_to_num(rates, nan=0.0)
            rates = np.clip(rates, 0.0, 1.0)
            fill = prod * float(np.cumprod(rates).sum())
            probs.extend(float(x) for x in rates)
        chain[i] = probs
        out["tail_fill"][i] = fill
        out["point"][i] = committed[i] + extra + fill

    for key in sorted(set(entries) - used):
        problems.append(
            f"rid={key[1]}: pg entries for src_fct={key[2]}, which is not a censored block here"
        )

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
        },
        columns=list(BLOCK_COLUMNS),
    )
    return BlockEstimate(blocks, problems, tail)


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


SUMMARY_COLUMNS = (
    "blocks",
    "requests",
    "censored_share",
    *[f"n_{c}" for c in CATEGORIES],
    "mean_committed",
    "mean_lo",
    "mean_mid",
    "mean_hi",
    "mean_point",
    "point_ci_lo",
    "point_ci_hi",
    "pred_ci_lo",
    "pred_ci_hi",
    "bracket_ci_lo",
    "bracket_ci_hi",
    "greedy_exact_share",
    "greedy_mean",
    "greedy_mean_lo",
    "greedy_mean_hi",
)


def chain_survival(chain_p: Sequence[Any] | pd.Series, width: int | None = None) -> np.ndarray:
    """Survival matrix [blocks, offsets]: S_j = prod_{i<=j} chain_p_i (0 past a chain's end).

    S_j = P(realized ceiling >= committed + j) of each block's acceptance chain.
    """
    values = list(chain_p)
    if width is None:
        width = max((len(v) for v in values if not is_missing(v)), default=0)
    p = np.clip(np.nan_to_num(list_matrix(values, width), nan=0.0), 0.0, 1.0)
    return np.cumprod(p, axis=1)


def draw_leading(surv: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Leading accepted offsets per block for uniforms ``u`` in [0, 1): L = #{j: u < S_j}.

    S is non-increasing along a row, so P(L >= j) = S_j: one uniform per block realizes the
    whole chain (offset j accepted with prob a_j given every earlier offset was).
    """
    s = np.asarray(surv, dtype=np.float64)
    u = np.asarray(u, dtype=np.float64)
    out = np.zeros(u.shape, dtype=np.int64)
    for j in range(s.shape[-1]):
        out += u < s[..., j]
    return out


def sample_ceilings(
    committed: np.ndarray | Sequence[float],
    chain_p: Sequence[Any] | pd.Series,
    rng: np.random.Generator,
    size: int | None = None,
) -> np.ndarray:
    """Draw realized ceilings committed + L per block: [blocks], or [size, blocks] draws.

    Same convention as ``point`` (DESIGN: acc_len + cap_trim), whose value is their mean.
    """
    base = np.asarray(committed, dtype=np.float64)
    surv = chain_survival(chain_p)
    shape = base.shape if size is None else (int(size), *base.shape)
    return base + draw_leading(surv, rng.random(shape))


def _predictive_means(
    codes: np.ndarray,
    n_req: int,
    committed: np.ndarray,
    surv: np.ndarray,
    n_boot: int,
    seed: int,
) -> np.ndarray:
    """Mean realized ceiling per bootstrap draw: requests resampled (the same draws as
    point_ci's), then every block of the resample realizes its chain independently."""
    idx = bootstrap_indices(n_req, n_boot, seed)
    wts = bootstrap_weights(n_req, n_boot, seed)
    rand = ((surv > 0.0) & (surv < 1.0)).any(axis=1)
    det = np.where(rand, 0.0, (surv >= 1.0).sum(axis=1))  # 0/1 chains: L is known
    total = wts @ np.bincount(codes, weights=committed + det, minlength=n_req)
    count = wts @ np.bincount(codes, minlength=n_req)
    if rand.any():
        ri = np.flatnonzero(rand)
        order = ri[np.argsort(codes[ri], kind="stable")]
        rs = surv[order]
        rc = np.bincount(codes[order], minlength=n_req)
        start = np.cumsum(rc) - rc
        flat = idx.ravel()
        reps = rc[flat]
        m = int(reps.sum())
        first = np.repeat(np.cumsum(reps) - reps, reps)  # where each request's run begins
        pos = np.repeat(start[flat], reps) + (np.arange(m) - first)
        draw = np.repeat(np.arange(n_boot), reps.reshape(n_boot, n_req).sum(axis=1))
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x9E3779B9]))
        u = rng.random(m)
        lead = np.zeros(m, dtype=np.int64)
        for j in range(rs.shape[1]):
            lead += u < rs[pos, j]
        total = total + np.bincount(draw, weights=lead, minlength=n_boot)
    return total / count


def summarize_blocks(
    blocks: pd.DataFrame,
    by: Sequence[str] = ("workload",),
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
) -> pd.DataFrame:
    """Means over blocks per group, with bootstrap intervals that resample whole requests.

    point_ci: percentile interval of the mean point estimate, i.e. of the *expected* mean
    ceiling (request sampling noise only). pred_ci: predictive percentile interval of the
    *realized* mean ceiling, what a cap-accept companion measures: each bootstrap draw
    resamples requests as point_ci does and then realizes every block's acceptance chain
    (``chain_p``) once, so it adds the Bernoulli noise of the accept coin flips; it equals
    point_ci where every chain is 0/1 (greedy, exact blocks) and is NaN without ``chain_p``.
    bracket_ci: lower percentile of mean lo to upper percentile of mean hi (covers sampling
    noise and the bracket's width together). greedy_mean is the mean exact ceiling, NaN
    unless every block is exact.
    """
    by = list(by)
    rows = []
    groups = [((), blocks)] if not by else blocks.groupby(by, sort=True)
    for key, g in groups:
        if len(g) == 0:
            continue
        key = key if isinstance(key, tuple) else (key,)
        row: dict[str, Any] = dict(zip(by, key, strict=True))
        reqs = np.array([request_key(a, b) for a, b in zip(g["run_id"], g["rid"], strict=True)])
        uniq, codes = np.unique(reqs, return_inverse=True)
        row["blocks"] = len(g)
        row["requests"] = int(uniq.size)
        row["censored_share"] = float(g["censored"].mean())
        for c in CATEGORIES:
            row[f"n_{c}"] = int((g["category"] == c).sum())
        for name in ("committed", "lo", "mid", "hi", "point"):
            row[f"mean_{name}"] = float(g[name].mean())
        if n_boot > 0:
            wts = bootstrap_weights(uniq.size, n_boot, seed)
            cnt = wts @ np.bincount(codes, minlength=uniq.size)
            means = {
                name: (
                    wts
                    @ np.bincount(
                        codes, weights=g[name].to_numpy(dtype=np.float64), minlength=uniq.size
                    )
                )
                / cnt
                for name in ("point", "lo", "hi")
            }
            row["point_ci_lo"], row["point_ci_hi"] = quantile_interval(means["point"], level)
            row["pred_ci_lo"] = row["pred_ci_hi"] = float("nan")
            if "chain_p" in g.columns:
                pred = _predictive_means(
                    codes,
                    uniq.size,
                    g["committed"].to_numpy(dtype=np.float64),
                    chain_survival(g["chain_p"]),
                    n_boot,
                    seed,
                )
                row["pred_ci_lo"], row["pred_ci_hi"] = quantile_interval(pred, level)
            row["bracket_ci_lo"] = quantile_interval(means["lo"], level)[0]
            row["bracket_ci_hi"] = quantile_interval(means["hi"], level)[1]
        else:
            for c in ("point_ci", "pred_ci", "bracket_ci"):
                row[f"{c}_lo"] = row[f"{c}_hi"] = float("nan")
        ex = g["greedy_exact"].to_numpy(dtype=bool)
        row["greedy_exact_share"] = float(ex.mean())
        row["greedy_mean"] = float(g["greedy_ceiling"].mean()) if ex.all() else float("nan")
        row["greedy_mean_lo"] = float(g["greedy_lo"].mean())
        row["greedy_mean_hi"] = float(g["greedy_hi"].mean())
        rows.append(row)
    return pd.DataFrame(rows, columns=[*by, *SUMMARY_COLUMNS])


# ---------------------------------------------------------------- validation


def _truth_table(truth: Any, by: Sequence[str]) -> pd.DataFrame:
    from dspark_obs.analytics.companion import CompanionResult, ceiling_summary, step_ceilings

    if isinstance(truth, CompanionResult):
        steps = truth.steps.dropna(subset=["ceiling"])
        return ceiling_summary(steps, by)
    f = as_frame(truth)
    if "mean_ceiling" in f.columns:
        return f
    if "ceiling" in f.columns:
        return ceiling_summary(f, by)
    return ceiling_summary(step_ceilings(f), by)


def validate_estimator(
    estimate: BlockEstimate | pd.DataFrame,
    companion_truth: Any,
    by: Sequence[str] = ("workload",),
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
    tol: float = 1e-9,
) -> pd.DataFrame:
    """Compare the compact-only estimate with the cap-accept companion's measured ceiling.

    ``estimate``: a BlockEstimate, its blocks frame, or a summarize_blocks frame.
    ``companion_truth``: a CompanionResult, step_ceilings frame, the cap-accept req_steps,
    or a ceiling_summary frame. Per group: truth mean ceiling (DESIGN: acc_len + cap_trim)
    and its uncut twin (correct_drafts + 1 + cap_trim), mean lo/mid/hi, point, errors, and
    whether bracket and intervals contain the truth. The bracket (SGLang's) is judged
    against the uncut truth, point / interval / greedy against DESIGN's; they differ only
    on requests' cut final steps. ``interval_covers`` judges point_ci (an interval for the
    expected mean ceiling), ``pred_interval_covers`` judges pred_ci (a predictive interval
    for the realized mean ceiling, which is what the companion measured).
    """
    by = list(by)
    if isinstance(estimate, BlockEstimate):
        est = estimate.summary(by, n_boot=n_boot, seed=seed, level=level)
    else:
        e = as_frame(estimate)
        est = (
            e
            if "mean_lo" in e.columns
            else summarize_blocks(e, by, n_boot=n_boot, seed=seed, level=level)
        )
    truth = _truth_table(companion_truth, by)
    if "mean_ceiling_uncut" not in truth.columns:
        truth = truth.assign(mean_ceiling_uncut=truth["mean_ceiling"])
    t = truth[[*by, "steps", "mean_ceiling", "mean_ceiling_uncut"]].rename(
        columns={
            "steps": "truth_steps",
            "mean_ceiling": "truth_mean_ceiling",
            "mean_ceiling_uncut": "truth_mean_uncut",
        }
    )
    m = (
        est.merge(t, on=by, how="outer")
        if by
        else est.assign(_k=0).merge(t.assign(_k=0), on="_k").drop(columns="_k")
    )
    truth_v = m["truth_mean_ceiling"]
    uncut = m["truth_mean_uncut"]
    out = pd.DataFrame({c: m[c] for c in by})
    out["truth_steps"] = m["truth_steps"]
    out["truth_mean_ceiling"] = truth_v
    out["truth_mean_uncut"] = uncut
    out["blocks"] = m["blocks"]
    for c in (
        "mean_lo",
        "mean_mid",
        "mean_hi",
        "mean_point",
        "point_ci_lo",
        "point_ci_hi",
        "pred_ci_lo",
        "pred_ci_hi",
        "bracket_ci_lo",
        "bracket_ci_hi",
        "greedy_mean",
    ):
        out[c] = m[c] if c in m.columns else float("nan")
    # SGLang's bracket lives in the uncut convention; point and greedy in DESIGN's
    out["inside_bracket"] = (m["mean_lo"] - tol <= uncut) & (uncut <= m["mean_hi"] + tol)
    out["bracket_interval_covers"] = (m["bracket_ci_lo"] - tol <= uncut) & (
        uncut <= m["bracket_ci_hi"] + tol
    )
    out["mid_abs_err"] = (m["mean_mid"] - uncut).abs()
    out["point_err"] = m["mean_point"] - truth_v
    out["point_abs_err"] = out["point_err"].abs()
    out["point_pct_err"] = 100.0 * out["point_abs_err"] / truth_v
    out["interval_covers"] = (m["point_ci_lo"] - tol <= truth_v) & (
        truth_v <= m["point_ci_hi"] + tol
    )
    out["pred_interval_covers"] = (out["pred_ci_lo"] - tol <= truth_v) & (
        truth_v <= out["pred_ci_hi"] + tol
    )
    out["greedy_err"] = m["greedy_mean"] - truth_v
    return out


def coverage(
    validations: Sequence[pd.DataFrame], by: Sequence[str] = ("workload",)
) -> pd.DataFrame:
    """Over replicate validations (e.g. seeds): how often bracket / intervals held the truth.

    interval_coverage: point_ci (expected mean); pred_interval_coverage: pred_ci (realized
    mean, the one to hold to the nominal level against a companion); mean widths of both.
    """
    by = list(by)
    allv = pd.concat([v.assign(_rep=i) for i, v in enumerate(validations)], ignore_index=True)
    for c in ("pred_ci_lo", "pred_ci_hi", "pred_interval_covers"):
        if c not in allv.columns:
            allv[c] = np.nan
    allv["_point_w"] = allv["point_ci_hi"] - allv["point_ci_lo"]
    allv["_pred_w"] = allv["pred_ci_hi"] - allv["pred_ci_lo"]
    allv["pred_interval_covers"] = allv["pred_interval_covers"].astype(np.float64)
    if not by:
        allv["_all"] = "all"
    keys = by or ["_all"]
    out = (
        allv.groupby(keys, sort=True)
        .agg(
            replicates=("_rep", "nunique"),
            inside_bracket_rate=("inside_bracket", "mean"),
            interval_coverage=("interval_covers", "mean"),
            pred_interval_coverage=("pred_interval_covers", "mean"),
            bracket_interval_coverage=("bracket_interval_covers", "mean"),
            point_ci_width=("_point_w", "mean"),
            pred_ci_width=("_pred_w", "mean"),
            mean_abs_err=("point_abs_err", "mean"),
            mean_pct_err=("point_pct_err", "mean"),
        )
        .reset_index()
    )
    return out.drop(columns=["_all"]) if not by else out
