"""Fixed-seed benchmark workloads as lists of :class:`GenerationRequest`.

* ``random``: prompts of exactly ``input_len`` random token ids and exactly ``output_len``
  output tokens (``ignore_eos``), as the batch-1 decode campaign's fixed 8192-in /
  1024-out set, scaled to what the target allows. Ids are drawn uniformly from
  ``[low_id, vocab_size)`` so no prompt starts with a special token.
* ``math`` / ``chat`` / ``poetry`` / ``mixed``: the built-in prompt sources (chat messages,
  stop at EOS or ``output_len``), from :mod:`dspark_obs.workloads`.

Same arguments, same requests: the seed fixes prompts, order and per-request sampling seeds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from dspark_obs.serving.client import GenerationRequest

if TYPE_CHECKING:
    from dspark_obs.workloads import TrafficRequest

__all__ = [
    "BENCH_WORKLOADS",
    "build_requests",
    "random_requests",
    "requests_from_traffic",
    "source_requests",
]

BENCH_WORKLOADS = ("random", "math", "chat", "poetry", "mixed")


def random_requests(
    n: int,
    input_len: int,
    output_len: int,
    *,
    seed: int = 0,
    vocab_size: int = 32000,
    low_id: int = 16,
    temperature: float = 0.0,
    prefix: str = "rand",
) -> list[GenerationRequest]:
    """``n`` prompts of ``input_len`` uniform random token ids, each asking ``output_len``."""
    if input_len < 1 or output_len < 1:
        raise ValueError("input_len and output_len must be >= 1")
    if not 0 <= low_id < vocab_size:
        raise ValueError(f"need 0 <= low_id < vocab_size, got {low_id}, {vocab_size}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(low_id, vocab_size, size=(n, input_len))
    seeds = rng.integers(0, 2**31 - 1, size=n)
    return [
        GenerationRequest(
            rid=f"{prefix}-{seed}-{i:05d}",
            input_ids=[int(t) for t in ids[i]],
            max_new_tokens=output_len,
            temperature=temperature,
            seed=int(seeds[i]),
            ignore_eos=True,
            workload="random",
        )
        for i in range(n)
    ]


def source_requests(
    workload: str,
    n: int,
    output_len: int,
    *,
    seed: int = 0,
    temperature: float = 0.0,
    split: str = "eval",
) -> list[GenerationRequest]:
    """``n`` chat prompts of a built-in workload (``mixed``: an equal mix), seeded."""
    from dspark_obs.workloads import WORKLOADS, mixed_traffic

    shares = None if workload == "mixed" else {workload: 1.0}
    if workload != "mixed" and workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; expected one of {BENCH_WORKLOADS}")
    traffic = mixed_traffic(n, shares, seed=seed, split=split, rate=None,
                            max_new_tokens=output_len, temperature=temperature)
    return requests_from_traffic(traffic)


def requests_from_traffic(traffic: Iterable[TrafficRequest]) -> list[GenerationRequest]:
    """Workload traffic (generated, or a ``--workload-file``) as HTTP chat requests: the
    prompt's messages and its sampling settings, seed and workload kept."""
    return [
        GenerationRequest(
            rid=t.rid,
            messages=t.prompt.messages,
            max_new_tokens=t.max_new_tokens,
            temperature=t.temperature,
            top_p=t.top_p,
            top_k=t.top_k,
            seed=t.seed,
            workload=t.prompt.workload,
        )
        for t in traffic
    ]


def build_requests(
    workload: str,
    n: int,
    *,
    input_len: int = 256,
    output_len: int = 64,
    seed: int = 0,
    temperature: float = 0.0,
    vocab_size: int = 32000,
) -> list[GenerationRequest]:
    """The requests of one named workload (see the module docstring)."""
    if n < 1:
        raise ValueError(f"need at least one request, got n={n}")
    if workload == "random":
        return random_requests(n, input_len, output_len, seed=seed, vocab_size=vocab_size,
                               temperature=temperature)
    return source_requests(workload, n, output_len, seed=seed, temperature=temperature)
