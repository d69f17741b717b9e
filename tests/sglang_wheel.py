"""SGLang 0.5.23's own code, loaded from the wheel, building the payloads the tests feed us.

The wheel (``~/.cache/dspark-obs/wheels/sglang-0.5.23-*.whl``, downloaded by .ci/run) is read
as a zip; sglang is never pip-installed (it pins CUDA torch and kernels). The pieces used are
plain Python, executed from the wheel's source text:

* ``dspark_observability.py``: ``DecodeStepRecord``, ``ReqDetail`` and ``DsparkInfoDumper``
  (the step-dump ring buffer: ``observe_decode_step`` / ``dump`` / ``clear``) and
  ``DsparkStepObservers.dump_info_records`` (adds ``simulate_acc_len``);
* ``dspark_block_accept_estimator.py``: ``BlockAcceptEstimateRecorder`` (the estimator JSONL
  writer), driven on CPU tensors through ``observe_verify_step``;
* ``observability/startup_time.py`` + ``model_executor/graph_memory_usage.py``: the
  ``startup_time`` dicts (``build_scheduler_startup_time``, ``build_engine_startup_time``);
* ``entrypoints/http_server.py``: the async ``server_info`` handler (the /server_info body),
  with ``utils/common.py``'s ``build_server_info`` and ``utils/msgspec_utils.py``'s
  ``msgspec_to_builtins``;
* ``managers/communicator.py``: ``FanOutCommunicator`` (internal states in reply order).

Heavy imports are not executed: each module's ``from sglang... import`` lines are dropped and
the names they bound are given light stubs (``STUBS`` below: ``FutureTensors`` copies tensors to
host at once, ``envs`` reads nothing, the global server state is a namespace). Only the
functions and classes named are taken from ``http_server.py`` and ``common.py`` (with ``ast``),
decorators removed. torch is the CPU build the project already installs.
"""

from __future__ import annotations

import ast
import asyncio
import random
import threading
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

WHEELS = Path.home() / ".cache" / "dspark-obs" / "wheels"
VERSION = "0.5.23"

OBS = "sglang/srt/speculative/dspark_components/dspark_observability.py"
EST = "sglang/srt/speculative/dspark_components/dspark_block_accept_estimator.py"
STARTUP = "sglang/srt/observability/startup_time.py"
GRAPH = "sglang/srt/model_executor/graph_memory_usage.py"
HTTP = "sglang/srt/entrypoints/http_server.py"
COMMON = "sglang/srt/utils/common.py"
MSGSPEC_UTILS = "sglang/srt/utils/msgspec_utils.py"
COMMUNICATOR = "sglang/srt/managers/communicator.py"
PLANNER = "sglang/srt/speculative/dspark_components/dspark_planner.py"
SERVER_ARGS = "sglang/srt/server_args.py"


def find_wheel() -> Path | None:
    found = sorted(WHEELS.glob(f"sglang-{VERSION}-*.whl"))
    return found[0] if found else None


def _no_sglang_imports(tree: ast.Module) -> ast.Module:
    tree.body = [
        n
        for n in tree.body
        if not (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("sglang"))
        and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
    ]
    return tree


def _pick(tree: ast.Module, names: Iterable[str]) -> ast.Module:
    wanted = set(names)
    body = []
    for n in tree.body:
        if (
            isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and n.name in wanted
        ):
            if not isinstance(n, ast.ClassDef):
                n.decorator_list = []
            body.append(n)
    missing = wanted - {n.name for n in body}  # type: ignore[attr-defined]
    if missing:
        raise LookupError(f"not found in the wheel source: {sorted(missing)}")
    return ast.Module(body=body, type_ignores=[])


class _FutureTensors:
    """Stub of sglang's FutureTensors: the copy is done at once (CPU tensors)."""

    def __init__(self, host: dict[str, Any]) -> None:
        self._host = host

    @classmethod
    def device_to_host(cls, tensors: dict[str, Any], d2h_stream: Any = None) -> _FutureTensors:
        return cls({k: v.detach().cpu().clone() for k, v in tensors.items()})

    def wait(self) -> dict[str, Any]:
        return self._host


class _CpuDevice:
    """Stub of torch's device module for CPU: streams and events that do nothing."""

    class Stream:
        def __init__(self, device: Any = None) -> None:
            pass

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            pass

        def record(self) -> None:
            pass


