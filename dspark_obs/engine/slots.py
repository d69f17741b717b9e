"""The batched runtime's parts: the graph tiers, the slot pool that holds every running
request's K/V, the packing of a ragged batch into one forward, and the CUDA graph bank.

Apart from :mod:`dspark_obs.engine.batched` (the runtime that drives them step by step) because
each is its own data structure with its own invariants; see that module's docstring for how
they fit together.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from dspark_obs.engine.drafter import Drafter
from dspark_obs.engine.model import Target

__all__ = [
    "BATCH_TIERS",
    "LENGTH_TIERS",
    "TOKEN_TIERS",
    "GraphBank",
    "PREFILL_WIDTHS",
    "Pack",
    "SlotPool",
    "prefill_plan",
    "round_up",
    "tier_of",
]

BATCH_TIERS: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Running-request counts a graph is captured for (a batch pads up to the next one)."""

TOKEN_TIERS: tuple[int, ...] = (
    *range(1, 17),
    *range(20, 65, 4),
    *range(72, 129, 8),
    *range(144, 257, 16),
    *range(288, 513, 32),
    *range(576, 1025, 64),
    *range(1152, 1537, 128),
)
"""Packed token counts a verify graph is captured for: fine steps where a step is cheap, up to
a full static step at batch 256 (256 x 6): a step past the largest tier runs eagerly, which at
batch 256 cost more than the whole graphed step (bench/bench_step_profile.py)."""


LENGTH_TIERS: tuple[int, ...] = (
    64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192,
)
"""Cache spans attention reads (a step reads the smallest span covering its longest slot)."""


def tier_of(n: int, tiers: Sequence[int]) -> int:
    """Smallest tier >= n (n itself past the largest: that step then runs eagerly)."""
    i = bisect.bisect_left(tiers, n)
    return tiers[i] if i < len(tiers) else n


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# --------------------------------------------------------------------------- the slot pool
class SlotPool:
    """Device K/V of every running request, target and drafter, one slot each.

    ``lengths[s]`` is slot s's committed positions: the target cache's length and the
    drafter context's ``num_positions`` at once (both hold the same positions).
    """

    def __init__(
        self, target: Target, drafter: Drafter | None, slots: int, max_len: int
    ) -> None:
        cfg = target.cfg
        if not 0 < max_len <= cfg.max_position:
            raise ValueError(f"max_len must be in 1..{cfg.max_position}, got {max_len}")
        self.slots = slots
        self.max_len = max_len
        self.trash = slots  # scratch slot for padding rows
        dev, dt = target.device, target.dtype
        self.kv = torch.zeros(
            cfg.num_layers, 2, slots + 1, cfg.num_kv_heads, max_len, cfg.head_dim,
            device=dev, dtype=dt,
        )
        self.dkv: Tensor | None = None
        if drafter is not None:
            d = drafter.cfg
            self.dkv = torch.zeros(
                d.num_layers, 2, slots + 1, d.num_kv_heads, max_len, d.head_dim,
                device=dev, dtype=drafter.fc.weight.dtype,
            )
        self.lengths = np.zeros(slots + 1, dtype=np.int64)

    def move(self, src: int, dst: int, extra: int = 0) -> None:
        """Slot ``dst`` takes slot ``src``'s caches (to keep running slots dense), with
        ``extra`` positions past its committed length (a verify the host has not committed)."""
        n = min(int(self.lengths[src]) + extra, self.max_len)
        self.kv[:, :, dst, :, :n] = self.kv[:, :, src, :, :n]
        if self.dkv is not None:
            self.dkv[:, :, dst, :, :n] = self.dkv[:, :, src, :, :n]
        self.lengths[dst] = self.lengths[src]
        self.lengths[src] = 0


