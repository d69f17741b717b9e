"""The engine's request, configuration and result types, apart from the loop that uses them.

Callers import them from here (the loop does not re-export them), so the runtimes
(:mod:`dspark_obs.engine.batched`) and the step pipeline can name them without importing the
loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dspark_obs.cost_table import CostTable
from dspark_obs.engine.penalties import Penalties
from dspark_obs.fanout import LaneStats
from dspark_obs.schema import MODES

__all__ = [
    "BACKENDS",
    "ESTIMATOR_ROWS",
    "MASKED_LOGIT",
    "Emit",
    "EngineConfig",
    "EngineError",
    "GenRequest",
    "OnTokens",
    "RequestSource",
    "RunResult",
    "resolved_backend",
]

BACKENDS = ("auto", "batched", "reference")
"""``batched``: the slot-pool runtime (one attention call per layer for the whole batch, CUDA
graphs on a GPU; :mod:`dspark_obs.engine.batched`). ``reference``: per-request caches and
attention (the readable model of the algorithm). ``auto``: ``batched``, on the CPU too,
where it now measures faster than ``reference`` at batch 1 and 8 (README, 2026-12-04)."""


def resolved_backend(backend: str) -> str:
    """The runtime a ``backend`` setting runs: ``auto`` is ``batched`` (see BACKENDS)."""
    return "batched" if backend == "auto" else backend


ESTIMATOR_ROWS = ("all", "sglang")
"""``all``: estimator fields on every sampling setting (exact: log p of the processed
target distribution). ``sglang``: none on greedy or top-k / top-p rows, as SGLang's recorder."""


class EngineError(ValueError):
    """Bad engine input (mode, gamma, prompt...): raised before anything is written."""


@dataclass(frozen=True)
class EngineConfig:
    """How to run DSpark. ``cost_table=None`` verifies every draft (SGLang's default)."""

    mode: str = "compact"
    gamma: int = 5
    lag_steps: int = 2
    max_batch: int = 16
    cost_table: CostTable | None = None
    dp_rank: int = 0
    # steps buffered before records are handed to the sinks (each hand-over has a fixed cost:
    # validation, one store write per table; README, "Records and sinks off the decode thread") ...
    flush_every: int = 256
    flush_seconds: float = 1.0  # ... or this long since the last hand-over, whichever first
    estimator_rows: str = "all"  # see ESTIMATOR_ROWS
    backend: str = "auto"  # see BACKENDS
    cuda_graphs: bool = True  # batched backend on CUDA: replay captured graphs
    overlap: bool = True  # build step k's records while the device drafts step k + 1
    whole_block_verify: bool = True  # verify right after drafting when every block is verified
    # ... and when a compact or cap-accept budget trims: windows allocated, packed on the device
    device_windows: bool = True
    # whole-block steps: launch step k + 1 before reading step k (None: where it overlaps
    # anything, i.e. on an asynchronous runtime such as CUDA; True also on the CPU)
    launch_ahead: bool | None = None
    # ... and with sampled rows, accepted on the device (None: on an asynchronous runtime;
    # on the CPU the host's per-request acceptance measured cheaper: README, "Engine
    # throughput")
    device_sampling: bool | None = None
    # greedy arrivals' first tokens stay on the device (argmax there, drafted from there, read
    # with the first step that ran them), so an arrival does not stop the launched-ahead
    # pipeline (None: on an asynchronous runtime; True also on the CPU, for the tests)
    first_token_on_device: bool | None = None
    compile: bool = False  # batched backend: fuse each layer's dense pieces (torch.compile)
    capture_graphs: bool = False  # capture every decode-step CUDA graph before the first step
    token_tiers: tuple[int, ...] | None = None  # packed-token counts graphs are captured for
    batch_tiers: tuple[int, ...] | None = None  # running-request counts likewise

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise EngineError(f"unknown mode {self.mode!r}; expected one of {list(MODES)}")
        if self.gamma < 1:
            raise EngineError(f"gamma must be >= 1, got {self.gamma}")
        if self.max_batch < 1:
            raise EngineError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.lag_steps < 0:
            raise EngineError(f"lag_steps must be >= 0, got {self.lag_steps}")
        if self.flush_every < 1:
            raise EngineError(f"flush_every must be >= 1, got {self.flush_every}")
        if not (math.isfinite(self.flush_seconds) and self.flush_seconds > 0):
            raise EngineError(f"flush_seconds must be finite and > 0, got {self.flush_seconds}")
        if self.backend not in BACKENDS:
            raise EngineError(f"unknown backend {self.backend!r}; expected one of {list(BACKENDS)}")
        for name in ("token_tiers", "batch_tiers"):
            tiers = getattr(self, name)
            if tiers is not None and (not tiers or min(tiers) < 1):
                raise EngineError(f"{name} must be positive counts, got {tiers}")
        if self.estimator_rows not in ESTIMATOR_ROWS:
            raise EngineError(
                f"unknown estimator_rows {self.estimator_rows!r}; expected one of "
                f"{list(ESTIMATOR_ROWS)}"
            )


@dataclass
class GenRequest:
    """One request to run: already-tokenized prompt plus its sampling settings."""

    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    workload: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    arrival_step: int = 0
    ignore_eos: bool = False  # run to max_new_tokens (SGLang's sampling_params.ignore_eos)
    stop_token_ids: tuple[int, ...] = ()  # extra stop ids on top of the engine's EOS ids
    min_new_tokens: int = 0  # stop ids (EOS included) masked until this many tokens exist
    frequency_penalty: float = 0.0  # SGLang's penalties on output-token counts (penalties.py)
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.frequency_penalty, self.presence_penalty, self.repetition_penalty)


MASKED_LOGIT = -1e9
"""What a masked stop id's logit becomes under ``min_new_tokens``: probability exactly 0 after
any temperature (softmax underflows), yet finite, so estimator log-probs stay finite."""


@dataclass
class RunResult:
    """What a run produced, for the caller's summary line."""

    run_id: str
    steps: int = 0
    requests: int = 0
    committed_tokens: int = 0
    target_tokens: int = 0
    seconds: float = 0.0
    outputs: dict[str, list[int]] = field(default_factory=dict)
    records: LaneStats | None = None
    """The run's record worker queue (engine runs): hand-overs, rows, and how often and how
    long the decode loop waited on a full queue (backpressure)."""
    times: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per request ``(first token, finish)`` on ``time.perf_counter`` (no-spec runs; engine
    runs carry wall-clock times in their ``requests`` rows)."""

    @property
    def tokens_per_second(self) -> float:
        return self.committed_tokens / self.seconds if self.seconds > 0 else 0.0


Emit = Callable[[str, Any], Any]
"""``emit(table, batch)``: an engine run's records, on its record worker's thread, in order:
``steps`` and ``req_steps`` as Arrow tables of the schema's types, ``requests`` as row dicts
(one per finished request). ``FanOut.emit`` takes both."""

RequestSource = Callable[[bool], "Sequence[GenRequest] | None"]
"""Polled once per loop iteration by a long-running :meth:`Engine.run` (a server): called
with ``idle=True`` when nothing is running (it may block until requests arrive), returns new
requests (admitted at the current step), or None once closed (the run then drains)."""

OnTokens = Callable[[str, list[int]], Any]
"""Called with a request's id and the tokens it just committed (the prefill token, then each
step's), for streaming; the request's ``requests`` row marks its end."""
