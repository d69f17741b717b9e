"""Responses of the generation routes: SGLang's ``/generate`` bodies and OpenAI chat
completions (plain and SSE), with SGLang's ``sglext`` extension."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi.responses import StreamingResponse

from dspark_obs.sglang.http_generation import Generation, Group
from dspark_obs.sglang.http_models import ChatRequest

__all__ = ["ChatReply", "GroupStream", "generate_out", "generate_stream"]


class GroupStream(StreamingResponse):
    """An SSE response that cancels its unfinished samples however it ends: finished, the
    client gone (Starlette cancels the stream on ``http.disconnect``), or never started."""

    def __init__(self, group: Group, events: AsyncIterator[bytes]) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.group = group

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.cancel()


def _event(obj: Any) -> bytes:
    data = obj if isinstance(obj, bytes) else msgspec.json.encode(obj)
    return b"data: " + data + b"\n\n"


# ---------------------------------------------------------------- /generate rendering


def generate_out(gen: Generation) -> dict[str, Any]:
    if gen.error is not None:
        return {"error": {"message": f"engine error: {gen.error}", "type": "server_error"}}
    assert gen.finished is not None
    return {
        "text": gen.text,
        "output_ids": gen.finished.output_ids,
        "meta_info": gen.finished.meta_info,
    }


def generate_stream(group: Group) -> AsyncIterator[bytes]:
    many = len(group.gens) > 1

    async def body() -> AsyncIterator[bytes]:
        async for changed in group.updates():
            for i in changed:
                gen = group.gens[i]
                if gen.done:
                    out = generate_out(gen)
                else:
                    out = {
                        "text": gen.stable_text,
                        "output_ids": list(gen.ids),
                        "meta_info": {
                            "id": gen.req.rid,
                            "finish_reason": None,
                            "prompt_tokens": len(gen.req.prompt_ids),
                            "completion_tokens": len(gen.ids),
                        },
                    }
                if many:
                    out["index"] = i
                yield _event(out)
        yield _event(b"[DONE]")

    return body()


# ---------------------------------------------------------------- OpenAI chat rendering


class ChatReply:
    """OpenAI chat.completion (and chunk) bodies with SGLang's ``sglext`` extension."""

    def __init__(self, body: ChatRequest, group: Group, model: str) -> None:
        self.body = body
        self.group = group
        rid = group.gens[0].req.rid if len(group.gens) == 1 else group.gens[0].req.rid[:-2]
        self.id = f"chatcmpl-{rid}"
        self.created = int(time.time())
        self.model = model

    def _usage(self) -> dict[str, int]:
        gens = [g for g in self.group.gens if g.finished is not None]
        prompt = gens[0].finished.meta_info["prompt_tokens"] if gens else 0  # type: ignore[union-attr]
        completion = sum(len(g.ids) for g in gens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _sglext(self) -> dict[str, Any]:
        ext: dict[str, Any] = {}
        finished = [g.finished for g in self.group.gens if g.finished is not None]
        if self.body.return_spec_tokens_details and finished:
            details = _spec_details(finished[0].meta_info)
            if details is not None:
                ext["spec_tokens_details"] = details
        if self.body.return_output_ids_in_sglext:
            ext["output_ids"] = [list(f.output_ids) for f in finished]
        return ext

    def complete(self) -> dict[str, Any]:
        choices = []
        for i, gen in enumerate(self.group.gens):
            assert gen.finished is not None
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": gen.text},
                    "finish_reason": gen.finished.meta_info["finish_reason"]["type"],
                }
            )
        out: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
        }
        ext = self._sglext()
        if ext:
            out["sglext"] = ext
        return out

    def stream(self) -> AsyncIterator[bytes]:
        head = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
        }
        opts = self.body.stream_options
        sent = [0] * len(self.group.gens)

        async def body() -> AsyncIterator[bytes]:
            for i in range(len(self.group.gens)):
                yield _event(
                    {
                        **head,
                        "choices": [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            async for changed in self.group.updates():
                for i in changed:
                    gen = self.group.gens[i]
                    if gen.error is not None:
                        yield _event(
                            {
                                "error": {
                                    "message": f"engine error: {gen.error}",
                                    "type": "server_error",
                                }
                            }
                        )
                        continue
                    delta = gen.stable_text[sent[i] :]
                    reason = None
                    if gen.finished is not None:
                        reason = gen.finished.meta_info["finish_reason"]["type"]
                    elif not delta:
                        continue
                    sent[i] += len(delta)
                    chunk: dict[str, Any] = {
                        **head,
                        "choices": [
                            {"index": i, "delta": {"content": delta}, "finish_reason": reason}
                        ],
                    }
                    if opts is not None and opts.continuous_usage_stats:
                        p = len(gen.req.prompt_ids)
                        chunk["usage"] = {
                            "prompt_tokens": p,
                            "completion_tokens": len(gen.ids),
                            "total_tokens": p + len(gen.ids),
                        }
                    yield _event(chunk)
            ext = self._sglext()
            if ext:
                yield _event({**head, "choices": [], "sglext": ext})
            if opts is not None and opts.include_usage:
                yield _event({**head, "choices": [], "usage": self._usage()})
            yield _event(b"[DONE]")

        return body()


_SPEC_KEYS = {
    "spec_accept_rate": 0.0,
    "spec_accept_length": 0.0,
    "spec_cap_length": 0.0,
    "spec_block_accept_length": 0.0,
    "spec_num_correct_drafts": 0,
    "spec_num_proposed_drafts": 0,
    "spec_verify_ct": 0,
    "spec_correct_drafts_histogram": [],
    "spec_cap_lens_histogram": [],
}


def _spec_details(meta: dict[str, Any]) -> dict[str, Any] | None:
    """SGLang's SpecTokensDetails: every field, zero / empty when meta_info lacks it."""
    if not any(k in meta for k in _SPEC_KEYS):
        return None
    return {k: meta.get(k) or default for k, default in _SPEC_KEYS.items()}
