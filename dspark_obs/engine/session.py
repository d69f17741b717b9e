"""Glue between workloads, the embedded engine and the record sinks: one run, or a
compact run plus its cap-accept companion, from a workload description to stored records.

Kept out of the CLI so tests and benchmarks drive exactly what ``dspark-obs run`` drives.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dspark_obs.cost_table import CostTable
from dspark_obs.engine.acceptance import SAMPLING_EPS
from dspark_obs.engine.host_tables import (
    PROFILE_SECONDS_NOTE,
    Host,
    cached_host_table,
    profile_command,
    table_host,
    this_host,
)
from dspark_obs.engine.loop import Engine
from dspark_obs.engine.types import (
    EngineConfig,
    EngineError,
    GenRequest,
    RunResult,
    resolved_backend,
)
from dspark_obs.fanout import FanOut, RecordSink

REPO_RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
DEFAULT_DRAFTER = REPO_RUNTIME / "drafter"
DEFAULT_CPU_COST_TABLE = REPO_RUNTIME / "cost_tables" / "smollm2_cpu_batched.json"
"""Profiled on the batched runtime on the CPU (``backend="auto"`` or ``"batched"``), on an
Intel Xeon (its ``host`` block): a CPU run elsewhere prefers this host's cached table
(``host_tables``) and warns when it has none."""
DEFAULT_CPU_REFERENCE_COST_TABLE = REPO_RUNTIME / "cost_tables" / "smollm2_cpu.json"
"""Profiled (2026-11-30) before the batched runtime existed, on the per-request path the
reference runtime keeps (``backend="reference"``)."""
DEFAULT_GPU_COST_TABLE = REPO_RUNTIME / "cost_tables" / "smollm2_h200.json"

_log = logging.getLogger(__name__)


@dataclass
class Models:
    """A loaded target + drafter + tokenizer (the tokenizer may be None for tiny models)."""

    target: Any
    drafter: Any
    tokenizer: Any
    stop_ids: tuple[int, ...]
    model_name: str
    drafter_name: str
    draft_vocab: int = 0  # top-N ids the drafter drafts from (0: the whole vocabulary)


def load_models(
    drafter_path: str | Path | None = None,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    sts: str | Path | Sequence[float] | None = None,
    draft_vocab: int = 0,
) -> Models:
    """SmolLM2-135M-Instruct and the shipped (or given) DSpark drafter (STS: file or values),
    in ``dtype`` (default float32 on the CPU, bfloat16 on a GPU), drafting from the top
    ``draft_vocab`` training ids (0: the whole vocabulary; the commands default to the
    device's size, ``draft_vocab.resolve_draft_vocab``)."""
    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    from dspark_obs.engine.draft_vocab import resolve_draft_vocab, shipped_draft_vocab
    from dspark_obs.engine.drafter import Drafter, missing_checkpoint_files
    from dspark_obs.engine.weights import load_smollm2, stop_token_ids

    n_vocab = resolve_draft_vocab(draft_vocab, str(device))  # checks the size

    path = Path(drafter_path) if drafter_path else DEFAULT_DRAFTER
    missing = missing_checkpoint_files(path)
    if missing:
        names = ", ".join(str(m) for m in missing)
        raise EngineError(f"no drafter checkpoint at {path}: missing {names}")
    target, tokenizer = load_smollm2(device=device, dtype=dtype)
    drafter = Drafter.load(path, target).to(device=device, dtype=dtype).eval()
    if sts is not None:
        drafter.set_sts(sts)
    stops = stop_token_ids(tokenizer)
    if n_vocab:
        drafter.set_draft_vocab(shipped_draft_vocab(n_vocab, stops))
    return Models(target, drafter, tokenizer, stops, "SmolLM2-135M-Instruct", path.name, n_vocab)


def traffic_to_requests(traffic: Sequence[Any], tokenizer: Any) -> list[GenRequest]:
    """Workload TrafficRequests -> tokenized engine requests (chat template applied)."""
    from dspark_obs.engine.weights import encode_chat

    out = []
    for i, t in enumerate(traffic):
        ids = encode_chat(tokenizer, t.prompt.messages)
        out.append(
            GenRequest(
                rid=t.rid or f"{t.prompt.id}-{i}",
                prompt_ids=ids,
                max_new_tokens=t.max_new_tokens,
                workload=t.prompt.workload,
                prompt=t.prompt.text,
                temperature=t.temperature,
                top_p=t.top_p,
                top_k=t.top_k,
                seed=t.seed,
                arrival_step=t.arrival_step,
            )
        )
    return out


def new_run_id(prefix: str = "run") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def run_with_companion(
    models: Models,
    requests: Sequence[GenRequest],
    config: EngineConfig,
    sinks: Sequence[RecordSink],
    run_id: str,
    *,
    companion: bool = False,
    workload: str | None = None,
    seed: int = 0,
    extra_config: dict[str, Any] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    on_fan: Callable[[FanOut], Any] | None = None,
) -> tuple[RunResult, RunResult | None, FanOut]:
    """Run once in ``config.mode``; with ``companion`` also run the same requests in
    cap-accept as ``{run_id}-cap`` linked by ``companion_of``. Returns both results.
    ``on_fan`` sees the FanOut before the first record (e.g. to expose its sinks' counters:
    ``sinks.backpressure.expose_backpressure``). The sinks write on the engine's record
    worker thread (off the decode thread, behind its bounded queue), not on threads of their
    own: on the H200 a thread per sink cost 2-6.5% of throughput, the record worker's thread
    0.0-0.7% (fanout's docstring). ``dspark-obs run`` passes one
    :class:`~dspark_obs.sinks.process.SinkProcess`: the store and the live telemetry in a
    child interpreter, so what they do never holds this process's interpreter lock.

    Everything is checked (requests, gamma, tables) before the first record is emitted.
    """
    if companion and config.mode != "compact":
        raise EngineError(
            "--companion pairs a compact run with a cap-accept run: use --mode compact"
        )
    if companion and any(r.temperature >= SAMPLING_EPS for r in requests):
        # The pair must run the same forwards to commit the same tokens (bf16 rounds by
        # shape): a trimmed cap-accept batch with a sampled row takes the split step, so
        # compact's trimmed steps do too. Greedy pairs both pack their windows on the device
        # (cap-accept's first forward is then compact's own replay).
        config = replace(config, device_windows=False)
    engine = Engine(models.target, models.drafter, config, models.stop_ids)
    engine.check(requests)
    fan = FanOut(sinks)  # written by whoever emits: the record worker, for step records
    if on_fan is not None:
        on_fan(fan)
    temps = {r.temperature for r in requests}
    temperature = temps.pop() if len(temps) == 1 else None
    cfg_json = {
        "max_batch": config.max_batch,
        "requests": len(requests),
        "cost_table": None if config.cost_table is None else config.cost_table.to_dict(),
        "draft_vocab": models.draft_vocab or None,  # None: the whole vocabulary
        **(extra_config or {}),
    }

    def one(eng: Engine, rid: str, companion_of: str | None) -> RunResult:
        fan.emit(
            "runs",
            [
                eng.run_row(
                    rid,
                    model=models.model_name,
                    drafter=models.drafter_name,
                    workload=workload,
                    temperature=temperature,
                    seed=seed,
                    companion_of=companion_of,
                    config=cfg_json,
                )
            ],
        )
        done = 0

        def tick(n: int) -> None:
            nonlocal done
            done += n
            if progress:
                progress(rid, done, len(requests))

        return eng.run(requests, fan.emit, rid, tick)

    comp = None
    try:
        main = one(engine, run_id, None)
        if companion:
            cap = Engine(
                models.target, models.drafter, replace(config, mode="cap-accept"), models.stop_ids
            )
            comp = one(cap, f"{run_id}-cap", run_id)
    finally:
        # Every emitted batch acknowledged (the engine drained its record worker); the sinks
        # stay open for the caller (which compacts and closes them).
        fan.join()
    return main, comp, fan


def shipped_cost_table(device: str, backend: str = "auto") -> Path:
    """The shipped table for the device and the runtime it will plan for (a table predicts
    the runtime it was profiled on): on the CPU the batched runtime's (``auto``, ``batched``)
    or the reference runtime's; the H200 one on CUDA."""
    if device != "cpu":
        return DEFAULT_GPU_COST_TABLE
    if resolved_backend(backend) == "reference":
        return DEFAULT_CPU_REFERENCE_COST_TABLE
    return DEFAULT_CPU_COST_TABLE


@dataclass(frozen=True)
class CostTableChoice:
    """The table a run plans with, where it came from, and the host it was profiled on.

    ``origin``: ``given`` (a path), ``host`` (this host's cached table, from ``dspark-obs
    profile --for-this-host``), ``shipped``, or ``none`` (verify every draft).
    """

    table: CostTable | None
    path: Path | None
    origin: str
    profiled_on: Host | None  # None: the table does not say (an unknown host)
    here: Host

    @property
    def profiled_here(self) -> bool | None:
        """Whether the table was profiled on this host; None when it does not say."""
        return None if self.profiled_on is None else self.profiled_on.same_as(self.here)

    @property
    def warning(self) -> str | None:
        """One line when a CPU run falls back to a shipped table profiled elsewhere."""
        if self.origin != "shipped" or self.here.device != "cpu" or self.profiled_here:
            return None
        where = "an unknown host" if self.profiled_on is None else self.profiled_on.describe()
        return (
            f"the shipped CPU cost table {self.path} was profiled on {where}, and this host is "
            f"{self.here.describe()}: compact's windows may be wrong here. Profile this host "
            f"once ({PROFILE_SECONDS_NOTE}): {profile_command(self.here)}"
        )

    def summary(self) -> str:
        """One line for a run's summary: which table, and whether it was profiled here."""
        if self.table is None:
            return "cost table: none (every draft verified)"
        label = {"given": "given; ", "shipped": "shipped; "}.get(self.origin, "")
        if self.profiled_on is None:
            host = "profiled on an unknown host"
        elif self.profiled_here:
            host = "profiled on this host"
        else:
            host = f"profiled on {self.profiled_on.describe()}, not this host"
        return f"cost table: {self.path} ({label}{host})"


def resolve_cost_table(
    path: str | Path | None, device: str, backend: str = "auto", draft_vocab: int | None = None
) -> CostTableChoice:
    """The given table; else, on the CPU, this host's cached table for this runtime and
    draft vocabulary (``host_tables.cached_host_table``); else :func:`shipped_cost_table`;
    else none (verify every draft, SGLang's default). ``draft_vocab`` None: the device's
    default. GPU runs never look in the cache."""
    from dspark_obs.engine.draft_vocab import resolve_draft_vocab

    here = this_host(device, backend, resolve_draft_vocab(draft_vocab, device))
    if path is not None:
        table = CostTable.load(path)
        return CostTableChoice(table, Path(path), "given", table_host(table, path), here)
    shipped = shipped_cost_table(device, backend)
    if device == "cpu" and (cached := cached_host_table(shipped.stem, here)) is not None:
        found, table = cached
        return CostTableChoice(table, found, "host", table_host(table, found), here)
    if (device.startswith("cuda") and not torch.cuda.is_available()) or not shipped.is_file():
        return CostTableChoice(None, None, "none", None, here)
    table = CostTable.load(shipped)
    return CostTableChoice(table, shipped, "shipped", table_host(table, shipped), here)


def load_cost_table(
    path: str | Path | None, device: str, backend: str = "auto", draft_vocab: int | None = None
) -> CostTable | None:
    """:func:`resolve_cost_table`'s table; its warning, if any, goes to the log (stderr)."""
    choice = resolve_cost_table(path, device, backend, draft_vocab)
    if choice.warning:
        _log.warning("warning: %s", choice.warning)
    return choice.table
