"""Run several bench scripts (and ``dspark-obs`` commands) one after another in ONE process.

Why: on the H200 a bench process spends most of its first minutes compiling (inductor's disk
caches are off for the runtime's compiled functions, see ``engine/packed.py``): the batch
1-64 throughput bench took 290 s, 230 s of them in warm-ups that compile. Compiled functions
live in the process (``packed._COMPILED`` and dynamo's caches, keyed by functions of
``dspark_obs`` that every bench imports), so the second bench of a process should reuse what
the first compiled and pay only its graph captures (not yet measured on the H200). Segments
share one interpreter: compiled code and imported modules carry over (the
point), and so does anything a segment changes in the process (environment variables, torch
settings).

Segments are separated by ``--``; each is a script path (run as ``__main__`` with its own
``sys.argv``) or ``dspark-obs`` followed by a command::

    python bench/run_in_one_process.py \\
        -- bench/bench_throughput.py --device cuda --batch 1,64 --queue-file q.jsonl \\
        -- bench/bench_overlap.py --device cuda --batch 1 --queue-file q.jsonl \\
        -- dspark-obs profile --device cuda --batch-sizes 64,128 --queue-file q.jsonl

Every segment runs, whatever the one before returned; a summary line per segment (exit status
and wall seconds) closes the output, and the exit status is the first non-zero one.
"""

from __future__ import annotations

import runpy
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

CLI = "dspark-obs"


def split_segments(argv: Sequence[str]) -> list[list[str]]:
    """``-- a.py x -- b.py y`` -> ``[["a.py", "x"], ["b.py", "y"]]``; a clear error for
    anything else (no segment, an empty one, a script that does not exist)."""
    if not argv or argv[0] != "--":
        raise ValueError("segments start with '--': -- SCRIPT [ARGS...] [-- SCRIPT ...]")
    segments: list[list[str]] = []
    for arg in argv:
        if arg == "--":
            segments.append([])
        else:
            segments[-1].append(arg)
    for i, seg in enumerate(segments, 1):
        if not seg:
            raise ValueError(f"segment {i} is empty (two '--' in a row, or one at the end)")
        if seg[0] != CLI and not Path(seg[0]).is_file():
            raise ValueError(f"segment {i}: no script at {seg[0]!r} (or use {CLI!r} COMMAND)")
    return segments


def run_segment(segment: Sequence[str]) -> int:
    """Run one segment as its own ``__main__`` and return its exit status (an exception is
    printed and counts as 1)."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = list(segment)
    try:
        if segment[0] == CLI:
            runpy.run_module("dspark_obs", run_name="__main__", alter_sys=True)
        else:  # as ``python SCRIPT`` would: the script's folder first on the path
            sys.path.insert(0, str(Path(segment[0]).resolve().parent))
            runpy.run_path(segment[0], run_name="__main__")
        return 0
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 - a failed segment must not stop the ones after it
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    try:
        segments = split_segments(args)
    except ValueError as exc:
        print(f"run_in_one_process: {exc}", file=sys.stderr)
        return 2
    results: list[tuple[list[str], int, float]] = []
    for i, seg in enumerate(segments, 1):
        print(f"== [{i}/{len(segments)}] {' '.join(seg)}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        rc = run_segment(seg)
        results.append((seg, rc, time.perf_counter() - t0))
    print("== summary", file=sys.stderr)
    for seg, rc, seconds in results:
        print(f"rc {rc:3d}  {seconds:8.1f} s  {' '.join(seg)}", file=sys.stderr)
    return next((rc for _, rc, _ in results if rc), 0)


if __name__ == "__main__":
    raise SystemExit(main())
