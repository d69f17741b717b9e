"""Producer side of the block-accept estimator: what an engine writes per request per step.

The rows :class:`BlockAcceptRecorder` returns are SGLang 0.5.23's estimator JSONL fields
(``trimmed_tokens``, ``q_lp``, ``pg``); :mod:`dspark_obs.analytics.estimator` documents the
contract and reads them back. :func:`sglang_skips_estimator` is the one statement of which
requests SGLang's recorder writes nothing for; the engine, the SGLang collector and the
analytics all ask it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

SGLANG_SAMPLING_EPS = 1e-6
"""SGLang 0.5.23's ``_SAMPLING_EPS``: a temperature in [0, eps) is greedy (top_k = 1)."""

SGLANG_TOP_K_ALL = 1 << 30
"""SGLang's ``TOP_K_ALL``: top_k = -1 ("off") is normalized to it, and only it is untruncated."""


def sglang_skip_mask(
    temperature: np.ndarray | float, top_k: np.ndarray | float, top_p: np.ndarray | float
) -> np.ndarray:
    """Element-wise :func:`sglang_skips_estimator`; NaN in an input means "not recorded" and
    skips nothing on that account (e.g. SGLang's own JSONL holds only recorded rows).

    Why this rule, from SGLang 0.5.23's source: ``SamplingParams.__init__`` turns
    0 <= T < 1e-6 into top_k = 1 and top_k = -1 into TOP_K_ALL; the recorder drops a row
    when ``greedy_mask`` (top_ks <= 1) or ``truncated_sampling_mask`` (top_ks != TOP_K_ALL,
    top_ps != 1.0 compared in float32, min_ps > 0) is set. The engine never samples with
    min-p, so min-p has no input here.
    """
    t = np.asarray(temperature, dtype=np.float64)
    k = np.asarray(top_k, dtype=np.float64)
    p = np.asarray(top_p, dtype=np.float64)
    greedy = ~np.isnan(t) & (t < SGLANG_SAMPLING_EPS)
    k_cut = ~np.isnan(k) & (k != -1) & (k != SGLANG_TOP_K_ALL)  # top_k = 1 is greedy too
    with np.errstate(invalid="ignore"):
        p_cut = ~np.isnan(p) & (p.astype(np.float32) != np.float32(1.0))
    return greedy | k_cut | p_cut


def sglang_skips_estimator(temperature: float, top_k: int, top_p: float) -> bool:
    """Whether SGLang 0.5.23's block-accept recorder writes no row for a request sampled so:
    greedy (T < 1e-6), top-k (top_k not -1), or top-p (top_p not 1.0 in float32).

    Raises ValueError on settings SGLang itself refuses (negative or non-finite T, top_p
    outside (0, 1], top_k other than -1 or >= 1), so a bad value is never silently counted.
    """
    t, p = float(temperature), float(top_p)
    if not (math.isfinite(t) and t >= 0.0):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature!r}")
    if not 0.0 < p <= 1.0:  # also NaN
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if int(top_k) != top_k or (top_k != -1 and top_k < 1):
        raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {top_k!r}")
    return bool(sglang_skip_mask(t, int(top_k), p))


TARGET_LOGPROB_FLOOR = -1e4
"""Stored in ``pg`` for a trimmed draft the target's distribution gives log p = -inf (top-k /
top-p removed it) or less than this: finite for the store, and ``exp(floor - q_lp) == 0``."""


class LogpLookup(Protocol):
    """log p of this step's verify row ``r`` at ``token``: ``logp[r, token]`` (a tensor, the
    engine's gathered columns, or a function wrapped by :class:`_CallLookup`)."""

    def __getitem__(self, key: tuple[int, int]) -> Any: ...


