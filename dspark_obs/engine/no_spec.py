"""Plain greedy decoding, one token per running request per step: the no-speculation
baseline every DSpark number is compared with.

It drives the same :class:`~dspark_obs.engine.runtime.Runtime` interface as the decode loop,
so a benchmark compares DSpark and plain decoding on the same runtime (the batched slot pool
with its CUDA graphs, or the reference per-request caches), never against a loop of its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from dspark_obs.engine.model import Target
from dspark_obs.engine.reference import ReferenceRuntime
from dspark_obs.engine.runtime import Runtime
from dspark_obs.engine.shared_runtime import shared_runtime
from dspark_obs.engine.types import (
    BACKENDS,
    EngineError,
    GenRequest,
    RunResult,
    resolved_backend,
)

__all__ = ["no_spec_runtime", "run_no_spec"]


def no_spec_runtime(
    target: Target,
    backend: str,
    *,
    max_batch: int,
    max_len: int,
    cuda_graphs: bool = True,
    compiled: bool = False,
) -> Runtime:
    """A runtime without a drafter for ``backend`` (see ``BACKENDS``), handed out busy."""
    if backend not in BACKENDS:
        raise EngineError(f"unknown backend {backend!r}; expected one of {list(BACKENDS)}")
    if resolved_backend(backend) == "batched":
        return shared_runtime(
            target, None, max_batch=max_batch, max_len=max_len, gamma=1,
            cuda_graphs=cuda_graphs, compiled=compiled,
        )  # fmt: skip
    rt = ReferenceRuntime(target, None, gamma=1)
    rt.busy = True
    rt.reserve(max_batch, max_len)
    return rt


def run_no_spec(
    target: Target,
    requests: Sequence[GenRequest],
    *,
    max_batch: int,
    stop_ids: Sequence[int] = (),
    backend: str = "batched",
    cuda_graphs: bool = True,
    compiled: bool = False,
) -> RunResult:
    """Greedy decoding of ``requests`` (admitted in arrival step, then rid order, at
    ``max_batch`` concurrency; finished on a stop id unless ``ignore_eos``, or at
    ``max_new_tokens``). ``RunResult.times`` holds each request's (first token, finish)."""
    stops = frozenset(int(s) for s in stop_ids)
    need = max(len(r.prompt_ids) + r.max_new_tokens + 2 for r in requests)
    rt = no_spec_runtime(
        target, backend, max_batch=max_batch, max_len=need, cuda_graphs=cuda_graphs,
        compiled=compiled,
    )  # fmt: skip
    result = RunResult("no-spec")
    waiting = sorted(requests, key=lambda r: (r.arrival_step, r.rid))
    slot_req: list[GenRequest] = []  # slot -> request
    last: list[int] = []  # slot -> its newest token
    first: dict[str, float] = {}

    def done(r: GenRequest, tokens: list[int]) -> bool:
        return (tokens[-1] in stops and not r.ignore_eos) or len(tokens) >= r.max_new_tokens

    def drop(s: int) -> None:  # the highest slot's request moves into slot s
        moved = rt.release(s)
        result.requests += 1
        rid = slot_req[s].rid
        result.times[rid] = (first[rid], time.perf_counter())
        if moved is not None:
            slot_req[s], last[s] = slot_req[moved], last[moved]
        slot_req.pop()
        last.pop()

    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            while waiting or slot_req:
                admit = waiting[: max_batch - len(slot_req)]
                del waiting[: len(admit)]
                if admit:
                    slots = [rt.acquire() for _ in admit]
                    logits = rt.prefill(slots, [r.prompt_ids for r in admit])
                    now = time.perf_counter()
                    for r, tok in zip(admit, logits.argmax(-1).tolist(), strict=True):
                        first[r.rid] = now
                        result.outputs[r.rid] = [tok]
                        result.committed_tokens += 1
                        slot_req.append(r)
                        last.append(tok)
                    for s in sorted(slots, reverse=True):
                        if done(slot_req[s], result.outputs[slot_req[s].rid]):
                            drop(s)
                if not slot_req:
                    continue
                slots = list(range(len(slot_req)))
                _, argmax = rt.forward(slots, [[t] for t in last], q=1).split()  # all kept
                result.steps += 1
                for s, pred in enumerate(argmax):
                    tok = int(pred[0])
                    result.outputs[slot_req[s].rid].append(tok)
                    last[s] = tok
                result.committed_tokens += len(slot_req)
                for s in range(len(slot_req) - 1, -1, -1):
                    if done(slot_req[s], result.outputs[slot_req[s].rid]):
                        drop(s)
    finally:
        rt.busy = False
    result.seconds = time.perf_counter() - t0
    result.target_tokens = result.committed_tokens
    return result
