"""One HTTP exchange of a collector poll, every byte of it before the poll's deadline: a
server dripping a byte a second cannot keep a poll alive past ``--duration``, and every
failure (refused, reset, timed out, cut short) is one :class:`CollectError` naming the URL."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

__all__ = ["CollectError", "fetch"]


class CollectError(RuntimeError):
    """A poll failed (server down, timeout, bad body); retried by :meth:`Collector.run`.

    ``notes``: what the failed poll had found before it failed (a restart, stored rows'
    gaps), so the caller still reports them."""

    notes: tuple[str, ...] = ()


def fetch(
    url: str,
    *,
    deadline: float,
    clock: Callable[[], float],
    timeout_s: float,
    body: Any = None,
) -> bytes:
    """GET ``url`` (POST ``body`` as JSON when given), the whole answer before ``deadline``
    (on ``clock``); ``timeout_s`` is the poll's bound, named in the error."""
    remaining = deadline - clock()
    if remaining <= 0:
        raise CollectError(f"{url}: poll deadline ({timeout_s:g} s) passed")
    req = (
        urllib.request.Request(url)
        if body is None
        else urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
    )
    try:
        with urllib.request.urlopen(req, timeout=min(remaining, timeout_s)) as resp:
            parts = []
            while chunk := resp.read1(1 << 20):
                parts.append(chunk)
                if clock() > deadline:
                    raise CollectError(
                        f"{url}: body not complete within the poll deadline ({timeout_s:g} s)"
                    )
            return b"".join(parts)
    except CollectError:
        raise
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        raise CollectError(f"{url}: {type(exc).__name__}: {exc}") from None