@dataclass
class Censored:
    """A censored block whose trimmed drafts await resolution by later target rows.

    The one implementation of SGLang 0.5.23's walk (:meth:`resolve`), used by the engine's
    decode loop and by :class:`BlockAcceptRecorder`.
    """

    src_fct: int
    start_pos: int  # absolute position of the first trimmed draft (the anchor's + first_k)
    first_k: int  # its 1-based draft position in the block (SGLang's k): verify_len
    tokens: list[int]
    next_k: int = 0  # index into tokens of the next unresolved trimmed draft

    @property
    def open(self) -> bool:
        """Whether some trimmed draft can still be resolved (none diverged, some left)."""
        return self.next_k < len(self.tokens)

    def rows(self, anchor: int, n_rows: int) -> list[tuple[int, int]]:
        """(row, token) of the drafts this step's rows would resolve, assuming no divergence:
        row ``r`` predicts absolute position ``anchor + 1 + r``, ``n_rows`` rows committed."""
        out = []
        for j in range(self.next_k, len(self.tokens)):
            r = self.start_pos + j - (anchor + 1)
            if r < 0 or r >= n_rows:
                break
            out.append((r, self.tokens[j]))
        return out

    def resolve(self, logp: LogpLookup | None, tokens: Sequence[int], anchor: int) -> list[dict]:
        """Walk the trimmed drafts over this step's rows; stop after the first miss.

        Row ``r`` of this step's target output predicts absolute position ``anchor + 1 + r``
        (``anchor``: the anchor's position, SGLang's prefix_len - 1), whose realized token is
        ``tokens[r]`` (accepted drafts then the bonus, before any EOS / length cut). ``logp``
        None resolves nothing. Returns the ``pg`` entries, in SGLang's JSONL shape.
        """
        entries: list[dict] = []
        while self.open and logp is not None:
            r = self.start_pos + self.next_k - (anchor + 1)
            if r < 0 or r >= len(tokens):
                break
            draft = self.tokens[self.next_k]
            realized = int(tokens[r])
            entries.append(
                {
                    "src_fct": self.src_fct,
                    "k": self.first_k + self.next_k,
                    "target_logprob": max(float(logp[r, draft]), TARGET_LOGPROB_FLOOR),
                    "draft_token": draft,
                    "realized_token": realized,
                }
            )
            self.next_k += 1
            if realized != draft:
                self.next_k = len(self.tokens)  # diverged: the rest can never be resolved
                break
        return entries


def resolve_block(
    blk: Censored, logp: LogpLookup | None, tokens: Sequence[int], anchor: int
) -> list[dict]:
    """:meth:`Censored.resolve` of one block (the engine's call for a block opened this step)."""
    return blk.resolve(logp, tokens, anchor)


def resolve(
    blocks: list[Censored], logp: LogpLookup | None, tokens: Sequence[int], anchor: int
) -> tuple[list[dict], list[Censored]]:
    """Resolve a request's open blocks, oldest first, against this step's target rows:
    the ``pg`` entries, and the blocks still open."""
    entries: list[dict] = []
    for blk in blocks:
        entries.extend(blk.resolve(logp, tokens, anchor))
    return entries, [b for b in blocks if b.open]


class _CallLookup:
    def __init__(self, fn: Callable[[int, int], float]) -> None:
        self.fn = fn

    def __getitem__(self, key: tuple[int, int]) -> float:
        return self.fn(*key)


@dataclass
class _ReqState:
    expected_seq_len: int = -1
    pending: list[Censored] = field(default_factory=list)


class BlockAcceptRecorder:
    """What an engine must write per request per step so its rows match SGLang's JSONL.

    Call :meth:`observe` once per request per verify step (after acceptance), and
    :meth:`finish` when the request ends. Unlike SGLang it also records greedy rows (that
    is what makes :func:`estimate_blocks`' greedy ceiling possible). It holds per request
    what the engine's loop holds per live request (a list of :class:`Censored`), plus
    SGLang's sequence-length continuity check.
    """

    def __init__(self, gamma: int) -> None:
        self.gamma = int(gamma)
        self._states: dict[str, _ReqState] = {}

    def needed(self, rid: str, prefix_len: int, correct_drafts: int) -> list[tuple[int, int]]:
        """(row, token) pairs of *earlier* blocks whose target log-prob this step will need."""
        st = self._states.get(rid)
        if st is None or (st.expected_seq_len >= 0 and prefix_len != st.expected_seq_len):
            return []
        anchor, n_rows = int(prefix_len) - 1, int(correct_drafts) + 1
        return [rt for blk in st.pending for rt in blk.rows(anchor, n_rows)]

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
        anchor = int(prefix_len) - 1
        realized = [int(t) for t in draft_tokens[:cl]] + [int(bonus_token)]
        logp = _CallLookup(target_logprob)
        pg, st.pending = resolve(st.pending, logp, realized, anchor)
        out: dict[str, Any] = {"trimmed_tokens": None, "q_lp": None, "pg": None}
        if cl == w and w < g:
            trimmed = [int(t) for t in draft_tokens[w:g]]
            out["trimmed_tokens"] = trimmed
            out["q_lp"] = [float(x) for x in draft_logprobs[w:g]]
            blk = Censored(int(forward_ct), anchor + w + 1, w + 1, trimmed)
            pg.extend(blk.resolve(logp, realized, anchor))  # its first draft: this bonus
            if blk.open:
                st.pending.append(blk)
        out["pg"] = pg or None
        return out

    def finish(self, rid: str, natural_stop: bool) -> list[int]:
        """Forget the request; returns the src_fct of blocks still pending at a natural stop
        (SGLang's ``eos_end`` list), empty otherwise."""
        st = self._states.pop(rid, None)
        if st is None or not natural_stop:
            return []
        return [b.src_fct for b in st.pending]
