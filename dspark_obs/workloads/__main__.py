"""``python -m dspark_obs.workloads``: prompt counts, samples and workload files.

python -m dspark_obs.workloads counts
python -m dspark_obs.workloads show math --split eval -n 3 --seed 1
python -m dspark_obs.workloads mix -n 64 --shares math=0.5,chat=0.3,poetry=0.2 -o t.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dspark_obs.workloads import (
    SPLITS,
    WORKLOADS,
    available,
    load_prompts,
    mixed_traffic,
    save_traffic,
)


def _shares(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected workload=share, got {part!r}")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"share of {name!r} is not a number") from None
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m dspark_obs.workloads")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("counts", help="prompts available per workload and split")
    show = sub.add_parser("show", help="print sampled prompts")
    show.add_argument("workload", choices=WORKLOADS)
    show.add_argument("--split", choices=SPLITS, default="eval")
    show.add_argument("-n", type=int, default=3)
    show.add_argument("--seed", type=int, default=0)
    mix = sub.add_parser("mix", help="write a mixed-traffic workload file (JSONL)")
    mix.add_argument("-n", type=int, required=True)
    mix.add_argument("--shares", type=_shares, default=None)
    mix.add_argument("--seed", type=int, default=0)
    mix.add_argument("--split", choices=SPLITS, default="eval")
    mix.add_argument("--rate", type=float, default=0.1, help="requests per step (0: all at 0)")
    mix.add_argument("--temperature", type=float, default=0.0)
    mix.add_argument("--top-p", type=float, default=1.0)
    mix.add_argument("--top-k", type=int, default=-1)
    mix.add_argument("-o", "--out", required=True)
    args = parser.parse_args(argv)

    try:
        if args.cmd == "counts":
            for workload in WORKLOADS:
                start = time.perf_counter()
                counts = {split: available(workload, split) for split in SPLITS}
                took = time.perf_counter() - start
                print(f"{workload:7s} " + " ".join(f"{k}={v}" for k, v in counts.items()), end="")
                print(f"  ({took:.2f}s)")
        elif args.cmd == "show":
            for prompt in load_prompts(args.workload, args.split, args.n, args.seed):
                print(json.dumps(prompt.to_dict(), ensure_ascii=False, indent=1))
        else:
            requests = mixed_traffic(
                args.n, args.shares, args.seed, args.split,
                rate=args.rate or None, temperature=args.temperature,
                top_p=args.top_p, top_k=args.top_k,
            )  # fmt: skip
            path = save_traffic(args.out, requests)
            print(f"wrote {len(requests)} requests to {path}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
