"""Producer side of the block-accept estimator: what an engine writes per request per step.

The rows :class:`BlockAcceptRecorder` returns are SGLang 0.5.23's estimator JSONL fields
(``trimmed_tokens``, ``q_lp``, ``pg``); :mod:`dspark_obs.analytics.estimator` documents the
contract and reads them back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


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
