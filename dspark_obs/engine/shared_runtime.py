"""Batched runtimes shared across runs and engines: one per target and settings.

Why: a runtime's CUDA graphs and compiled layers take seconds to minutes to build, and every
run of an engine (and every engine of a process on the same target) would otherwise build
its own. :func:`shared_runtime` hands out the cached one when it is free, a private one while
it is busy (each run needs its own slots), and resizes its pool to the run.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

from dspark_obs.engine.batched import BatchedRuntime
from dspark_obs.engine.drafter import Drafter
from dspark_obs.engine.model import Target
from dspark_obs.engine.slots import BATCH_TIERS, TOKEN_TIERS

__all__ = ["shared_runtime"]

_CACHE: weakref.WeakKeyDictionary[Target, dict[tuple, BatchedRuntime]] = weakref.WeakKeyDictionary()


_CACHE_LOCK = threading.Lock()


def shared_runtime(
    target: Target,
    drafter: Drafter | None,
    *,
    max_batch: int,
    max_len: int,
    gamma: int,
    cuda_graphs: bool = True,
    compiled: bool = False,
    token_tiers: Sequence[int] = TOKEN_TIERS,
    batch_tiers: Sequence[int] = BATCH_TIERS,
    prefer: BatchedRuntime | None = None,
) -> BatchedRuntime:
    """A runtime for this target and drafter, handed out ``busy`` (set ``busy = False`` when
    the run ends). The same one comes back across runs and engines, so CUDA graphs are
    captured once; while it is busy (two engines at once on one target, e.g. two servers in
    one process) a private one is made, since each run needs its own slots. ``prefer`` (the
    caller's last runtime) comes back first when it is free and fits the same settings."""
    vocab = drafter.draft_vocab if drafter is not None else None  # draft graphs bake it in
    vocab_key = (vocab.data_ptr(), vocab.numel()) if vocab is not None and vocab.numel() else None
    key = (
        id(drafter),
        gamma,
        bool(cuda_graphs),
        bool(compiled),
        tuple(token_tiers),
        tuple(batch_tiers),
        vocab_key,
    )
    with _CACHE_LOCK:
        per_target = _CACHE.setdefault(target, {})
        rt = per_target.get(key)
        if prefer is not None and prefer.key == key and prefer.drafter is drafter:
            rt = prefer
        if rt is not None and rt.drafter is drafter and not rt.busy:
            rt.busy = True
        else:
            rt = None
    if rt is None:
        rt = BatchedRuntime(
            target,
            drafter,
            max_batch=max_batch,
            max_len=max_len,
            gamma=gamma,
            cuda_graphs=cuda_graphs,
            compiled=compiled,
            token_tiers=token_tiers,
            batch_tiers=batch_tiers,
        )
        rt.busy = True
        rt.key = key
        with _CACHE_LOCK:
            cached = per_target.get(key)
            if cached is None or cached.drafter is not drafter:
                per_target[key] = rt
    rt.reset()
    rt.reserve(max_batch, max_len)
    return rt