class _Torch:
    """torch, except ``get_device_module`` (CPU torch's Stream takes no device argument)."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)

    @staticmethod
    def get_device_module(device: Any) -> Any:
        return _CpuDevice


class _Env:
    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        return self.value


class _Envs:
    """Stub of sglang.srt.environ.envs: every variable unset (empty tuple / 0 / '')."""

    SGLANG_DSPARK_DEBUG_DUMP = _Env(())
    SGLANG_DSPARK_ENABLE_SPS_RECORD = _Env(False)
    SGLANG_DSPARK_LOG_SPS_PRED_INTERVAL = _Env(0)
    SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH = _Env("")
    SGLANG_DSPARK_BLOCK_ACCEPT_ONLINE_INTERVAL = _Env(0)
    SGLANG_DSPARK_STS_COLLECT_PATH = _Env("")
    SGLANG_DSPARK_DEBUG_CONFIDENCE_METRICS = _Env(False)


STUBS: dict[str, Any] = {
    "FutureTensors": _FutureTensors,
    "envs": _Envs,
    "get_parallel": lambda: SimpleNamespace(attn_tp_rank=0),
    "TOP_K_ALL": 1 << 30,
    "compute_dflash_correct_drafts_and_bonus": None,
    "create_block_accept_estimate_recorder": None,
    "StsDataRecorder": None,
    "verify_logits_adjustments_are_noop": lambda info: True,
    "DelayedDeviceHostHandler": None,
    "RaggedVerifyLayout": object,
    "is_pin_memory_available": lambda device=None: False,
    "redact_watermark_secrets": lambda value: value,
    "describe_kv_events_publisher": lambda server_args: None,
}


_HANDLER_LOCK = threading.Lock()


@dataclass
class Wheel:
    """Namespaces of the wheel's modules, executed from its source text."""

    path: Path
    obs: dict[str, Any] = field(default_factory=dict)
    est: dict[str, Any] = field(default_factory=dict)
    startup: dict[str, Any] = field(default_factory=dict)
    http: dict[str, Any] = field(default_factory=dict)
    comm: dict[str, Any] = field(default_factory=dict)
    version: str = VERSION

    def source(self, member: str) -> str:
        with zipfile.ZipFile(self.path) as zf:
            return zf.read(member).decode()

    def _exec(self, member: str, tree: ast.Module, ns: dict[str, Any]) -> dict[str, Any]:
        ns.setdefault("__name__", f"sglang_wheel.{Path(member).stem}")
        exec(compile(ast.fix_missing_locations(tree), f"<wheel>/{member}", "exec"), ns)
        return ns

    @classmethod
    def load(cls, path: Path) -> Wheel:
        w = cls(path)
        with zipfile.ZipFile(path) as zf:
            meta = zf.read(f"sglang-{VERSION}.dist-info/METADATA").decode()
        w.version = next(
            line.split(":", 1)[1].strip()
            for line in meta.splitlines()
            if line.startswith("Version:")
        )
        w.obs = w._exec(OBS, _no_sglang_imports(ast.parse(w.source(OBS))), dict(STUBS))
        w.obs["torch"] = _Torch()  # globals are looked up at call time
        w.est = w._exec(EST, _no_sglang_imports(ast.parse(w.source(EST))), dict(STUBS))
        graph = w._exec(GRAPH, _no_sglang_imports(ast.parse(w.source(GRAPH))), {})
        w.startup = w._exec(
            STARTUP,
            _no_sglang_imports(ast.parse(w.source(STARTUP))),
            {
                "empty_graph_time_usage": graph["empty_graph_time_usage"],
                "merge_graph_time_usage": graph["merge_graph_time_usage"],
            },
        )
        utils = w._exec(
            MSGSPEC_UTILS,
            _pick(ast.parse(w.source(MSGSPEC_UTILS)), ["msgspec_to_builtins"]),
            {
                "msgspec": __import__("msgspec"),
                "dataclasses": __import__("dataclasses"),
                "Any": Any,
            },
        )
        common = w._exec(
            COMMON,
            _pick(ast.parse(w.source(COMMON)), ["build_server_info"]),
            {**STUBS, "Dict": dict, "Any": Any},
        )
        http_ns = {
            **STUBS,
            "List": list,
            "Dict": dict,
            "Any": Any,
            "__version__": w.version,
            "msgspec_to_builtins": utils["msgspec_to_builtins"],
            "build_server_info": common["build_server_info"],
        }
        w.http = w._exec(HTTP, _pick(ast.parse(w.source(HTTP)), ["server_info"]), http_ns)
        w.comm = w._exec(COMMUNICATOR, _no_sglang_imports(ast.parse(w.source(COMMUNICATOR))), {})
        return w

    # ------------------------------------------------------------------ builders

    def dumper(
        self,
        *,
        gamma: int = 5,
        mode: str = "compact",
        max_records: int = 200_000,
        components: Sequence[str] = ("core", "step_cpu_time", "reqs"),
    ) -> Any:
        """SGLang's DsparkInfoDumper (a deque ring of ``max_records``), clocked by a counter."""
        import torch

        ticks = iter(range(10**12))
        return self.obs["DsparkInfoDumper"](
            components=set(components),
            gamma=gamma,
            verify_num_draft_tokens=gamma + 1,
            attn_tp_rank=0,
            device=torch.device("cpu"),
            mode_value=mode,
            max_records=max_records,
            clock=lambda: next(ticks) * 0.004,
        )

    def dump_info_records(self, dumper: Any) -> dict | None:
        """DsparkStepObservers.dump_info_records on this dumper (adds ``simulate_acc_len``)."""
        me = SimpleNamespace(_info_dumper=dumper, _simulate_acc_len=0.0)
        return self.obs["DsparkStepObservers"].dump_info_records(me)

    def scheduler_startup_time(self, seed: int) -> dict:
        rnd = random.Random(seed)
        return self.startup["build_scheduler_startup_time"](
            target_load_weight=rnd.uniform(5, 30),
            draft_load_weight=rnd.uniform(0.5, 3),
            kv_cache_allocation=rnd.uniform(0.5, 4),
            scheduler_e2e=rnd.uniform(20, 90),
            target_cuda_graph={"decode": rnd.uniform(1, 9), "target_verify": rnd.uniform(1, 9)},
            draft_cuda_graph={"draft_decode": rnd.uniform(0.5, 4)},
        )

    def engine_startup_time(self, scheduler_times: Sequence[dict], seed: int) -> dict:
        return self.startup["build_engine_startup_time"](
            scheduler_times, tokenizer_e2e=random.Random(seed).uniform(30, 120)
        )

    def server_info_body(
        self,
        states: Sequence[dict],
        *,
        startup_time: dict | None,
        server_args: dict | None = None,
        reply_order: Sequence[int] | None = None,
    ) -> dict:
        """The /server_info body as SGLang's handler builds it.

        ``states`` are the ranks' internal states; FanOutCommunicator collects them in
        ``reply_order`` (arrival order; default rank order).
        """
        args = {
            "model_path": "Qwen/Qwen3-8B",
            "served_model_name": "Qwen/Qwen3-8B",
            "speculative_algorithm": "DSPARK",
            "speculative_draft_model_path": "/models/qwen3-8b-dspark",
            "dp_size": len(states),
            **(server_args or {}),
        }
        order = list(range(len(states))) if reply_order is None else list(reply_order)
        comm_cls = self.comm["FanOutCommunicator"]

        async def body() -> dict:
            comm = comm_cls(lambda req: None, len(states), "queueing")

            async def get_internal_state() -> list[dict]:
                task = asyncio.ensure_future(comm(object()))
                await asyncio.sleep(0)
                for i in order:
                    comm.handle_recv(SimpleNamespace(internal_state=states[i]))
                return [r.internal_state for r in await task]

            sa = SimpleNamespace(
                resolved_dict=lambda: dict(args),
                launch_command="python -m sglang.launch_server ...",
            )
            tm = SimpleNamespace(
                get_internal_state=get_internal_state, server_args=sa, startup_time=startup_time
            )
            self.http["_global_state"] = SimpleNamespace(
                tokenizer_manager=tm, scheduler_info={"max_req_input_len": 32768}
            )
            return await self.http["server_info"]()

        with _HANDLER_LOCK:  # the handler reads one module-global server state
            return asyncio.run(body())

    def recorder(self, path: Path, gamma: int = 5) -> Any:
        return self.est["BlockAcceptEstimateRecorder"](path=str(path), gamma=gamma, device="cpu")


