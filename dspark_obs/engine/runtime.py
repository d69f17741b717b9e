"""The one interface the decode loop drives: slots, prefill, draft, verify, commit.

Two runtimes implement it: :class:`~dspark_obs.engine.reference.ReferenceRuntime` (one KV cache
and one drafter context per request: the readable model of the algorithm) and
:class:`~dspark_obs.engine.batched.BatchedRuntime` (a slot pool, one attention call per layer
for the whole batch, CUDA graphs on a GPU). The loop (:mod:`dspark_obs.engine.loop`) and the
no-speculation baseline (:mod:`dspark_obs.engine.no_spec`) never ask which one they hold.

The shared contract:

* slots are dense: a running request owns slot ``0..used-1``; :meth:`Runtime.release` moves the
  highest slot's request into the freed one and says which slot moved (row i of a step is
  slot i);
* :meth:`Runtime.forward` appends tokens at the end of slots (lengths advance);
  :meth:`Runtime.commit` keeps a slot's first ``length`` positions (rolling back rejected
  drafts) and sets the token it drafts from next; the drafter's context follows what was
  committed, nothing else;
* :meth:`Runtime.draft` drafts one block for slots ``0..B-1`` from their anchors;
  :meth:`Runtime.verify_block` verifies all of it (anchor + every draft) without the host
  reading the drafts first, and accepts greedily; a runtime that can launch ahead applies
  that acceptance to its own device-side lengths and anchors, so the next step can launch
  before the host has read this one (the host then commits it with ``on_device=True``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from dspark_obs.engine.batched import BatchedRuntime
from dspark_obs.engine.block_verify import BlockVerified, RowSampling
from dspark_obs.engine.drafter import DraftBlock, Drafter
from dspark_obs.engine.model import Target
from dspark_obs.engine.reference import ReferenceRuntime
from dspark_obs.engine.shared_runtime import shared_runtime
from dspark_obs.engine.slots import BATCH_TIERS, TOKEN_TIERS
from dspark_obs.engine.types import EngineConfig, resolved_backend

__all__ = ["Runtime", "Verified", "engine_runtime", "uses_batched"]


class Verified(Protocol):
    """One verify forward's output."""

    def split(self) -> tuple[list[Tensor], list[np.ndarray]]:
        """Per request (in the order given to ``forward``): float logits rows and argmax."""
        ...