# --------------------------------------------------------------------------- packing
@dataclass
class Pack:
    """Host-side index arrays of one packed forward, padded to ``(batch, tokens)``.

    Row r of the packed sequence is token ``tokens[r]`` of slot ``slot[r]`` at position
    ``pos[r]``; ``qidx[r]`` is its cell in the flattened ``[batch, Q]`` query grid. Padding
    rows write into the scratch slot and the grid's spare last cell.
    """

    tokens: np.ndarray
    slot: np.ndarray
    pos: np.ndarray
    qidx: np.ndarray
    past: np.ndarray  # [batch]: each grid row's cache length before this forward
    n: int  # real rows
    batch: int
    q: int
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    row_slot: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @classmethod
    def build(
        cls,
        slots: Sequence[int],
        tokens: Sequence[Sequence[int]],
        starts: Sequence[int],
        *,
        q: int,
        batch: int,
        rows: int,
        trash: int,
        gather: bool = False,
    ) -> Pack:
        """Slot ``slots[i]`` gets ``tokens[i]`` at positions ``starts[i] + arange``.

        The query grid's row for request i is its slot (decode: the grid covers slots
        ``0..batch-1`` and reads their caches in place) or, with ``gather``, i itself (the
        grid covers only these requests; attention gathers their slots' caches): what a
        prefill of a few requests wants, whatever their slot numbers."""
        counts = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
        pack = cls.layout(
            slots, counts, starts, q=q, batch=batch, rows=rows, trash=trash, gather=gather
        )
        pack.tokens[: pack.n] = np.fromiter(
            (x for t in tokens for x in t), dtype=np.int64, count=pack.n
        )
        return pack

    @classmethod
    def layout(
        cls,
        slots: Sequence[int],
        counts: np.ndarray,
        starts: Sequence[int],
        *,
        q: int,
        batch: int,
        rows: int,
        trash: int,
        gather: bool = False,
    ) -> Pack:
        """:meth:`build`'s index arrays from the token counts alone (``tokens`` left zero);
        :func:`~dspark_obs.engine.block_verify.window_pack` builds the same on the device."""
        counts = np.asarray(counts, dtype=np.int64)
        n = int(counts.sum())
        slot_arr = np.asarray(slots, dtype=np.int64)
        grid_row = np.arange(len(slots), dtype=np.int64) if gather else slot_arr
        if n > rows or (len(slots) and grid_row.max() >= batch) or (counts > q).any():
            raise ValueError(f"pack of {n} tokens does not fit ({batch}, {rows}, q={q})")
        within = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
        owner = np.repeat(slot_arr, counts)
        tok = np.zeros(rows, dtype=np.int64)
        slot = np.full(rows, trash, dtype=np.int64)
        slot[:n] = owner
        pos = np.zeros(rows, dtype=np.int64)
        pos[:n] = np.repeat(np.asarray(starts, dtype=np.int64), counts) + within
        qidx = np.full(rows, batch * q, dtype=np.int64)
        qidx[:n] = np.repeat(grid_row, counts) * q + within
        past = np.zeros(batch, dtype=np.int64)
        past[grid_row] = starts
        row_slot = np.full(batch, trash, dtype=np.int64)
        row_slot[grid_row] = slot_arr
        return cls(tok, slot, pos, qidx, past, n, batch, q, counts, row_slot)


PREFILL_WIDTHS: tuple[int, ...] = (64, 128, 256, 512)
"""Prompt chunk widths a prefill forward is captured for under CUDA graphs (a prompt longer
than the widest goes in several chunks). On the H200 a graphed forward of a few hundred
tokens costs about what one of 64 does, so a prompt should take as few forwards as it can."""


def prefill_plan(
    lengths: Sequence[int], width: int, tokens: int | None
) -> list[list[tuple[int, int, int]]]:
    """The forwards of one prefill: each a list of ``(prompt index, start, end)`` segments,
    at most one per prompt, of at most ``width`` tokens and ``tokens`` in all (None: no cap).
    Chunk ``r`` of every prompt comes in a forward after chunk ``r - 1`` (it attends to it)."""
    if width < 1 or (tokens is not None and tokens < width):
        raise ValueError(f"prefill chunks of {width} tokens in forwards of {tokens}")
    plan: list[list[tuple[int, int, int]]] = []
    for start in range(0, max(lengths, default=0), width):
        group: list[tuple[int, int, int]] = []
        used = 0
        for i, n in enumerate(lengths):
            if n <= start:
                continue
            seg = (i, start, min(n, start + width))
            size = seg[2] - start
            if group and tokens is not None and used + size > tokens:
                plan.append(group)
                group, used = [], 0
            group.append(seg)
            used += size
        if group:
            plan.append(group)
    return plan


# --------------------------------------------------------------------------- CUDA graphs
class GraphBank:
    """CUDA graphs of one step function, captured lazily per key, replayed with fresh inputs.

    ``fn(**inputs)`` must be graph-safe (no host syncs, fixed shapes per key). Inputs are
    copied into the key's static buffers before each replay (an input with fewer rows than
    the captured one fills the first rows; the rest keep earlier values, as padding rows
    may), except the ``shapes`` inputs, which only carry a size that is part of the key;
    outputs are the static output tensors (valid until that key is replayed again). All
    graphs share one memory pool.
    """

    def __init__(
        self,
        fn: Callable[..., tuple[Tensor, ...]],
        device: torch.device,
        shapes: Sequence[str] = ("q", "span"),
    ) -> None:
        self.fn = fn
        self.device = device
        self.shapes = frozenset(shapes)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, Tensor], tuple]] = {}
        self.pool: object | None = None
        self.capture_seconds = 0.0

    def __contains__(self, key: tuple) -> bool:
        return key in self.graphs

    def capture(self, key: tuple, inputs: dict[str, Tensor]) -> None:
        t0 = time.perf_counter()
        static = {k: v.clone() for k, v in inputs.items()}
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside capture (allocator, library handles)
                self.fn(**static)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.fn(**static)
        self.graphs[key] = (graph, static, out)
        self.capture_seconds += time.perf_counter() - t0

    def run(self, key: tuple, inputs: dict[str, Tensor]) -> tuple[Tensor, ...]:
        if key not in self.graphs:
            self.capture(key, inputs)
        graph, static, out = self.graphs[key]
        for name, value in inputs.items():
            if name in self.shapes:
                continue
            buf = static[name]
            if value.shape != buf.shape:
                buf = buf[: value.shape[0]]
            buf.copy_(value, non_blocking=True)
        graph.replay()
        return out
