"""A cancelled request finishes with SGLang 0.5.23's abort reason, never ``length``.

The expected ``finish_reason`` is built by ``FINISH_ABORT.to_json()`` executed from the wheel's
own source, so the two shapes cannot drift."""

from __future__ import annotations

import ast
import queue
import sys
from pathlib import Path

import pytest

from dspark_obs.engine.types import GenRequest
from dspark_obs.sglang.engine_server import ServerOptions, build_service
from dspark_obs.sglang.service import FinishedRequest
from dspark_obs.testing.tiny_models import byte_models

sys.path.insert(0, str(Path(__file__).parent))
from sglang_wheel import Wheel, _pick, find_wheel  # noqa: E402

BATCH = "sglang/srt/managers/schedule_batch.py"
BOUND_S = 60.0  # bound on a condition that must come true (never a speed claim)


def wheel_abort_reason() -> dict:
    path = find_wheel()
    if path is None:
        pytest.skip("the SGLang 0.5.23 wheel is not in ~/.cache/dspark-obs/wheels")
    wheel = Wheel(path)
    tree = _pick(ast.parse(wheel.source(BATCH)), ["BaseFinishReason", "FINISH_ABORT"])
    ns = wheel._exec(BATCH, tree, {})
    return ns["FINISH_ABORT"]().to_json()


def test_a_cancelled_request_reports_abort_like_sglang() -> None:
    expected = wheel_abort_reason()
    svc = build_service(ServerOptions(port=0, max_batch=2), env={}, models=byte_models())
    svc.start()
    try:
        req = GenRequest("r-abort", [1, 2, 3], max_new_tokens=900, ignore_eos=True)
        handle = svc.submit(req)
        first = handle.events.get(timeout=BOUND_S)  # it runs: tokens have come back
        assert isinstance(first, list) and first
        svc.engine.cancel(req.rid)
        while not isinstance(event := handle.events.get(timeout=BOUND_S), FinishedRequest):
            assert not isinstance(event, Exception), event
        meta = event.meta_info
        assert meta["finish_reason"] == expected
        assert meta["completion_tokens"] < 900
        # a request that runs to its budget still says length
        done = svc.submit(GenRequest("r-len", [1, 2], max_new_tokens=4, ignore_eos=True))
        while not isinstance(event := done.events.get(timeout=BOUND_S), FinishedRequest):
            pass
        assert event.meta_info["finish_reason"] == {"type": "length", "length": 4}
    except queue.Empty:
        pytest.fail("the service never finished the request")
    finally:
        svc.close()
