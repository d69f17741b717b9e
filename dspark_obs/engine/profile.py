"""Profile the embedded engine's step time: real compact steps over a (batch, budget) grid.

Like SGLang's ``dspark_sps_profiler``: pin the budget to fractions of ``bs * gamma`` (the
scheduler's ``forced_budget_frac``), run real compact decode steps at several batch sizes and
take each step's measured time. The tables are fitted from those samples in
:mod:`dspark_obs.engine.profile_fit` and scored and saved in
:mod:`dspark_obs.engine.profile_report`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from dspark_obs.engine.loop import Engine
from dspark_obs.engine.profile_fit import StepSample
from dspark_obs.engine.types import EngineConfig, GenRequest
from dspark_obs.fanout import FanOut, MemorySink


def _run_cell(
    target: Any,
    drafter: Any,
    prompts: Sequence[list[int]],
    bs: int,
    frac: float,
    gamma: int,
    new_tokens: int,
    compile: bool = False,
    backend: str = "auto",
) -> list[StepSample]:
    """Steps of one compact run at a pinned budget, full batch only: each step's time is the
    wall time from the step before it to this one (``ts``, stamped when a step is read), so
    the first full-batch step gives none.

    That interval is what a step costs the run: on a synchronous runtime the step's own work
    plus its records, and under launching ahead (CUDA) the steady-state step, in which host
    and device overlap. ``step_cpu_ms`` is neither there: it is the host's share only, and
    leaves out the records built while the next step runs."""
    reqs = [
        GenRequest(
            rid=f"p{i}",
            prompt_ids=list(prompts[i % len(prompts)]),
            max_new_tokens=new_tokens,
            seed=i,
        )
        for i in range(bs)
    ]
    config = EngineConfig(
        mode="compact", gamma=gamma, max_batch=bs, compile=compile, backend=backend
    )
    engine = Engine(target, drafter, config)
    engine.scheduler.forced_budget_frac = float(frac)
    sink = MemorySink()
    engine.run(reqs, FanOut([sink]).emit, f"profile-{bs}-{frac}")
    steps = sink.table("steps")
    if steps is None:
        return []
    frame = steps.to_pandas().sort_values("forward_ct")
    full = frame[frame.bs == bs]
    seconds = full.ts.diff().dt.total_seconds()
    return [
        StepSample(bs, float(frac), int(k) - bs, float(dt))
        for k, dt in zip(full.num_verify_tokens.iloc[1:], seconds.iloc[1:], strict=True)
    ]


def profile_steps(
    target: Any,
    drafter: Any,
    prompts: Sequence[list[int]],
    *,
    gamma: int = 5,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    fractions: Sequence[float] = (0, 0.25, 0.5, 0.75, 1),
    new_tokens: int = 24,
    warmup: bool = True,
    compile: bool = False,
    backend: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> list[StepSample]:
    """Measured step samples from real compact steps over the ``batch_sizes x fractions`` grid.

    ``k`` is what the step really sent (``num_verify_tokens - bs``), which is the pinned
    budget unless some survival fell below the allocator's epsilon. ``backend``: the runtime
    timed (``EngineConfig.backend``): a table predicts the runtime it was profiled on. With
    ``warmup`` one short untimed run of every cell goes first, so one-offs (allocator growth,
    CUDA kernel selection, the capture of the graph tiers a trimmed budget packs) land in no
    cell.
    """
    grid = [(bs, float(frac)) for bs in batch_sizes for frac in fractions]
    if warmup:  # every cell's CUDA graphs (batch tier, and the token tier its budget packs)
        for bs, frac in grid:
            _run_cell(target, drafter, prompts, bs, frac, gamma, 4, compile, backend)
    samples: list[StepSample] = []
    for i, (bs, frac) in enumerate(grid, 1):
        cell = _run_cell(
            target, drafter, prompts, bs, frac, gamma, new_tokens, compile, backend
        )
        samples += cell
        if progress:
            progress(f"[{i}/{len(grid)}] {_cell_line(bs, frac, cell)}")
    return samples


def _cell_line(bs: int, frac: float, cell: Sequence[StepSample]) -> str:
    if not cell:
        return f"bs={bs} frac={frac:g}: no full-batch steps after the first (raise --new-tokens)"
    ms = statistics.median(s.seconds for s in cell) * 1000.0
    k = statistics.median_low(s.k for s in cell)
    return f"bs={bs} frac={frac:g} K={k}: {len(cell)} steps, median {ms:.2f} ms"


def parse_batch_sizes(text: str) -> list[int]:
    """``--batch-sizes``: distinct ints >= 1, in the given order (the order cells run in)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError as exc:
        raise ValueError(f"--batch-sizes must be a comma list of ints, got {text!r}") from exc
    if min(values) < 1 or len(set(values)) != len(values):
        raise ValueError(f"--batch-sizes must list distinct ints >= 1, got {text!r}")
    return values


def parse_fractions(text: str) -> list[float]:
    """``--fractions``: distinct budget fractions in [0, 1] (what ``forced_budget_frac`` takes)."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError as exc:
        raise ValueError(f"--fractions must be a comma list of numbers, got {text!r}") from exc
    if any(not 0.0 <= v <= 1.0 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"--fractions must list distinct numbers in [0, 1], got {text!r}")
    return values
