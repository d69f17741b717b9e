"""The engine side of one HTTP generation request: its ``n`` samples queued in the
:class:`EngineService`, their tokens as they arrive (SGLang's stop-string rule applied), and
cancellation when the client goes away.

The service's per-request queues are filled by the engine thread; :func:`_notify_on_put`
makes each ``put`` also wake the event loop, so a waiting request holds no thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from dspark_obs.engine.types import EngineError, GenRequest
from dspark_obs.sglang.http_limits import HttpLimits
from dspark_obs.sglang.http_models import SamplingParams
from dspark_obs.sglang.service import EngineService, FinishedRequest

__all__ = ["ClientGone", "Generation", "Group", "HttpError", "submit", "wait_done"]


class HttpError(Exception):
    """A refusal with its status; rendered as the JSON error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ClientGone(Exception):
    """The client closed the connection before its answer."""


class Generation:
    """One sample in flight: its tokens as they arrive, SGLang's stop-string rule applied
    (the text is cut at the first stop string and the request is cancelled in the engine)."""

    def __init__(self, svc: EngineService, req: GenRequest, sp: SamplingParams) -> None:
        self.svc = svc
        self.req = req
        self.stops = sp.stop_strings()
        self.no_stop_trim = bool(sp.no_stop_trim)
        self.handle: Any = None
        self.ids: list[int] = []
        self.text = ""
        self.matched: str | None = None
        self.finished: FinishedRequest | None = None
        self.error: Exception | None = None

    @property
    def done(self) -> bool:
        return self.finished is not None or self.error is not None

    def take(self, event: Any) -> None:
        """Apply one engine event (tokens, the finished request, or an error)."""
        if isinstance(event, Exception):
            self.error = event
        elif isinstance(event, FinishedRequest):
            self._finish(event)
        elif self.matched is None:
            self._extend(list(event))

    def _extend(self, tokens: list[int]) -> None:
        """Decode once per engine chunk; on a stop string, find the token that completed it
        (a chunk is at most gamma + 1 tokens) and cancel the rest of the request."""
        decode = self.svc.codec.decode
        searched = len(self.text)
        base = len(self.ids)
        self.ids.extend(tokens)
        text = decode(self.ids)
        if not self.stops or _first_stop(text, self.stops, searched) is None:
            self.text = text
            return
        for end in range(base + 1, len(self.ids) + 1):
            text = decode(self.ids[:end])
            hit = _first_stop(text, self.stops, searched)
            if hit is not None:
                pos, stop = hit
                del self.ids[end:]
                self.matched = stop
                self.text = text[: pos + len(stop)] if self.no_stop_trim else text[:pos]
                self.svc.engine.cancel(self.req.rid)
                return

    @property
    def stable_text(self) -> str:
        """The text no later token can take back: while stop strings may still match, the
        last ``len(longest stop) - 1`` characters are held back (SGLang streams likewise)."""
        if self.done or self.matched is not None or not self.stops:
            return self.text
        hold = max(len(s) for s in self.stops) - 1
        return self.text[: len(self.text) - hold] if hold else self.text

    def _finish(self, done: FinishedRequest) -> None:
        meta = dict(done.meta_info)
        if self.matched is not None:
            meta["finish_reason"] = {"type": "stop", "matched": self.matched}
            meta["completion_tokens"] = len(self.ids)
        else:
            self.ids = list(done.output_ids)
            ids = self.ids
            reason = meta.get("finish_reason") or {}
            if isinstance(reason.get("matched"), int) and not self.no_stop_trim and ids:
                ids = ids[:-1]  # SGLang's text leaves a matched stop token out
            self.text = self.svc.codec.decode(ids)
        self.finished = FinishedRequest(list(self.ids), meta)

    def cancel(self) -> None:
        if not self.done:
            self.svc.engine.cancel(self.req.rid)