class Runtime(Protocol):
    """What :class:`~dspark_obs.engine.loop.Engine` and ``run_no_spec`` need of a runtime."""

    busy: bool  # an engine is running on it (a shared one is not handed out twice)

    @property
    def asynchronous(self) -> bool:
        """Whether calls return before the device finished (CUDA): steps are then timed with
        CUDA events (a synchronous runtime's calls are timed by the host clock)."""
        ...

    def reserve(self, max_batch: int, max_len: int) -> None:
        """Room for ``max_batch`` running requests of up to ``max_len`` positions each."""
        ...

    def reset(self) -> None:
        """Forget every running request (a new run starts)."""
        ...

    def acquire(self) -> int:
        """A free slot (the next dense one)."""
        ...

    def release(self, slot: int) -> int | None:
        """Free ``slot``; returns the slot whose request moved into it (None: it was last)."""
        ...

    def length(self, slot: int) -> int:
        """Committed positions of ``slot`` (the prompt and every kept token)."""
        ...

    def set_anchor(self, slot: int, token: int) -> None:
        """The token ``slot`` drafts from next (the first one after its prefill)."""
        ...

    def set_first_anchors(self, slots: Sequence[int], tokens: Tensor) -> None:
        """The first tokens of just prefilled ``slots`` as the device computed them (int64
        [k], not read here): drafts start from them before the host knows them, and the
        slot's next commit gives the host its anchor."""
        ...

    def can_launch_ahead(self, batch: int) -> bool:
        """Whether a whole-block step of slots ``0..batch-1`` can launch before the host read
        the step before it (drafts and whole-block verifies then start from the device's own
        lengths and anchors, which :meth:`verify_block` advances)."""
        ...

    def commit(self, slot: int, length: int, anchor: int, *, on_device: bool = False) -> None:
        """Keep ``slot``'s first ``length`` positions and draft from ``anchor`` next
        (``on_device``: what :meth:`verify_block` already committed on the device)."""
        ...

    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> Tensor:
        """Run prompts into empty slots: float logits [k, V] of each prompt's last position."""
        ...

    def draft(
        self, temps: Sequence[float], generators: Sequence[torch.Generator | None] | None = None
    ) -> DraftBlock:
        """One block of drafts for slots ``0..B-1`` (B = len(temps))."""
        ...

    def forward(
        self, slots: Sequence[int], tokens: Sequence[Sequence[int]], *, q: int | None = None
    ) -> Verified:
        """Run ``tokens[i]`` at the end of slot ``slots[i]`` (one packed forward)."""
        ...

    def verify_block(
        self,
        block: DraftBlock,
        floor: float | None = None,
        budget: int | None = None,
        *,
        windows_only: bool = False,
        rest: bool = False,
        sampling: RowSampling | None = None,
    ) -> BlockVerified:
        """Verify the anchor and the drafts of slots ``0..B-1`` (B = the block's rows), the
        drafts staying on the device, and accept greedily within windows allocated there from
        the live survival: ``budget`` drafts in all (None: every candidate), by the
        scheduler's top-``b`` rule, drafts whose survival is below ``floor`` never (None: all
        are candidates); ``windows_only`` sends only the windows, else every block; ``rest``
        (with ``windows_only``; cap-accept) then verifies the drafts past the windows in a
        second forward, for their argmax only; ``sampling``: rows of temperature > 0 are
        accepted by lossless rejection sampling there too (greedy rows by the greedy rule).
        ``fetch()`` on the result is the one read-back."""
        ...


def uses_batched(cfg: EngineConfig) -> bool:
    """Whether ``cfg.backend`` picks the batched runtime (``auto`` does, on a GPU and on the
    CPU alike: see :data:`~dspark_obs.engine.types.BACKENDS`)."""
    return resolved_backend(cfg.backend) == "batched"


def engine_runtime(
    target: Target,
    drafter: Drafter,
    cfg: EngineConfig,
    max_len: int,
    prefer: Runtime | None = None,
) -> Runtime:
    """The runtime one engine run drives, handed out busy, with room for ``max_len``.

    Batched: shared across runs and engines on this target (:func:`~dspark_obs.engine.
    shared_runtime.shared_runtime`), so CUDA graphs are captured once (``prefer``: the engine's last
    one, when it is free); ``cfg.capture_graphs`` captures them all now. Reference: a fresh
    one per run (it holds nothing worth keeping)."""
    if not uses_batched(cfg):
        rt = ReferenceRuntime(target, drafter, gamma=cfg.gamma)
        rt.busy = True
        rt.reserve(cfg.max_batch, max_len)
        return rt
    batched = shared_runtime(
        target, drafter, max_batch=cfg.max_batch, max_len=max_len, gamma=cfg.gamma,
        cuda_graphs=cfg.cuda_graphs, compiled=cfg.compile,
        token_tiers=cfg.token_tiers or TOKEN_TIERS, batch_tiers=cfg.batch_tiers or BATCH_TIERS,
        prefer=prefer if isinstance(prefer, BatchedRuntime) else None,
    )  # fmt: skip
    if cfg.capture_graphs:
        table = cfg.cost_table
        trims = cfg.mode in ("compact", "cap-accept") and cfg.device_windows
        trims = trims and table is not None and not table.uninitialized
        rest = trims and cfg.mode == "cap-accept"  # drafts past windows only where they trim
        batched.capture(
            max_len, lambda line: print(line, file=sys.stderr), trims=trims, rest=rest
        )
    return batched
