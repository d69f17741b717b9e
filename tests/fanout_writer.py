"""A writer process for the threaded fan-out crash test (no tests here).

    python tests/fanout_writer.py ROOT RUN_ID N_BATCHES [--drain-every K]

Emits ``test_store_source``'s batches through ``FanOut([Store(ROOT)], threaded=True)`` with
a small queue; after every K-th emit it drains (every sink has written all it was given)
and only then prints ``ACK <table> <k>`` for each batch emitted since the last drain: those
are acknowledged. Prints ``READY`` first and ``DONE`` after closing the fan-out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import test_store_source as src  # noqa: E402

from dspark_obs.fanout import FanOut  # noqa: E402
from dspark_obs.store import Store  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("run_id")
    ap.add_argument("n_batches", type=int)
    ap.add_argument("--drain-every", type=int, default=3)
    args = ap.parse_args()
    batches = list(src.source(args.run_id, args.n_batches))
    fan = FanOut([Store(args.root)], threaded=True, queue_batches=2)
    out = sys.stdout
    out.write("READY\n")
    out.flush()
    unacked: list[tuple[str, int]] = []
    for n, (table, k, batch) in enumerate(batches, 1):
        fan.emit(table, batch)
        unacked.append((table, k))
        if n % args.drain_every == 0:
            fan.drain()
            out.write("".join(f"ACK {t} {i}\n" for t, i in unacked))
            out.flush()
            unacked = []
    fan.close()
    out.write("".join(f"ACK {t} {i}\n" for t, i in unacked) + "DONE\n")
    out.flush()


if __name__ == "__main__":
    main()