def _first_stop(text: str, stops: tuple[str, ...], searched: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends past ``searched`` characters."""
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, max(0, searched - len(stop) + 1))
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


class Group:
    """The ``n`` samples of one HTTP request, woken by one event from the engine thread."""

    def __init__(self, gens: list[Generation]) -> None:
        self.gens = gens
        self.wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        for gen in gens:
            _notify_on_put(gen.handle.events, loop, self.wake)

    @property
    def done(self) -> bool:
        return all(g.done for g in self.gens)

    async def updates(self) -> AsyncIterator[list[int]]:
        """Yields the indices of the samples that changed, until every one has finished."""
        while True:
            self.wake.clear()
            changed = [i for i, g in enumerate(self.gens) if _drain(g)]
            if changed:
                yield changed
            if self.done:
                return
            if not changed:
                await self.wake.wait()

    def cancel(self) -> None:
        for gen in self.gens:
            gen.cancel()


def _drain(gen: Generation) -> bool:
    moved = False
    while not gen.done:
        try:
            event = gen.handle.events.get_nowait()
        except queue.Empty:
            break
        gen.take(event)
        moved = True
    return moved


def _notify_on_put(
    events: queue.Queue[Any], loop: asyncio.AbstractEventLoop, wake: asyncio.Event
) -> None:
    """Make the engine thread's ``events.put`` also wake the event loop.

    The handle's queue is filled by the engine thread; wrapping its ``put`` lets the loop
    wait without a thread per request. Items put before the wrap are already in the queue
    and are drained first, so none is missed."""
    put = events.put

    def put_and_wake(item: Any, block: bool = True, timeout: float | None = None) -> None:
        put(item, block, timeout)
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            loop.call_soon_threadsafe(wake.set)

    events.put = put_and_wake  # type: ignore[method-assign]


def submit(
    svc: EngineService, limits: HttpLimits, ids: list[int], sp: SamplingParams, rid: str | None
) -> Group:
    """Queue the request's ``n`` samples (distinct seeds when sampling); 503 when full."""
    n = sp.n or 1
    if svc.running + n > limits.max_inflight:
        raise HttpError(
            503,
            f"server busy: {svc.running} requests in flight "
            f"(limit {limits.max_inflight}); retry later",
        )
    base = rid or uuid.uuid4().hex
    gens: list[Generation] = []
    try:
        for i in range(n):
            req = _gen_request(svc, ids, sp, base if n == 1 else f"{base}-{i}", i)
            gen = Generation(svc, req, sp)
            gen.handle = svc.submit(req)
            gens.append(gen)
    except EngineError as exc:
        for gen in gens:
            gen.cancel()
        raise HttpError(400, str(exc)) from None
    return Group(gens)


def _gen_request(
    svc: EngineService, ids: list[int], sp: SamplingParams, rid: str, index: int
) -> GenRequest:
    max_new = sp.max_new_tokens
    temperature = 1.0 if sp.temperature is None else sp.temperature  # SGLang's default
    top_k = -1 if sp.top_k is None else sp.top_k
    if top_k >= svc.codec.vocab_size:
        top_k = -1  # the whole vocabulary either way (SGLang: TOP_K_ALL)
    seed = sp.sampling_seed or 0
    if index and temperature > 0:
        seed = (seed + index) % 2**63  # distinct samples; greedy ones are identical anyway
    return GenRequest(
        rid=rid,
        prompt_ids=list(ids),
        max_new_tokens=svc.config.default_max_new_tokens if max_new is None else max_new,
        temperature=float(temperature),
        top_p=1.0 if sp.top_p is None else float(sp.top_p),
        top_k=int(top_k),
        seed=int(seed),
        ignore_eos=bool(sp.ignore_eos),
        stop_token_ids=tuple(sp.stop_token_ids or ()),
        min_new_tokens=int(sp.min_new_tokens or 0),
        frequency_penalty=_or(sp.frequency_penalty, 0.0),  # SGLang's defaults: no penalty
        presence_penalty=_or(sp.presence_penalty, 0.0),
        repetition_penalty=_or(sp.repetition_penalty, 1.0),
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else float(value)


async def wait_done(group: Group, request: Request) -> None:
    """Wait for every sample; if the client disconnects first, cancel them (ClientGone)."""

    async def consume() -> None:
        async for _ in group.updates():
            pass

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(consume())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            group.cancel()
    if not work.done() or work.cancelled():
        raise ClientGone()
    work.result()
    errors = [g.error for g in group.gens if g.error is not None]
    if errors:
        raise HttpError(500, f"engine error: {errors[0]}")
