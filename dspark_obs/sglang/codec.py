"""Text <-> token ids for the engine server: the model's tokenizer, or bytes for tiny models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["ByteCodec", "Codec", "TokenizerCodec"]


class Codec(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]: ...


class ByteCodec:
    """ASCII, one token per character (ids 0..127): lets a tiny random model serve text."""

    vocab_size = 128

    def encode(self, text: str) -> list[int]:
        return [ord(c) & 0x7F for c in text] or [0]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(int(i) & 0x7F) for i in ids)

    def chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        text = "".join(f"{m.get('role', 'user')}: {_content(m)}\n" for m in messages)
        return self.encode(text + "assistant: ")


class TokenizerCodec:
    """A Hugging Face tokenizer with its chat template (SmolLM2)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        from dspark_obs.engine.weights import encode_chat

        return encode_chat(self.tokenizer, [{**m, "content": _content(m)} for m in messages])


def _content(message: Mapping[str, Any]) -> str:
    """OpenAI content: a string, or a list of parts of which the text parts count."""
    content = message.get("content") or ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return str(content)
