"""Per-request overhead of the engine-server's HTTP stack: FastAPI + uvicorn (now) against the
hand-rolled http.server handler it replaced (loaded from git at ``--baseline-ref``).

Both serve the same tiny random model on loopback. Measured per request, medians of
``--repeats`` rounds of ``--requests`` sequential requests each:

* ``GET /v1/models`` on a kept-alive connection: the HTTP layer alone;
* ``POST /generate`` with ``max_new_tokens=1`` on a kept-alive connection: parse, validate,
  one engine prefill, render;
* the same on a fresh connection per request (connection setup included).

    python bench/bench_engine_server_http.py            # prints a table, writes JSON
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_obs.sglang.engine_server import (  # noqa: E402
    EngineServer,
    ServerOptions,
    build_service,
)
from dspark_obs.testing.tiny_models import byte_models  # noqa: E402

GENERATE = json.dumps(
    {"text": "hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
).encode()


def baseline_server_class(ref: str) -> Any:
    """The old EngineServer, from its source at ``ref`` (it imports today's service)."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:dspark_obs/sglang/engine_server.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "engine_server_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("engine_server_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.EngineServer


def _time_requests(
    port: int, n: int, method: str, path: str, body: bytes | None, fresh: bool
) -> tuple[float, float]:
    """(median wall seconds, process CPU seconds) per request over ``n`` sequential ones.

    CPU time (client and server threads of this process together; the client is the same
    for both servers) is the robust figure on a loaded machine, where wall time is mostly
    waiting to be scheduled."""
    times = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    cpu0 = time.process_time()
    for _ in range(n):
        if fresh:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        t0 = time.perf_counter()
        conn.request(method, path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        times.append(time.perf_counter() - t0)
        assert resp.status == 200, resp.status
        if fresh:
            conn.close()
    conn.close()
    return statistics.median(times), (time.process_time() - cpu0) / n


CASES = {
    "GET /v1/models, keep-alive": ("GET", "/v1/models", None, False),
    "POST /generate (1 token), keep-alive": ("POST", "/generate", GENERATE, False),
    "POST /generate (1 token), new connection": ("POST", "/generate", GENERATE, True),
}


def measure(server_cls: Any, requests: int, repeats: int) -> dict[str, list[tuple[float, float]]]:
    svc = build_service(ServerOptions(port=0, max_batch=4), env={}, models=byte_models())
    srv = server_cls(svc, "127.0.0.1", 0).start()
    port = int(srv.url.rsplit(":", 1)[1])
    try:
        for method, path, body, fresh in CASES.values():  # warm up
            _time_requests(port, 20, method, path, body, fresh)
        return {
            name: [_time_requests(port, requests, m, p, b, f) for _ in range(repeats)]
            for name, (m, p, b, f) in CASES.items()
        }
    finally:
        srv.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--baseline-ref",
        default="570d393",
        help="commit whose engine_server.py is the http.server baseline",
    )
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "runtime" / "bench_engine_server_http.json")
    args = ap.parse_args()
    old = measure(baseline_server_class(args.baseline_ref), args.requests, args.repeats)
    new = measure(EngineServer, args.requests, args.repeats)
    rows = []
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'case':42s} {'wall ms old/new':>17s} {'CPU ms old/new':>16s} {'CPU delta':>9s}")
    for name in CASES:
        wall_old, wall_new = (statistics.median(w for w, _ in r[name]) * 1e3 for r in (old, new))
        cpu_old, cpu_new = (statistics.median(c for _, c in r[name]) * 1e3 for r in (old, new))
        rows.append(
            {
                "case": name,
                "wall_ms": {"http.server": wall_old, "fastapi": wall_new},
                "cpu_ms": {"http.server": cpu_old, "fastapi": cpu_new},
                "cpu_delta_ms": cpu_new - cpu_old,
                "rounds": {"http.server": old[name], "fastapi": new[name]},
            }
        )
        print(
            f"{name:42s} {wall_old:8.2f}/{wall_new:<8.2f} {cpu_old:7.3f}/{cpu_new:<8.3f} "
            f"{cpu_new - cpu_old:+9.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "requests_per_round": args.requests,
        "rounds": args.repeats,
        "baseline_ref": args.baseline_ref,
        "loadavg_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "cases": rows,
    }
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
