"""SGLang's DSpark files that are not HTTP: the SPS profiler's per-step records.

(the STS JSON lives in :mod:`dspark_obs.sts_file`, STS shards in
:mod:`dspark_obs.analytics.sts_shards`, cost tables in :mod:`dspark_obs.cost_table`; all read
and write SGLang's formats.)

``python -m sglang.benchmark.dspark_sps_profiler run --out table.json`` writes, next to the
table, ``table.records.jsonl``: one line per profiled decode step, ``{"repeat",
"batch_size", "batch_size_per_rank", "dp_rank", "forward_ct", "num_running_reqs",
"num_verify_tokens", "step_time" (seconds)}``. :func:`read_sps_records` turns it into
``steps`` rows (``step_cpu_ms`` = step_time * 1000, as the profiler read it), so the store can
answer "does the cost table predict step time" for a real server too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgspec
import pyarrow as pa

from dspark_obs.validation import to_table

__all__ = ["SpsRecordError", "read_sps_records"]


@dataclass(frozen=True)
class SpsRecordError:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


class _SpsRecord(msgspec.Struct, forbid_unknown_fields=False):
    dp_rank: int
    forward_ct: int
    num_running_reqs: int
    num_verify_tokens: int
    step_time: float
    repeat: int = 0
    batch_size: int = 0


_DECODER = msgspec.json.Decoder(_SpsRecord)


def read_sps_records(
    path: str | os.PathLike[str], run_id: str, mode: str = "static"
) -> tuple[pa.Table, list[SpsRecordError]]:
    """The profiler's records JSONL as ``steps`` rows; bad lines are reported and skipped.

    The profiler pins the budget and runs SGLANG_RAGGED_VERIFY_MODE=static by default.
    """
    rows, errors = [], []
    seen: dict[tuple[int, int], int] = {}
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rec = _DECODER.decode(line)
            except msgspec.DecodeError as exc:
                errors.append(SpsRecordError(lineno, str(exc)))
                continue
            if not (rec.step_time > 0 and rec.step_time == rec.step_time):
                errors.append(SpsRecordError(lineno, f"step_time must be > 0, got {rec.step_time}"))
                continue
            key = (rec.dp_rank, rec.forward_ct)
            if key in seen:
                errors.append(
                    SpsRecordError(
                        lineno, f"duplicate dp_rank/forward_ct {key} (first on line {seen[key]})"
                    )
                )
                continue
            seen[key] = lineno
            rows.append(
                {
                    "run_id": run_id,
                    "dp_rank": rec.dp_rank,
                    "forward_ct": rec.forward_ct,
                    "source": "sglang",
                    "mode": mode,
                    "bs": rec.num_running_reqs,
                    "num_running_reqs": rec.num_running_reqs,
                    "num_verify_tokens": rec.num_verify_tokens,
                    "step_cpu_ms": rec.step_time * 1000.0,
                }
            )
    table, type_errors = to_table("steps", rows)
    errors += [SpsRecordError(-1, str(e)) for e in type_errors]
    return table, errors
