"""The batched device runtime: one attention call per layer for a whole ragged batch, a
preallocated slot pool for the KV caches, and CUDA graphs keyed by packed token count.

Why it exists: the reference path (:class:`~dspark_obs.engine.model.Target` with one
:class:`~dspark_obs.engine.model.KVCache` per request) runs attention once per request in
every layer and rebuilds the drafter's context every step, so on a GPU the step time is
per-request Python work, not tokens. Here (the parts live in :mod:`dspark_obs.engine.slots`):

* :class:`~dspark_obs.engine.slots.SlotPool` holds every running request's target K/V and
  drafter context K/V in two preallocated tensors
  ``[layers, 2, slots + 1, kv_heads, max_len, head_dim]``; a request owns one slot, its length
  is an integer on the host, and rolling back rejected drafts is moving that integer (O(1)).
  The last slot is scratch for padding rows. Slots stay dense (``0..B-1``): a finishing
  request's slot takes the highest one's contents.
* :func:`~dspark_obs.engine.packed.target_forward` packs every request's new tokens into one
  ``[N, d]`` sequence for the dense layers and runs ONE scaled-dot-product attention per
  layer over the batch, queries scattered into a ``[B, Q]`` grid (``Q`` = the widest
  request's token count) against the slot pool with a causal-by-position mask. Dense work is
  exactly ``N`` tokens (padded up to a tier under graphs): compact's trimmed windows really
  are cheaper.
* The verify pass also writes the drafter's context K/V for every verified row (projected
  target features), so drafting needs no per-request cache work: rows past the accepted
  length are never visible (the drafter masks by committed length) and get overwritten.
* :class:`~dspark_obs.engine.slots.GraphBank` captures a CUDA graph per
  ``(Q, batch tier, token tier, span tier)`` for verify and per ``(batch tier, span tier)``
  for the drafter; a step pads to the nearest captured tier, so a trimmed batch replays a
  smaller graph. On the CPU (or with graphs off) the same functions run eagerly at exact
  sizes: CI tests this path.

The whole-block verify (draft and verify back to back, the windows, the acceptance and the
read-back summary on the device) is :class:`~dspark_obs.engine.block_step.BlockSteps`.

Everything numeric is the reference path's own modules (norms, projections, rotary tables,
the drafter's Markov recursion); only the data layout and the launch pattern differ.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dspark_obs.engine.block_step import BlockSteps
from dspark_obs.engine.drafter import DraftBlock, Drafter
from dspark_obs.engine.graph_plan import decode_graph_keys, dummy_inputs
from dspark_obs.engine.model import Target
from dspark_obs.engine.packed import draft_block, drafter_extend, target_forward
from dspark_obs.engine.slots import (
    BATCH_TIERS,
    LENGTH_TIERS,
    PREFILL_WIDTHS,
    TOKEN_TIERS,
    GraphBank,
    Pack,
    SlotPool,
    prefill_plan,
    round_up,
    tier_of,
)

__all__ = ["BatchedRuntime", "VerifyOut"]


# --------------------------------------------------------------------------- the runtime
@dataclass
class VerifyOut:
    """One verify forward: float logits [N, V] of the real rows and their argmax."""

    logits: Tensor
    argmax: np.ndarray
    pack: Pack

    def split(self) -> tuple[list[Tensor], list[np.ndarray]]:
        """Per request (in the order given to ``forward``): its logits rows and argmax."""
        counts = self.pack.counts.tolist()
        ends = np.cumsum(counts).tolist()
        starts = [e - c for e, c in zip(ends, counts, strict=True)]
        logits = [self.logits[a:e] for a, e in zip(starts, ends, strict=True)]
        return logits, [self.argmax[a:e] for a, e in zip(starts, ends, strict=True)]


class BatchedRuntime(BlockSteps):
    """Target + drafter over one :class:`SlotPool`, eager or under CUDA graphs.

    The engine asks for slots, prefills into them, drafts for the first ``B`` slots, verifies
    packed windows and commits lengths; it never touches a cache tensor itself. The pool
    grows (and graphs are recaptured) when a request needs more room than it has.
    """

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None,
        *,
        max_batch: int,
        max_len: int,
        gamma: int,
        cuda_graphs: bool = True,
        compiled: bool = False,
        batch_tiers: Sequence[int] = BATCH_TIERS,
        token_tiers: Sequence[int] = TOKEN_TIERS,
        length_tiers: Sequence[int] = LENGTH_TIERS,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.gamma = gamma
        self.device = target.device
        self.graphs_on = bool(cuda_graphs) and self.device.type == "cuda"
        self.compiled = compiled
        self.batch_tiers = tuple(sorted(set(batch_tiers)))
        self.token_tiers = tuple(sorted(set(token_tiers)))
        self.length_tiers = tuple(sorted(set(length_tiers)))
        self.hidden_layers = tuple(drafter.hidden_layers) if drafter is not None else ()
        self.capture_seconds = 0.0
        self.used = 0  # slots 0..used-1 hold running requests
        self.busy = False  # an engine is running on it (shared_runtime hands out another)
        self.key: tuple = ()  # shared_runtime's settings key
        self._anchors = np.zeros(1, dtype=np.int64)
        self._sts_rows: tuple[np.ndarray, np.ndarray] | None = None  # read at the first draft
        self._plans: dict[bytes, Tensor] = {}
        self._sts_cache: dict[tuple, Tensor] = {}
        self.pool = self._new_pool(max_batch, max_len)
        # Prefill forwards: chunk widths (each a graph key part) and a token cap, so that
        # under graphs every prefill forward is a captured one; eager: one exact forward.
        self.prefill_widths: tuple[int, ...] = ()
        self.prefill_tokens: int | None = None
        if self.graphs_on:
            cap = max(self.token_tiers)
            self.prefill_widths = tuple(w for w in PREFILL_WIDTHS if w <= cap) or (cap,)
            self.prefill_tokens = cap

    def _new_pool(self, max_batch: int, max_len: int) -> SlotPool:
        slots = tier_of(max_batch, self.batch_tiers) if self.graphs_on else max_batch
        limit = self.target.cfg.max_position
        pool = SlotPool(self.target, self.drafter, slots, min(round_up(max_len, 64), limit))
        anchors = np.zeros(slots + 1, dtype=np.int64)
        keep = min(len(self._anchors), len(anchors)) - 1
        anchors[:keep] = self._anchors[:keep]
        self._anchors = anchors
        # The device's own copy of every slot's length and anchor: what drafts and whole-block
        # verifies read, and what the device's greedy acceptance advances (verify_block), so
        # a step can launch before the host has read the one before it. ``_ahead_by[s]``:
        # device steps slot s took that the host has not committed yet; ``_dirty``: slots
        # whose host values changed (prefill, forward, a host commit, a move), uploaded
        # before the next launch.
        self._dlen = torch.zeros(slots + 1, dtype=torch.long, device=self.device)
        self._danchor = torch.zeros(slots + 1, dtype=torch.long, device=self.device)
        self._ahead_by = np.zeros(slots + 1, dtype=np.int64)
        self._dirty: set[int] = set(range(slots + 1))
        self._banks: dict[str, GraphBank] = {}
        if self.graphs_on:
            self._banks = {
                "verify": GraphBank(self._verify_fn, self.device),
                "prefill": GraphBank(self._prefill_fn, self.device),
                "block": GraphBank(self._block_fn, self.device, ("rows", "q", "span")),
                "rest": GraphBank(self._rest_fn, self.device, ("rows", "q", "span")),
                "sampled": GraphBank(
                    self._sampled_block_fn, self.device, ("rows", "q", "span", "filters")
                ),
                "draft": GraphBank(self._draft_fn, self.device),
            }
        return pool

    def reserve(self, max_batch: int, max_len: int) -> None:
        """Make room for ``max_batch`` slots of ``max_len`` positions (grows, never shrinks;
        running slots keep their caches)."""
        old = self.pool
        if max_batch <= old.slots and max_len <= old.max_len:
            return
        if self.used and max_batch > old.slots:
            raise RuntimeError("cannot add slots while requests are running")
        captured = self.graph_capture_seconds  # the old graphs go with the old pool
        old_dlen, old_danchor, old_ahead, dirty = (
            self._dlen, self._danchor, self._ahead_by, self._dirty
        )  # fmt: skip
        new = self._new_pool(max(max_batch, old.slots), max(max_len, old.max_len))
        n = old.max_len
        new.kv[:, :, : self.used, :, :n] = old.kv[:, :, : self.used]
        if new.dkv is not None and old.dkv is not None:
            new.dkv[:, :, : self.used, :, :n] = old.dkv[:, :, : self.used]
        new.lengths[: self.used] = old.lengths[: self.used]
        used = self.used
        self._dlen[:used] = old_dlen[:used]
        self._danchor[:used] = old_danchor[:used]
        self._ahead_by[:used] = old_ahead[:used]
        self._dirty = {s for s in dirty if s < used} | set(range(used, new.slots + 1))
        self.pool = new
        self.capture_seconds = captured

    # -- slots --------------------------------------------------------------------------
    def acquire(self) -> int:
        if self.used >= self.pool.slots:
            raise RuntimeError(f"all {self.pool.slots} slots are in use")
        self.used += 1
        return self.used - 1

    def release(self, slot: int) -> int | None:
        """Free ``slot``; the highest running slot moves into it: returns that slot (or None
        when ``slot`` was the highest)."""
        last = self.used - 1
        self.used -= 1
        # device state moves by slices (views + one copy kernel each: nothing waits)
        if slot == last:
            self.pool.lengths[slot] = 0
            self._dlen[slot : slot + 1].zero_()
            self._ahead_by[slot] = 0
            self._dirty.discard(slot)
            return None
        self.pool.move(last, slot, extra=int(self._ahead_by[last]) * (self.gamma + 1))
        self._anchors[slot] = self._anchors[last]
        self._dlen[slot : slot + 1].copy_(self._dlen[last : last + 1])
        self._danchor[slot : slot + 1].copy_(self._danchor[last : last + 1])
        self._dlen[last : last + 1].zero_()
        self._ahead_by[slot], self._ahead_by[last] = self._ahead_by[last], 0
        self._dirty.discard(slot)
        if last in self._dirty:
            self._dirty.discard(last)
            self._dirty.add(slot)
        return last

    def length(self, slot: int) -> int:
        return int(self.pool.lengths[slot])

    def commit(self, slot: int, length: int, anchor: int, *, on_device: bool = False) -> None:
        """Keep the slot's first ``length`` positions (rolls back rejected drafts, O(1)) and
        set the token it drafts from next. ``on_device``: the commit of the slot's oldest
        :meth:`verify_block` the host had not committed, which the device made already."""
        if on_device:
            if self._ahead_by[slot] < 1:
                raise RuntimeError(f"slot {slot} has no whole-block verify left to commit")
            self._ahead_by[slot] -= 1
        elif self._ahead_by[slot]:
            raise RuntimeError(f"slot {slot} has a whole-block verify the host has not committed")
        else:
            self._dirty.add(slot)
        self.pool.lengths[slot] = length
        self._anchors[slot] = anchor

    def set_anchor(self, slot: int, token: int) -> None:
        self._anchors[slot] = token
        self._dirty.add(slot)

    def set_first_anchors(self, slots: Sequence[int], tokens: Tensor) -> None:
        """Upload what the host changed first (the prefill's lengths), then write the anchors
        on the device itself; the slots stay clean, so no later upload overwrites them."""
        self._flush()
        self._danchor[self._device(np.asarray(slots, dtype=np.int64))] = tokens

    def reset(self) -> None:
        """Forget every running request (a new run starts; the drafter's STS temperatures
        are read again at its first draft)."""
        self.used = 0
        self.pool.lengths[:] = 0
        self._dlen.zero_()
        self._ahead_by[:] = 0
        self._dirty = set(range(len(self._ahead_by)))
        self._sts_rows = None
        self._sts_cache.clear()

    def can_launch_ahead(self, batch: int) -> bool:
        """Whether slots ``0..batch-1`` can take one more draft and whole-block verify before
        the host reads the last one (drafts and verifies start from the device's lengths and
        anchors): room in the pool for what the longest of them writes."""
        reach = max(self.gamma + 1, self.drafter.cfg.gamma_max if self.drafter else 0)
        return self._longest(batch) + reach <= self.pool.max_len

    def _flush(self) -> None:
        """Upload the host's length and anchor of every slot the host changed."""
        if not self._dirty:
            return
        idx = np.fromiter(sorted(self._dirty), dtype=np.int64)
        self._dirty.clear()
        at = self._device(idx)
        self._dlen[at] = self._device(self.pool.lengths[idx].copy())
        self._danchor[at] = self._device(self._anchors[idx].copy())

    def _longest(self, batch: int) -> int:
        """The longest of slots ``0..batch-1`` on the device: exact on a synchronous runtime;
        on a GPU an upper bound (the host's length plus ``gamma + 1`` per device step not yet
        committed), so nothing waits for the device."""
        if not self.asynchronous:
            return int(self._dlen[:batch].max())
        q = self.gamma + 1
        return int((self.pool.lengths[:batch] + self._ahead_by[:batch] * q).max())

    @property
    def asynchronous(self) -> bool:
        """CUDA: launches (graph replays) return before the device finishes."""
        return self.device.type == "cuda"

    def _sts(self, temps: Sequence[float]) -> np.ndarray:
        """[B, gamma] STS temperatures per row: the greedy set for greedy rows."""
        assert self.drafter is not None
        if self._sts_rows is None:
            self._sts_rows = (
                self.drafter.sts(self.gamma).float().numpy(),
                self.drafter.sts(self.gamma, greedy=True).float().numpy(),
            )
        sample, greedy = self._sts_rows
        return np.stack([greedy if t <= 0 else sample for t in temps])

    def _sts_upload(self, rows: np.ndarray, bt: int) -> Tensor:
        st = np.ones((bt, self.gamma), dtype=np.float32)
        st[: len(rows)] = rows
        return self._device(st)

    def _sts_rows_of(self, temps: Sequence[float], bt: int) -> Tensor:
        """The drafter's own STS rows for these temperatures on the device, padded to ``bt``
        rows (kept per greedy/sampled pattern: a steady batch uploads nothing)."""
        key = (bt, tuple(t <= 0 for t in temps))
        cached = self._sts_cache.get(key)
        if cached is None:
            if len(self._sts_cache) > 64:
                self._sts_cache.clear()
            cached = self._sts_cache[key] = self._sts_upload(self._sts(temps), bt)
        return cached

    # -- step functions (graph-safe) ------------------------------------------------------
    @torch.no_grad()  # the packed paths serve; training runs the modules
    def _states(
        self,
        tokens: Tensor,
        slot: Tensor,
        pos: Tensor,
        qidx: Tensor,
        past: Tensor,
        q: Tensor,
        span: Tensor,
        row_slot: Tensor | None = None,
    ) -> Tensor:
        """One packed target forward (its K/V into the pool, the drafter's context from its
        features): the final-normed states [N, d]."""
        normed, feats = target_forward(
            self.target,
            self.pool.kv,
            tokens,
            slot,
            pos,
            qidx,
            past,
            q.shape[0],
            span.shape[0],
            self.hidden_layers,
            self.compiled,
            row_slot,
        )
        if self.drafter is not None and self.pool.dkv is not None:
            drafter_extend(self.drafter, self.pool.dkv, feats, slot, pos, self.compiled)
        return normed

    def _verify_fn(self, **inputs: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`_states` with float logits [N, V] at every row and their argmax."""
        logits = self.target.lm_head(self._states(**inputs)).float()
        return logits, logits.argmax(-1)

    def _prefill_fn(self, last: Tensor, **inputs: Tensor) -> tuple[Tensor]:
        """:meth:`_states` with float logits at rows ``last`` [B] only (each prompt's last
        position): a prefill forward of hundreds of tokens needs one row each."""
        return (self.target.lm_head(self._states(**inputs)[last]).float(),)

    @torch.no_grad()
    def _draft_fn(
        self, anchors: Tensor, committed: Tensor, sts: Tensor, span: Tensor
    ) -> tuple[Tensor, ...]:
        """The block pass and a greedy chain for every row: drafts, log q, confidence logits,
        confidences, h and the base logits (:func:`draft_block`)."""
        assert self.drafter is not None and self.pool.dkv is not None
        return draft_block(
            self.drafter, self.pool.dkv, anchors, committed, sts, span.shape[0], self.compiled
        )

    def _span(self, end: int) -> int:
        if self.graphs_on:
            return min(tier_of(end, self.length_tiers), self.pool.max_len)
        return min(round_up(end, 64), self.pool.max_len)

    def _device(self, arr: np.ndarray) -> Tensor:
        return torch.from_numpy(arr).to(self.device, non_blocking=True)

    def _run(self, bank: str, key: tuple, fn: Callable[..., tuple], inputs: dict) -> tuple:
        if self.graphs_on and bank in self._banks:
            return self._banks[bank].run(key, inputs)
        return fn(**inputs)

    # -- public steps -------------------------------------------------------------------
    def forward(
        self,
        slots: Sequence[int],
        tokens: Sequence[Sequence[int]],
        *,
        q: int | None = None,
        gather: bool = False,
    ) -> VerifyOut:
        """Run ``tokens[i]`` at the end of slot ``slots[i]`` (lengths advance by their count:
        commit smaller lengths to roll back). Under graphs a step pads to its tiers. Nothing
        here waits for the device but the argmax read."""
        pack, inputs, key, graphed = self._packed(slots, tokens, q, gather)
        bank = "verify" if graphed else "eager"
        logits, argmax = self._run(bank, (*key, gather), self._verify_fn, inputs)
        return VerifyOut(logits[: pack.n], argmax[: pack.n].cpu().numpy(), pack)

    def _packed(
        self, slots: Sequence[int], tokens: Sequence[Sequence[int]], q: int | None, gather: bool
    ) -> tuple[Pack, dict[str, Tensor], tuple[int, int, int, int], bool]:
        """The device inputs of one packed forward of ``tokens[i]`` into slot ``slots[i]``,
        its graph key ``(q, batch tier, token tier, span)`` and whether a graph runs it; the
        host lengths advance now (the caller launches it before anything reads them)."""
        counts = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
        q = q or int(counts.max())
        lengths = self.pool.lengths
        slot_idx = np.asarray(slots, dtype=np.int64)
        if self._ahead_by[slot_idx].any():
            raise RuntimeError("forward on a slot with a whole-block verify not committed")
        self._dirty.update(slot_idx.tolist())
        starts = lengths[slot_idx]
        end = int((starts + counts).max())
        if end > self.pool.max_len:
            raise RuntimeError(f"slot pool holds {self.pool.max_len} positions, step needs {end}")
        batch = len(slot_idx) if gather else int(slot_idx.max()) + 1
        bt, nt, graphed = self._tiers(batch, int(counts.sum()))
        pack = Pack.build(
            slot_idx, tokens, starts, q=q, batch=bt, rows=nt, trash=self.pool.trash, gather=gather
        )
        span = self._span(end)
        inputs = {
            "tokens": self._device(pack.tokens),
            "slot": self._device(pack.slot),
            "pos": self._device(pack.pos),
            "qidx": self._device(pack.qidx),
            "past": self._device(pack.past),
            "q": torch.empty(q, device=self.device),  # shape carriers (graph key parts)
            "span": torch.empty(span, device=self.device),
        }
        if gather:
            inputs["row_slot"] = self._device(pack.row_slot)
        lengths[slot_idx] += counts
        self.target.tokens_processed += pack.n
        return pack, inputs, (q, bt, nt, span), graphed

    def _tiers(self, batch: int, n: int) -> tuple[int, int, bool]:
        """The (batch, token) tiers a forward pads to, and whether a captured graph runs it;
        eager (CPU, graphs off, or off the captured grid) runs exact sizes."""
        bt, nt = tier_of(batch, self.batch_tiers), tier_of(n, self.token_tiers)
        if self.graphs_on and bt <= self.pool.slots and nt in self.token_tiers:
            return bt, nt, True
        return batch, n, False

    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> Tensor:
        """Run prompts into empty slots together: float logits [k, V] of each prompt's last
        position, left on the device (nothing here waits for it). Attention covers only these
        requests, whatever their slot numbers. Under graphs the prompts go in as few captured
        forwards as the token tiers allow (:func:`prefill_plan`), launched back to back; a
        forward computes logits only at the prompts' last positions."""
        if any(self.pool.lengths[s] for s in slots):
            raise ValueError(f"prefill into a slot that is not empty: {list(slots)}")
        lengths = [len(p) for p in prompts]
        widths = self.prefill_widths
        width = min(tier_of(max(lengths), widths), widths[-1]) if widths else max(lengths)
        plan = prefill_plan(lengths, width, self.prefill_tokens)
        last: list[Tensor | None] = [None] * len(slots)
        for segments in plan:
            longest = max(end - start for _, start, end in segments)
            q = tier_of(longest, widths) if widths else longest
            pack, inputs, key, graphed = self._packed(
                [slots[i] for i, _, _ in segments],
                [list(prompts[i][start:end]) for i, start, end in segments],
                q,
                gather=True,
            )
            done = [j for j, (i, _, end) in enumerate(segments) if end == lengths[i]]
            rows = np.zeros(pack.batch, dtype=np.int64)
            rows[: len(done)] = (np.cumsum(pack.counts) - 1)[done]
            inputs["last"] = self._device(rows)
            bank = "prefill" if graphed else "eager"
            (logits,) = self._run(bank, key, self._prefill_fn, inputs)
            logits = logits[: len(done)].clone()  # the key's next replay reuses its buffer
            for r, j in enumerate(done):
                last[segments[j][0]] = logits[r]
        return torch.stack([x for x in last if x is not None])

    def draft(
        self,
        temps: Sequence[float],
        generators: Sequence[torch.Generator | None] | None = None,
        *,
        sts: np.ndarray | None = None,
    ) -> DraftBlock:
        """Draft one block for slots ``0..B-1`` (B = len(temps)); ``sts`` [B, gamma] holds
        each row's STS temperatures (default: the drafter's own). The block pass and a greedy
        chain run for every row; sampled rows (temperature > 0) are then redrawn from the same
        states with their own generators. ``probs`` is filled for sampled rows only (greedy
        rows never read it)."""
        assert self.drafter is not None
        batch = len(temps)
        bt = tier_of(batch, self.batch_tiers) if self.graphs_on else batch
        bt = bt if bt <= self.pool.slots else batch
        t = np.zeros(bt, dtype=np.float32)
        t[:batch] = temps
        self._flush()
        span = self._span(self._longest(batch) + self.drafter.cfg.gamma_max)
        inputs = {
            "anchors": self._danchor[:bt],
            "committed": self._dlen[:bt],
            "sts": self._sts_rows_of(temps, bt) if sts is None else self._sts_upload(sts, bt),
            "span": torch.empty(span, device=self.device),
        }
        out = self._run("draft", (bt, self.gamma, span), self._draft_fn, inputs)
        tokens, lps, z, conf, h, base = (o[:batch] for o in out)
        sampled = [i for i in range(batch) if t[i] > 0]
        probs = torch.zeros(0, device=self.device)
        if sampled:
            idx = torch.tensor(sampled, device=self.device)
            gens = [generators[i] if generators else None for i in sampled]
            sub = self.drafter.chain(
                h[idx],
                base[idx],
                inputs["anchors"][idx],
                self._device(t[sampled]),
                gens,
                sts=inputs["sts"][idx],
                all_greedy=False,
            )
            tokens, lps, z, conf = (x.clone() for x in (tokens, lps, z, conf))
            tokens[idx], lps[idx], z[idx], conf[idx] = (
                sub.tokens,
                sub.logprobs,
                sub.conf_logits,
                sub.confidence,
            )
            probs = sub.probs.new_zeros(batch, self.gamma, sub.probs.shape[-1])  # whole vocabulary
            probs[idx] = sub.probs
        return DraftBlock(tokens, lps, probs, z, conf)

    def graph_keys(
        self, span_end: int, trims: bool = False, rest: bool = False
    ) -> list[tuple[str, tuple]]:
        """The verify and draft graphs a decode step can replay while every slot ends before
        ``span_end`` (what :meth:`capture` takes at start-up; ``trims``: compact budgets may
        trim a whole-block step's pack; ``rest``: cap-accept verifies the drafts past the
        windows too)."""
        spans = sorted({self._span(e) for e in (64, *self.length_tiers) if e <= span_end})
        return decode_graph_keys(
            self.gamma,
            spans or [self._span(span_end)],
            [b for b in self.batch_tiers if b <= self.pool.slots],
            self.token_tiers,
            drafting=self.drafter is not None,
            trims=trims,
            rest=rest,
        )

    def capture(
        self,
        span_end: int,
        progress: Callable[[str], None] | None = None,
        *,
        trims: bool = False,
        rest: bool = False,
    ) -> int:
        """Capture the decode step's CUDA graphs up front (they are otherwise captured on
        first use, inside a step): returns how many were new. A no-op without graphs."""
        if not self.graphs_on:
            return 0
        if self.used:
            raise RuntimeError("capture graphs before any request runs (drafting writes slots)")
        keys = self.graph_keys(span_end, trims, rest)
        todo = [(b, k) for b, k in keys if k not in self._banks[b]]
        t0 = time.perf_counter()
        for i, (bank, key) in enumerate(todo, 1):
            self._banks[bank].capture(key, dummy_inputs(bank, key, self.device, self.pool.trash))
            if progress and (i == len(todo) or i % 25 == 0):
                progress(f"captured {i}/{len(todo)} CUDA graphs ({time.perf_counter() - t0:.1f} s)")
        self.pool.lengths[:] = 0
        return len(todo)

    @property
    def graphs(self) -> int:
        """Captured CUDA graphs."""
        return sum(len(b.graphs) for b in self._banks.values())

    @property
    def graph_capture_seconds(self) -> float:
        return self.capture_seconds + sum(b.capture_seconds for b in self._banks.values())
