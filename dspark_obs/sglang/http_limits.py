"""The engine-server's cost bounds, derived from the model so that no request can make the
server do work (or hold memory) out of proportion to what the model can serve.

A prompt longer than the context is refused on its *character* count, before tokenizing: no
token covers more characters than the vocabulary's longest entry, so a text of more than
``context x longest_token_chars`` characters has more than ``context`` tokens whatever the
tokenizer does. The body limit follows from that (JSON may spend up to 6 bytes on one
character: ``\\uXXXX``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["HttpLimits", "max_token_chars"]

MIN_BODY_BYTES = 1 << 20
JSON_BYTES_PER_CHAR = 6
BODY_SLACK_BYTES = 64 << 10  # the non-prompt fields of a request


def max_token_chars(codec: Any) -> int | None:
    """An upper bound on the characters one token of ``codec`` decodes to (None: unknown).

    For a Hugging Face tokenizer it is the longest vocabulary entry in characters: byte-level
    BPE spells each byte as one character (and a byte decodes to at most one character),
    SentencePiece spells text as itself (``▁`` for a space, ``<0xNN>`` for a byte), WordPiece
    adds ``##``; in each an entry is at least as long as the text it stands for."""
    bound = getattr(codec, "max_token_chars", None)
    if isinstance(bound, int) and bound > 0:
        return bound
    tokenizer = getattr(codec, "tokenizer", None)
    if tokenizer is not None and hasattr(tokenizer, "get_vocab"):
        return max((len(tok) for tok in tokenizer.get_vocab()), default=1) or 1
    if type(codec).__name__ == "ByteCodec":  # one character per token
        return 1
    return None


@dataclass(frozen=True)
class HttpLimits:
    """What one request and the server as a whole may cost (README: engine-server limits)."""

    context_tokens: int
    max_prompt_chars: int | None  # None: the codec gives no bound; the body limit still holds
    max_body_bytes: int
    max_inflight: int  # generation requests queued or running (each n counts)
    max_connections: int = 512
    request_timeout_s: float = 30.0  # to receive a whole request (head and body)
    keep_alive_s: float = 5.0

    @classmethod
    def for_service(
        cls,
        service: Any,
        *,
        max_inflight: int | None = None,
        max_connections: int = 512,
        request_timeout_s: float = 30.0,
        max_body_bytes: int | None = None,
    ) -> HttpLimits:
        """Bounds from the service's model context, tokenizer and batch size."""
        context = int(service.engine.target.cfg.max_position)
        per_token = max_token_chars(service.codec)
        chars = None if per_token is None else context * per_token
        if max_body_bytes is None:
            prompt_bytes = JSON_BYTES_PER_CHAR * (chars if chars is not None else context * 64)
            max_body_bytes = max(MIN_BODY_BYTES, prompt_bytes + BODY_SLACK_BYTES)
        if max_inflight is None:
            max_inflight = 8 * int(service.engine.cfg.max_batch)
        for name, value in (
            ("max_inflight", max_inflight),
            ("max_connections", max_connections),
            ("max_body_bytes", max_body_bytes),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        return cls(
            context_tokens=context,
            max_prompt_chars=chars,
            max_body_bytes=max_body_bytes,
            max_inflight=max_inflight,
            max_connections=max_connections,
            request_timeout_s=request_timeout_s,
        )
