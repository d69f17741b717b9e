"""Pydantic models of the SGLang 0.5.23 request bodies the engine-server accepts.

Written from the field lists of SGLang's ``SamplingParams``, ``GenerateReqInput`` and
``ChatCompletionRequest``: every value is strictly typed (a string is not a bool, a bool is
not a number, no NaN/infinity, integers bounded), and every key is one of three kinds:

* implemented here (``max_new_tokens``, ``stop``, ``stop_token_ids``, ``min_new_tokens``,
  ``n``, ``temperature``, the frequency / presence / repetition penalties ...; the engine's
  ``check`` refuses out-of-range values with the parameter's name);
* known to SGLang but not to this engine (grammars, min-p, logprobs, LoRA ...): accepted
  at SGLang's default value, refused with the parameter's name otherwise;
* unknown: refused with its name.

Parsing is pydantic's own JSON parser (bounded nesting depth), so a hostile body is a
validation error, never a crash.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "GenerateRequest",
    "InternalStateRequest",
    "SamplingParams",
    "StreamOptions",
    "UnsupportedParameter",
]

MAX_STOP_STRINGS = 32  # SGLang's MAX_STOP_COUNT
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_N = 16  # parallel samples of one request (each takes a batch slot)

Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class UnsupportedParameter(ValueError):
    """A parameter SGLang knows but this engine does not implement, set to a non-default."""


def _refuse_non_default(model: BaseModel, defaults: dict[str, tuple[Any, ...]], where: str) -> None:
    for name, allowed in defaults.items():
        value = getattr(model, name)
        if value not in allowed:
            raise UnsupportedParameter(
                f"{where}{name}={_short(value)} is not supported by this engine "
                f"(allowed: {' or '.join(_short(a) for a in allowed)})"
            )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Strict(BaseModel):
    model_config = STRICT


# ---------------------------------------------------------------- sampling parameters

_SAMPLING_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "stop_regex": (None, [], ""),
    "min_p": (0.0, None),
    "beam_width": (None, 1),
    "json_schema": (None, ""),
    "regex": (None, ""),
    "ebnf": (None, ""),
    "structural_tag": (None, ""),
    "skip_special_tokens": (True, None),
    "spaces_between_special_tokens": (True, None),
    "stream_interval": (None, 1),
    "logit_bias": (None, {}),
    "custom_params": (None, {}),
    "watermark": (None,),
}


class SamplingParams(_Strict):
    """SGLang's ``sampling_params`` object (None means SGLang's default, as there)."""

    max_new_tokens: Count | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Int32 | None = None
    min_new_tokens: Count | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    ignore_eos: bool | None = None
    no_stop_trim: bool | None = None
    sampling_seed: Seed | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    # known to SGLang, not implemented by this engine: default values only
    stop_regex: str | list[str] | None = None
    min_p: float | None = None
    beam_width: Int32 | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stream_interval: Int32 | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None
    watermark: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _known_but_unsupported(self) -> SamplingParams:
        _refuse_non_default(self, _SAMPLING_UNSUPPORTED, "")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


# ---------------------------------------------------------------- /generate

_GENERATE_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "input_embeds": (None,),
    "image_data": (None, []),
    "video_data": (None, []),
    "audio_data": (None, []),
    "return_logprob": (None, False),
    "logprob_start_len": (None, -1),
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None,),
    "return_text_in_logprobs": (False,),
    "return_hidden_states": (False,),
    "modalities": (None, []),
    "session_params": (None,),
    "lora_path": (None,),
    "lora_id": (None,),
    "custom_logit_processor": (None,),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "data_parallel_rank": (None, 0),
}


class GenerateRequest(_Strict):
    """SGLang's ``GenerateReqInput`` for one prompt (batches: send one request each)."""

    text: str | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: SamplingParams | None = None
    stream: bool = False
    rid: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    log_metrics: bool = True
    priority: Int32 | None = None
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    return_logprob: bool | None = None
    logprob_start_len: Int32 | None = None
    top_logprobs_num: Int32 | None = None
    token_ids_logprob: Any = None
    return_text_in_logprobs: bool = False
    return_hidden_states: bool = False
    modalities: list[str] | None = None
    session_params: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    data_parallel_rank: Int32 | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' (a string) or 'input_ids' (token ids)")
        _refuse_non_default(self, _GENERATE_UNSUPPORTED, "")
        return self

    @property
    def sampling(self) -> SamplingParams:
        return self.sampling_params or SamplingParams()


# ---------------------------------------------------------------- OpenAI chat


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One OpenAI chat message: text content only (a string or text parts)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


_CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "min_p": (0.0, None),
    "logit_bias": (None, {}),
    "logprobs": (False, None),
    "top_logprobs": (None, 0),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "regex": (None, ""),
    "ebnf": (None, ""),
    "json_schema": (None, ""),
    "stop_regex": (None, [], ""),
    "skip_special_tokens": (True, None),
    "continue_final_message": (False, None),
    "chat_template_kwargs": (None, {}),
    "lora_path": (None,),
    "return_hidden_states": (False, None),
    "custom_params": (None, {}),
}


class ChatRequest(_Strict):
    """SGLang's ``ChatCompletionRequest``: the OpenAI fields and SGLang's extensions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    model: str | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Int32 | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    no_stop_trim: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_spec_tokens_details: bool = False
    return_output_ids_in_sglext: bool = False
    rid: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    user: str | None = None
    parallel_tool_calls: bool = True
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    # known to SGLang, not implemented by this engine: default values only
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: Int32 | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    stop_regex: str | list[str] | None = None
    skip_special_tokens: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    lora_path: Any = None
    return_hidden_states: bool | None = False
    custom_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _known_but_unsupported(self) -> ChatRequest:
        _refuse_non_default(self, _CHAT_UNSUPPORTED, "")
        return self

    def sampling(self) -> SamplingParams:
        """The request's sampling settings in SGLang's ``sampling_params`` terms."""
        limit = self.max_completion_tokens
        return SamplingParams(
            max_new_tokens=limit if limit is not None else self.max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_new_tokens=self.min_tokens,
            n=self.n,
            ignore_eos=self.ignore_eos,
            no_stop_trim=self.no_stop_trim,
            sampling_seed=self.seed,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
        )


# ---------------------------------------------------------------- /set_internal_state


class ServerArgsUpdate(_Strict):
    """The DSpark keys of SGLang's ``/set_internal_state`` that this engine implements:
    types checked here (a 400), ranges by the handler (``updated: false``, as SGLang)."""

    dspark_clear_info_records: bool | Literal[0, 1] | None = None
    dspark_force_budget_frac: float | None = None


class InternalStateRequest(_Strict):
    """SGLang's ``SetInternalStateReq``: ``{"server_args": {key: number}}`` (SGLang types
    the values ``int | float``; ``null`` unpins the forced budget, ``true`` clears)."""

    server_args: dict[Annotated[str, Field(max_length=128)], bool | int | float | None]
