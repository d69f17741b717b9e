"""Bench and gate the embedded engine-server: static (BASE) vs compact (NEW), real SmolLM2.

Starts two `dspark-obs engine-server` processes on loopback (shipped drafter, CPU cost
table), runs `dspark-obs gate BASE NEW` (parity, accept length, contamination, derived step
time with its bootstrap interval) and writes the Markdown and JSON reports. Both servers
run side by side on one machine, so the step-time ratio is measured under the same load.

    python bench/bench_gate.py --prompts 2 --parity-tokens 256 --bench-requests 8 \
        --output-len 32 --out out/bench_gate
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from dspark_obs.serving import ServingClient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--parity-tokens", type=int, default=256)
    ap.add_argument("--bench-requests", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--base-mode", default="static")
    ap.add_argument("--new-mode", default="compact")
    ap.add_argument("--out", type=Path, default=Path("out/bench_gate"))
    args = ap.parse_args()

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    servers, urls = [], []
    try:
        for mode in (args.base_mode, args.new_mode):
            port = _free_port()
            servers.append(subprocess.Popen(
                [sys.executable, "-m", "dspark_obs", "engine-server", "--port", str(port),
                 "--mode", mode], env=env, stdout=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            ServingClient(url).wait_ready(timeout=600)
        args.out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "dspark_obs", "gate", *urls,
               "--prompts", str(args.prompts), "--parity-tokens", str(args.parity_tokens),
               "--bench-requests", str(args.bench_requests), "--output-len",
               str(args.output_len), "--rounds", str(args.rounds),
               "--report", str(args.out / "gate.md"), "--json", str(args.out / "gate.json")]
        start = time.monotonic()
        code = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode
        result = json.loads((args.out / "gate.json").read_text())
        print((args.out / "gate.md").read_text())
        for side in ("base", "new"):
            s = result[f"{side}_summary"]
            print(f"{side} ({args.base_mode if side == 'base' else args.new_mode}): derived step "
                  f"{s['derived_step_ms']:.1f} ms, TPOT {s['tpot_ms']['mean']:.1f} ms, accept "
                  f"{s['accept_length']['mean']:.3f}, {s['output_throughput']:.2f} tok/s")
        print(f"gate exit code {code}, {time.monotonic() - start:.0f} s")
        print("rerun: python bench/bench_gate.py " + " ".join(sys.argv[1:]))
        return 0
    finally:
        for proc in servers:
            proc.terminate()
        for proc in servers:
            proc.wait(timeout=60)


if __name__ == "__main__":
    raise SystemExit(main())
