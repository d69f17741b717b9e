"""Seeded, prefix-stable sampling of prompts from the three workload pools."""

from __future__ import annotations

import random
from collections.abc import Sequence

from dspark_obs.workloads.base import SPLITS, WORKLOADS, Prompt, derive_seed

__all__ = ["available", "load_prompts", "pool"]


def _check(workload: str, split: str) -> None:
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; expected one of {WORKLOADS}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


def pool(workload: str, split: str) -> Sequence[Prompt]:
    """Every prompt of one workload and split, in a fixed order (shared: do not mutate)."""
    _check(workload, split)
    if workload == "math":
        from dspark_obs.workloads import gsm

        return gsm.pool(split)
    if workload == "chat":
        from dspark_obs.workloads import sharegpt

        return sharegpt.pool(split)
    from dspark_obs.workloads import poetry

    return poetry.pool(split)


def available(workload: str, split: str) -> int:
    """How many distinct prompts ``load_prompts`` can return for this workload and split."""
    return len(pool(workload, split))


def _balanced_order(items: Sequence[Prompt], group_key: str, rng: random.Random) -> list[int]:
    """Indices drawn group by group: each draw picks a non-empty group uniformly."""
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(str(item.meta.get(group_key)), []).append(i)
    queues = []
    for name in sorted(groups):
        members = groups[name]
        rng.shuffle(members)
        queues.append(members[::-1])  # pop() from the end = first of the shuffled order
    order: list[int] = []
    while queues:
        pick = rng.randrange(len(queues))
        order.append(queues[pick].pop())
        if not queues[pick]:
            del queues[pick]
    return order


def load_prompts(workload: str, split: str, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """``n`` distinct prompts (all when None) of ``workload`` from ``split``, seeded.

    Same arguments give the same list; a smaller ``n`` gives a prefix of a larger one.
    Math and chat are uniform draws; poetry alternates authors at random so Milton's long
    epic does not crowd out the sonnets. Raises ValueError for an unknown workload or split
    and for ``n`` above :func:`available`.
    """
    _check(workload, split)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"n must be a non-negative int or None, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    items = pool(workload, split)
    if n is not None and n > len(items):
        raise ValueError(
            f"requested {n} {workload!r} prompts from split {split!r} "
            f"but only {len(items)} are available"
        )
    rng = random.Random(derive_seed("load_prompts", workload, split, seed))
    if workload == "poetry":
        order = _balanced_order(items, "author", rng)
    else:
        order = list(range(len(items)))
        rng.shuffle(order)
    return [items[i].copy() for i in order[: len(items) if n is None else n]]
