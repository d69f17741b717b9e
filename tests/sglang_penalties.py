"""SGLang 0.5.23's own penalizers (``sglang/srt/sampling/penaltylib``), run from the wheel's
source, as the reference the engine's penalties are tested against.

The modules' ``from sglang...`` lines are dropped (see :mod:`tests.sglang_wheel`); the names
they bound are the orchestrator's ``_BatchedPenalizer`` and small stubs (no pinned memory, no
NPU, no compiler backend). ``apply_scaling_penalties`` loses its ``torch.compile`` decorator:
the same function, run eagerly on the CPU.
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tests.sglang_wheel import _no_sglang_imports

PENALTYLIB = "sglang/srt/sampling/penaltylib"
MODULES = ("orchestrator", "frequency_penalty", "presence_penalty", "repetition_penalty")


class _Batch:
    """The two attributes of SGLang's ``ScheduleBatch`` the penalizers read."""

    def __init__(self, reqs: list[Any], device: torch.device) -> None:
        self.reqs = reqs
        self.device = device


def load_penaltylib(wheel: Path) -> dict[str, Any]:
    """One namespace holding the orchestrator and the penalizer classes."""
    ns: dict[str, Any] = {
        "__name__": "sglang_wheel.penaltylib",
        "is_pin_memory_available": lambda device=None: False,
        "is_npu": lambda: False,
        "get_compiler_backend": lambda: "eager",
    }
    with zipfile.ZipFile(wheel) as zf:
        for name in MODULES:
            member = f"{PENALTYLIB}/{name}.py"
            tree = _no_sglang_imports(ast.parse(zf.read(member).decode()))
            for node in tree.body:
                if isinstance(node, ast.FunctionDef):
                    node.decorator_list = []
            exec(compile(ast.fix_missing_locations(tree), f"<wheel>/{member}", "exec"), ns)
    return ns


def sglang_penalized(
    lib: dict[str, Any],
    logits: torch.Tensor,
    outputs: Sequence[Sequence[int]],
    frequency: Sequence[float],
    presence: Sequence[float],
    repetition: Sequence[float],
) -> torch.Tensor:
    """``logits`` [B, V] (one row per request) as SGLang's overlap scheduler adjusts them
    after request ``b`` produced ``outputs[b]``: the additive penalties accumulated into
    zeros and added, then the scaling ones (``update_penalties`` +
    ``_apply_pre_grammar_logits_transforms``)."""
    reqs = [
        SimpleNamespace(
            sampling_params=SimpleNamespace(
                frequency_penalty=f, presence_penalty=p, repetition_penalty=r
            )
        )
        for f, p, r in zip(frequency, presence, repetition, strict=True)
    ]
    batch = _Batch(reqs, logits.device)  # the orchestrator keeps a weak reference
    penalizers = {
        lib["BatchedFrequencyPenalizer"],
        lib["BatchedPresencePenalizer"],
        lib["BatchedRepetitionPenalizer"],
    }
    orch = lib["BatchedPenalizerOrchestrator"](logits.shape[1], batch, penalizers)
    if len({len(o) for o in outputs}) != 1:
        raise ValueError("give every request an output of the same length")
    for t in range(len(outputs[0])):  # one token per request per step, as SGLang feeds them
        orch.cumulate_output_tokens(torch.tensor([o[t] for o in outputs], dtype=torch.int64))
    out = logits.float().clone()
    additive = torch.zeros_like(out)
    orch.accumulate_additive_penalties(additive)
    out.add_(additive)
    scaling = orch.accumulate_scaling_penalties()
    if scaling is not None:
        lib["apply_scaling_penalties"](out, scaling)
    return out