# ---------------------------------------------------------------- a simulated server


@dataclass
class SimRank:
    """One DP rank: SGLang's dumper (and optionally its estimator recorder) fed by steps."""

    dumper: Any
    scheduler_startup: dict
    forward_ct: int = 0
    appended: list[int] = field(default_factory=list)  # every decode forward_ct dumped


class SimServer:
    """A DSpark server of ``dp`` ranks whose payloads are built by SGLang's own code.

    ``step()`` runs one decode step on every rank (through ``DsparkInfoDumper.
    observe_decode_step`` with CPU tensors), ``prefill()`` advances forward_ct without a
    record (as SGLang's prefill batches do), ``restart()`` starts a fresh process (new rings,
    forward_ct from 0, new startup_time), ``body()`` is the /server_info JSON.
    """

    def __init__(
        self,
        wheel: Wheel,
        *,
        dp: int = 1,
        gamma: int = 5,
        mode: str = "compact",
        max_records: int = 200_000,
        bs: int = 3,
        seed: int = 0,
        estimator_path: Path | None = None,
        reply_order: Callable[[int], list[int]] | None = None,
    ) -> None:
        self.wheel, self.dp, self.gamma, self.mode = wheel, dp, gamma, mode
        self.max_records, self.bs, self.seed = max_records, bs, seed
        self.estimator_path = estimator_path
        self.reply_order = reply_order
        self.rng = random.Random(seed)
        self.boots = 0
        self.polls = 0
        self.cleared = 0
        self._boot()

    def _boot(self) -> None:
        self.boots += 1
        base = self.seed * 1000 + self.boots * 10
        self.ranks = [
            SimRank(
                self.wheel.dumper(gamma=self.gamma, mode=self.mode, max_records=self.max_records),
                self.wheel.scheduler_startup_time(base + r),
            )
            for r in range(self.dp)
        ]
        self.startup_time = self.wheel.engine_startup_time(
            [r.scheduler_startup for r in self.ranks], base
        )
        self.recorder = (
            None
            if self.estimator_path is None
            else self.wheel.recorder(self.estimator_path, self.gamma)
        )

    def restart(self) -> None:
        if self.recorder is not None:
            self.recorder.flush()
        self._boot()

    def prefill(self) -> None:
        for r in self.ranks:
            r.forward_ct += 1
            r.dumper.note_non_decode_step()

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            for dp, r in enumerate(self.ranks):
                r.forward_ct += 1
                self._decode(dp, r)

    def _decode(self, dp: int, r: SimRank) -> None:
        import torch

        g, bs, rng = self.gamma, self.bs, self.rng
        verify = [rng.randint(1, g + 1) for _ in range(bs)]
        correct = [rng.randint(0, v - 1) for v in verify]
        cap = [0 if self.mode != "cap-accept" else rng.randint(0, g - c) for c in correct]
        rids = [f"b{self.boots}-dp{dp}-r{(r.forward_ct // 7) * bs + i}" for i in range(bs)]
        conf = torch.tensor([[rng.uniform(0.3, 0.99) for _ in range(g)] for _ in range(bs)])
        drafts = torch.tensor([[rng.randint(0, 15) for _ in range(g)] for _ in range(bs)])
        obs = self.wheel.obs["DecodeStepObservation"](
            forward_ct=r.forward_ct,
            bs=bs,
            mode=self.mode,
            budget=sum(verify) - bs,
            lag_steps=2,
            num_verify_tokens=sum(verify),
            verify_tokens_local=sum(verify),
            verify_tokens_dp_synced=-1,
            verify_tokens_graph_key=sum(verify),
            predicted_step_ms=round(rng.uniform(5, 9), 3),
            predicted_theta=0.5,
            verify_lens=torch.tensor(verify, dtype=torch.int32),
            confidence=conf,
            req_pool_indices=torch.arange(bs),
            prefix_lens=torch.tensor([r.forward_ct * 2 + i for i in range(bs)]),
            draft_tokens=drafts,
            bonus_tokens=torch.tensor([rng.randint(0, 15) for _ in range(bs)]),
            correct_len=torch.tensor(correct),
            cap_trim_lens=torch.tensor(cap),
            commit_lens=torch.tensor([c + 1 for c in correct]),
            rids=rids,
        )
        r.dumper.observe_decode_step(obs)
        r.appended.append(r.forward_ct)
        if self.recorder is not None and dp == 0:
            self._estimate(r.forward_ct, rids, drafts, verify, correct, cap)

    def _estimate(
        self,
        fct: int,
        rids: list[str],
        drafts: Any,
        verify: list[int],
        correct: list[int],
        cap: list[int],
    ) -> None:
        import torch

        g, bs, vocab = self.gamma, len(rids), 16
        gen = torch.Generator().manual_seed(fct)
        layout = SimpleNamespace(verify_lens=torch.tensor(verify, dtype=torch.int32))
        self.recorder.observe_verify_step(
            forward_ct=fct,
            rids=rids,
            draft_tokens=drafts,
            corrected_logits=torch.randn(bs, g, vocab, generator=gen),
            draft_temperatures=torch.ones(bs),
            greedy_mask=torch.zeros(bs, dtype=torch.bool),
            target_logits=torch.randn(bs * (g + 1), vocab, generator=gen),
            target_temperatures=torch.ones(bs),
            truncated_sampling_mask=None,
            logits_adjustments_are_noop=True,
            correct_len=torch.tensor(correct),
            cap_trim_lens=torch.tensor(cap),
            bonus=torch.zeros(bs, dtype=torch.long),
            prefix_lens=torch.tensor([fct * 2 + i for i in range(bs)]),
            layout=layout,
        )

    def flush_estimator(self) -> None:
        if self.recorder is not None:
            self.recorder.flush()

    def clear(self) -> None:
        self.cleared += 1
        for r in self.ranks:
            r.dumper.clear()

    def states(self) -> list[dict]:
        out = []
        for dp, r in enumerate(self.ranks):
            out.append(
                {
                    "dp_size": self.dp,
                    "startup_time": r.scheduler_startup,
                    "last_gen_throughput": 100.0 + dp,
                    "dspark_info_record": self.wheel.dump_info_records(r.dumper),
                }
            )
        return out

    def body(self) -> dict:
        self.polls += 1
        order = None if self.reply_order is None else self.reply_order(self.polls)
        return self.wheel.server_info_body(
            self.states(), startup_time=self.startup_time, reply_order=order
        )

    def dumped(self, dp: int) -> list[dict]:
        """The ring of rank ``dp`` as SGLang dumps it (its records, builtins)."""
        return self.wheel.dump_info_records(self.ranks[dp].dumper)["records"]


