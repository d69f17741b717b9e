"""Profile the embedded engine's step time and fit an SGLang additive cost table.

Like SGLang's ``dspark_sps_profiler``: pin the budget to fractions of ``bs * gamma`` (the
scheduler's ``forced_budget_frac``), run real compact decode steps at several batch sizes,
take each step's measured time, and fit ``T(bs, K) = bias + alpha(bs) + theta(bs + K)``.
The table is then what the scheduler uses to trade verified tokens against step time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from dspark_obs.engine.costs import AdditiveCostTable, fit_additive
from dspark_obs.engine.loop import Engine, EngineConfig, GenRequest
from dspark_obs.fanout import FanOut, MemorySink


def profile_steps(
    target,
    drafter,
    prompts: Sequence[list[int]],
    *,
    gamma: int = 5,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    fractions: Sequence[float] = (0, 0.25, 0.5, 0.75, 1),
    new_tokens: int = 24,
    progress: Callable[[str], None] | None = None,
) -> list[tuple[int, int, float]]:
    """Measured ``(bs, K, seconds)`` samples from real compact steps with pinned budgets."""
    samples: list[tuple[int, int, float]] = []
    for bs in batch_sizes:
        for frac in fractions:
            reqs = [
                GenRequest(
                    rid=f"p{i}",
                    prompt_ids=list(prompts[i % len(prompts)]),
                    max_new_tokens=new_tokens,
                    seed=i,
                )
                for i in range(bs)
            ]
            engine = Engine(
                target, drafter, EngineConfig(mode="compact", gamma=gamma, max_batch=bs)
            )
            engine.scheduler.forced_budget_frac = float(frac)
            sink = MemorySink()
            engine.run(reqs, FanOut([sink]).emit, f"profile-{bs}-{frac}")
            steps = sink.table("steps").to_pandas()
            full = steps[steps.bs == bs].iloc[1:]  # first step pays one-off allocations
            samples += [(bs, int(r.budget), r.step_cpu_ms / 1000.0) for r in full.itertuples()]
            if progress:
                progress(f"bs={bs} frac={frac}: {len(full)} steps")
    return samples


def fit_table(samples: Sequence[tuple[int, int, float]], m_bin: int = 4) -> AdditiveCostTable:
    """Fit the additive table; theta is made non-decreasing so more tokens never look cheaper."""
    table = fit_additive(samples, m_bin=m_bin)
    theta = np.maximum.accumulate(np.asarray(table.theta_seconds, dtype=float))
    return replace(table, theta_seconds=tuple(float(t) for t in theta))
