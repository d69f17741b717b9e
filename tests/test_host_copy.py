"""host_copy: a record's device reads wait for its own step's work, not for later launches.

The CUDA cases run only where a GPU is (skipped in CI, which has none)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_obs.engine import block_verify, step, step_rows
from dspark_obs.engine.batched import BatchedRuntime
from dspark_obs.engine.host_copy import read_after, rows_event, upload
from dspark_obs.engine.types import EngineConfig
from tests.test_engine_batched import _requests
from tests.test_engine_launch_ahead import _free_table, _run

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_without_an_event_the_work_runs_where_it_is_called() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    assert rows_event(x.device) is None  # off CUDA there is nothing to wait for
    out = read_after(None, lambda: x[:, 1] * 2)
    np.testing.assert_array_equal(out, [2.0, 10.0, 18.0])


def test_upload_keeps_values_of_a_strided_array() -> None:
    arr = np.arange(20, dtype=np.int64).reshape(4, 5)[:, ::2]  # not contiguous
    out = upload(arr, torch.device("cpu"))
    np.testing.assert_array_equal(out.numpy(), arr)


@cuda
def test_a_read_after_its_event_does_not_wait_for_work_queued_later() -> None:
    dev = torch.device("cuda")
    rows = torch.randn(64, 1000, device=dev)
    ready = rows_event(dev)
    torch.cuda._sleep(2_000_000_000)  # a later step still running on the main stream
    later = torch.cuda.Event()
    later.record()
    cols = np.array([3, 7, 11])
    out = read_after(ready, lambda: rows[:, upload(cols, dev)].double())  # uploads inside
    assert not later.query()  # the read came back while the later work still ran
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out, rows[:, torch.from_numpy(cols).to(dev)].double().cpu())


class _Event:
    """Stands in for a CUDA event on the CPU: which kind of point in a step it marks."""

    def __init__(self, kind: str) -> None:
        self.kind = kind


@pytest.mark.parametrize(
    ("whole_block", "ahead", "expected"),
    [(True, True, {"kept"}), (True, False, {"ready"}), (False, False, {"split"})],
)
def test_every_record_read_waits_for_its_own_steps_event(
    whole_block: bool, ahead: bool, expected: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a runtime with events, each record read of a step's rows is given the event where
    that step's rows became final: the read-back event, the event after the copy a
    launched-ahead step keeps, or the split step's own (after the host rewrote rows). The
    reads run inline here; what is checked is that none goes without its event."""
    real_verify = BatchedRuntime.verify_block

    def verify_with_event(self, block, floor=None, budget=None, **kw):  # type: ignore[no-untyped-def]
        out = real_verify(self, block, floor, budget, **kw)
        out.ready = _Event("ready")  # no host copy: fetch() reads the summary itself
        return out

    seen: list[str | None] = []

    def inline(ready, work):  # type: ignore[no-untyped-def]
        seen.append(getattr(ready, "kind", None))
        return work().cpu().numpy()

    monkeypatch.setattr(BatchedRuntime, "verify_block", verify_with_event)
    monkeypatch.setattr(block_verify, "rows_event", lambda device: _Event("kept"))
    monkeypatch.setattr(step, "rows_event", lambda device: _Event("split"))
    monkeypatch.setattr(step_rows, "read_after", inline)
    cfg = EngineConfig(mode="compact", max_batch=3, backend="batched", cost_table=_free_table(),
                       launch_ahead=ahead, whole_block_verify=whole_block)  # fmt: skip
    _run(cfg, _requests(12, seed=2), stop_ids=(5,), eps=1e-6)
    assert seen  # censored blocks were resolved from the target rows
    assert set(seen) == expected
