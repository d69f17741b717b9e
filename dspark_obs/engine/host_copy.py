"""Device reads that wait for one step's work only, not for the steps launched after it.

Under launch-ahead (:mod:`dspark_obs.engine.step`) a step's record work runs after the next
one or two steps were launched on the device's main stream. Any plain ``.cpu()`` or pageable
upload there waits for everything queued on that stream, so the host sits idle until the
device drains, and nothing overlaps any more. :func:`read_after` runs the record's device
work (the estimator's log-p gather) on a side stream that waits only for the event where the
step's rows became final, and copies the result to pinned host memory; :func:`upload` moves
index arrays without waiting for the device at all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

__all__ = ["read_after", "rows_event", "upload"]


def rows_event(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded now on the current stream of ``device`` (None off CUDA): the point
    after which the tensors written so far are final for :func:`read_after`."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def upload(arr: np.ndarray, device: torch.device) -> Tensor:
    """``arr`` on ``device``; on CUDA through pinned memory and without waiting for the device
    (a pageable copy waits for the stream it is queued on)."""
    host = torch.from_numpy(np.ascontiguousarray(arr))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def read_after(ready: torch.cuda.Event | None, work: Callable[[], Tensor]) -> np.ndarray:
    """``work()`` (device work over tensors final at ``ready``; anything else it needs, such as
    index arrays, it uploads itself) as a host array. With an event,
    the work runs on a side stream that waits for ``ready`` only, and the host waits for that
    stream only: steps launched after ``ready`` keep the main stream busy meanwhile. Without
    one (a synchronous runtime, or nothing launched since), it runs where it is called."""
    if ready is None:
        return work().cpu().numpy()
    side = _side_stream(torch.cuda.current_device())
    side.wait_event(ready)
    with torch.cuda.stream(side):
        out = work()
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()  # the side stream's work only
    return host.numpy()


@functools.cache
def _side_stream(device: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)