# ---------------------------------------------------------------- over HTTP


class SimHTTP:
    """Serves a SimServer on 127.0.0.1: GET /server_info (the SGLang-built body, JSON-encoded
    once per call), GET /metrics (``sglang:spec_verify_calls_total``), POST
    /set_internal_state (``dspark_clear_info_records``; answers one bool per rank, as
    SGLang). ``faults`` is a list of what the next /server_info calls do instead: "truncate",
    "drip" (one byte every ``drip_s``), "500", or a callable body -> bytes."""

    def __init__(self, sim: SimServer, drip_s: float = 0.2) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        import msgspec

        self.sim, self.drip_s = sim, drip_s
        self.faults: list[Any] = []
        self.lock = threading.Lock()
        self.verify_calls = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: bytes, length: int | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/metrics":
                    text = (
                        "# TYPE sglang:spec_verify_calls_total counter\n"
                        f"sglang:spec_verify_calls_total {outer.verify_calls}\n"
                    )
                    return self._send(200, text.encode())
                if self.path == "/health":
                    return self._send(200, b"")
                if self.path != "/server_info":
                    return self._send(404, b"")
                with outer.lock:
                    fault = outer.faults.pop(0) if outer.faults else None
                    body = msgspec.json.encode(outer.sim.body())
                if fault == "truncate":
                    return self._send(200, body[: len(body) // 2], length=len(body))
                if fault == "500":
                    return self._send(500, b"internal error")
                if fault == "drip":
                    import time

                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    try:
                        for i in range(len(body)):
                            self.wfile.write(body[i : i + 1])
                            self.wfile.flush()
                            time.sleep(outer.drip_s)
                    except OSError:
                        pass
                    return None
                if callable(fault):
                    body = fault(body)
                return self._send(200, body)

            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                req = msgspec.json.decode(self.rfile.read(n)) if n else {}
                if self.path != "/set_internal_state":
                    return self._send(404, b"")
                ok = bool(req.get("server_args", {}).get("dspark_clear_info_records"))
                if ok:
                    with outer.lock:
                        outer.sim.clear()
                return self._send(200, msgspec.json.encode([ok] * outer.sim.dp))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def step(self, n: int = 1) -> None:
        with self.lock:
            self.sim.step(n)
            self.verify_calls += n * self.sim.bs * self.sim.dp

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
