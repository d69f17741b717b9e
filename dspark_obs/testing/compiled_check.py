"""One batched runtime run eager and compiled on the same inputs, for tests and the GPU check.

Why here: ``tests/test_engine_batched.py`` (dynamo and AOT autograd on the CPU) and
``bench/check_compiled.py`` (inductor on a GPU) compare the same two runs (a prefill, packed
forwards, one draft) and differ only in the compiler backend and the tolerance they judge by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dspark_obs.engine.batched import BatchedRuntime
from dspark_obs.engine.drafter import DraftBlock, Drafter
from dspark_obs.engine.model import Target


@dataclass(frozen=True)
class RuntimeTrace:
    """What one run produced: each forward's logits, the draft, both pools (copies)."""

    logits: list[Tensor]
    block: DraftBlock
    kv: Tensor
    dkv: Tensor


@torch.no_grad()
def eager_and_compiled(
    target: Target,
    drafter: Drafter,
    prompts: Sequence[list[int]],
    steps: Sequence[Sequence[list[int]]],
    *,
    gamma: int,
    max_len: int,
) -> dict[bool, RuntimeTrace]:
    """``{False: eager, True: compiled}``: each prompt prefilled into its own slot (anchor
    ``slot + 1``), then ``steps`` packed forwards (one token list per slot each), then one
    greedy draft, by a fresh runtime without CUDA graphs (the layers alone are compared)."""
    out = {}
    for compiled in (False, True):
        rt = BatchedRuntime(target, drafter, max_batch=len(prompts) + 1, max_len=max_len,
                            gamma=gamma, cuda_graphs=False)  # fmt: skip
        slots = [rt.acquire() for _ in prompts]
        rt.prefill(slots, list(prompts))
        for s in slots:
            rt.set_anchor(s, s + 1)
        rt.compiled = compiled
        logits = [rt.forward(slots, tokens).logits.clone() for tokens in steps]
        block = rt.draft([0.0] * len(slots), sts=np.ones((len(slots), gamma)))
        assert rt.pool.dkv is not None  # the runtime has a drafter
        out[compiled] = RuntimeTrace(logits, block, rt.pool.kv.clone(), rt.pool.dkv.clone())
    return out
