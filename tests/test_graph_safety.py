"""The decode step's device functions are graph-safe: each traces as ONE graph.

What a CUDA graph replays must not read a value back to the host (``.item()``, ``.cpu()``,
``.tolist()``), branch in Python on a tensor's value, or make a shape that depends on values
(boolean-mask indexing, ``nonzero``). None of that can be seen on the CPU by running the
functions, and this machine has no GPU to capture them. TorchDynamo can: with
``fullgraph=True`` any of those is an error instead of a graph break. The eager backend
traces only (no code generation), and the traced function must compute what the plain call
computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_obs.engine.batched import BatchedRuntime
from dspark_obs.engine.block_verify import RowSampling, block_plan, summary_columns
from tests.test_engine_loop import _models, _requests


def _one_graph(fn, inputs: dict) -> tuple[torch.Tensor, ...]:  # type: ignore[no-untyped-def]
    """``fn(**inputs)`` traced as one graph, checked against the plain call."""
    torch._dynamo.reset()
    traced = torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)(**inputs)
    plain = fn(**inputs)
    assert all(torch.equal(a, b) for a, b in zip(plain, traced, strict=True))
    return plain


@pytest.fixture(scope="module")
def step_inputs() -> tuple[BatchedRuntime, dict, object]:
    target, drafter = _models(1)
    rt = BatchedRuntime(target, drafter, max_batch=4, max_len=128, gamma=5)
    for r in _requests(3, seed=1):
        rt.prefill([rt.acquire()], [r.prompt_ids])
    gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    block = rt.draft([0.0, 0.9, 0.7], gens)
    inputs = {
        "drafts": block.tokens, "conf": block.confidence.float(),
        "logprobs": block.logprobs.float(), "start": rt._dlen[:3].clone(),
        "anchors": rt._danchor[:3].clone(), "plan": rt._plan(block_plan(3, 5, 1e-6, 6, True)),
        "rows": torch.empty(9), "q": torch.empty(6), "span": torch.empty(64),
    }  # fmt: skip
    return rt, inputs, block


def test_a_whole_block_step_is_one_graph(step_inputs) -> None:  # type: ignore[no-untyped-def]
    rt, inputs, _ = step_inputs
    _one_graph(rt._block_fn, inputs)


@pytest.mark.parametrize("top_k", [-1, 3])
def test_a_sampled_block_step_is_one_graph(step_inputs, top_k: int) -> None:  # type: ignore[no-untyped-def]
    rt, inputs, block = step_inputs
    sampling = RowSampling(
        temperature=np.array([0.0, 0.9, 0.7]), top_p=np.array([1.0, 0.8, 1.0]),
        top_k=np.array([-1, -1, top_k]), coins=np.random.default_rng(0).random((3, 6)),
    )  # fmt: skip
    _one_graph(rt._sampled_block_fn, {**inputs, **rt._sampling_inputs(sampling, block, 3)})


def test_cap_accepts_second_forward_is_one_graph(step_inputs) -> None:  # type: ignore[no-untyped-def]
    rt, inputs, block = step_inputs
    summary = rt._block_fn(**inputs)[1]
    rest = {
        "drafts": block.tokens, "start": inputs["start"], "anchors": inputs["anchors"],
        "summary": summary, "rows": torch.empty(15), "q": torch.empty(6),
        "span": torch.empty(64),
    }  # fmt: skip
    (merged,) = _one_graph(rt._rest_fn, rest)
    argmax = merged[:, summary_columns(5)["argmax"]]
    assert (argmax >= 0).all()  # every cell verified: the windows', then the rest
