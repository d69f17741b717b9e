"""Where the store phase of one SGLang ring buffer goes: validation, in-batch de-duplication and
the Parquet write, CPU seconds each, on the collector's own tables of ring-shaped records.

The full 0.5.23 ring is 200,000 step records at batch 64 (12.8M request-steps); this times a
slice of it (``--records``) and scales each figure to the full ring. CPU seconds, medians of
``--reps``: a shared machine's load moves wall time, not CPU time. ``--baseline-dir DIR``
(a directory holding an older ``schema.py`` and ``rules.py``, e.g. from ``git show``) times
that version's validation side by side in the same run.

    python bench/bench_store_phase.py --records 20000 --reps 5
    mkdir -p /tmp/old && git show HEAD~1:dspark_obs/schema.py > /tmp/old/schema.py \\
        && git show HEAD~1:dspark_obs/rules.py > /tmp/old/rules.py
    python bench/bench_store_phase.py --baseline-dir /tmp/old
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).parent))
import bench_ring_buffer as ring  # noqa: E402

from dspark_obs import validation  # noqa: E402
from dspark_obs.sglang.records import decode_server_info, records_to_tables  # noqa: E402
from dspark_obs.store import dedupe, layout  # noqa: E402

FULL_RING = 200_000 * 64


def load_baseline(directory: Path) -> types.ModuleType:
    """An older schema.py + rules.py as a private package (their imports pointed at it)."""
    pkg = Path(tempfile.mkdtemp(prefix="bench-store-phase-")) / "baseline_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("schema", "rules"):
        text = (directory / f"{name}.py").read_text()
        text = text.replace("from dspark_obs import rules", "from baseline_pkg import rules")
        text = text.replace("from dspark_obs import schema", "from baseline_pkg import schema")
        (pkg / f"{name}.py").write_text(text)
    sys.path.insert(0, str(pkg.parent))
    import baseline_pkg.schema as old  # noqa: PLC0415 - loaded from the directory given

    return old


def median_cpu(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20_000, help="step records in the slice")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--baseline-dir", type=Path, default=None)
    args = ap.parse_args()
    print("rerun: python bench/bench_store_phase.py " + " ".join(sys.argv[1:]))
    print("load average at start: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    dump = decode_server_info(ring.server_info_body(args.records, 64)).dumps[0]
    chunks = list(
        records_to_tables(dump.records, run_id="bench", dp_rank=0, gamma=dump.gamma, mode=dump.mode)
    )
    rows = sum(c.req_steps.num_rows for c in chunks)
    scale = FULL_RING / rows

    def validate_with(fn: Callable) -> Callable[[], None]:
        def run() -> None:
            for c in chunks:
                assert not fn("steps", c.steps)[1] and not fn("req_steps", c.req_steps)[1]

        return run

    valid = [validation.validate("req_steps", c.req_steps)[0] for c in chunks]
    key = ("dp_rank", "forward_ct", "rid")
    dictionary, split = layout._encodings(valid[0].schema)
    stats = [c for c in layout.STATS_COLUMNS if c in valid[0].column_names]

    def dedupe_all() -> None:
        for t in valid:
            assert dedupe.dedupe_in_batch(t, key).num_rows == t.num_rows

    def parquet_all() -> None:
        for t in valid:
            pq.write_table(
                t,
                io.BytesIO(),
                compression=layout.COMPRESSION,
                row_group_size=layout.ROW_GROUP_ROWS,
                write_statistics=stats,
                use_dictionary=dictionary,
                use_byte_stream_split=split,
            )

    parts = {"validation (steps + req_steps)": validate_with(validation.validate)}
    if args.baseline_dir is not None:
        parts["baseline validation"] = validate_with(load_baseline(args.baseline_dir).validate)
    parts["in-batch de-duplication"] = dedupe_all
    parts["Parquet write (encode + snappy)"] = parquet_all
    print(f"{args.records:,} records, {rows:,} request-steps; CPU s, median of {args.reps}:")
    got = {name: median_cpu(fn, args.reps) for name, fn in parts.items()}
    for name, sec in got.items():
        print(f"  {name:34s} {sec:7.3f} s   per full ring: {sec * scale:5.1f} s")
    if "baseline validation" in got:
        ratio = got["baseline validation"] / got["validation (steps + req_steps)"]
        print(f"  validation, baseline / now: {ratio:.2f}x")


if __name__ == "__main__":
    main()
