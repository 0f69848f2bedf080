"""Request and response models of OpenAI's API (the parts this server speaks), plus vLLM's extras.

Unknown request fields are ignored, as vLLM ignores them. Numbers are bounded here so that no request
can ask the engine for something absurd (a billion choices, an infinite temperature); the engine's
own checks (SamplingParams.validate, prompt length) come after and also answer 400.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator
from pydantic_core import PydanticCustomError

from tpuserve.server.sampling_params import MAX_STOP_STRINGS

# Floats in requests must be finite: Python's JSON parser accepts NaN and Infinity.
Float = Annotated[float, Field(allow_inf_nan=False)]
MAX_N = 128
MAX_STOP = MAX_STOP_STRINGS  # stop strings, and stop token ids
MAX_TOKENS_LIMIT = 1 << 31


def _first_lone_surrogate(value: Any, path: str = "") -> tuple[str, int, str] | None:
    """(where, index, char) of the first lone UTF-16 surrogate in any string of ``value`` (strings,
    dict keys and values, list items; nested request models check themselves), else None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # the only thing UTF-8 cannot encode is a surrogate
            return path, e.start, value[e.start]
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _first_lone_surrogate(k, f"{path}[key]") or _first_lone_surrogate(
                v, f"{path}.{k}" if isinstance(k, str) else path
            )
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if not isinstance(v, (int, float, bool)):  # token-id lists stay cheap to scan
                found = _first_lone_surrogate(v, f"{path}[{i}]")
                if found:
                    return found
    return None


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="after")
    @classmethod
    def _no_lone_surrogates(cls, value: Any) -> Any:
        # JSON may spell a lone surrogate ("\ud800"); Python keeps it in the str, and then the
        # tokenizer, the chat template or the UTF-8 response encoder fail with a 500. Refuse it here,
        # where the error names the field.
        found = _first_lone_surrogate(value)
        if found is not None:
            where, index, char = found
            raise PydanticCustomError(
                "lone_surrogate",
                "text{where} holds a lone UTF-16 surrogate (U+{code}) at character {index}; "
                "strings must be valid Unicode",
                {
                    "where": f" at {where.lstrip('.')}" if where else "",
                    "code": f"{ord(char):04X}",
                    "index": index,
                },
            )
        return value


class Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- shared pieces ----


class StreamOptions(Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(Request):
    """vLLM's ``structured_outputs`` extra: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None


class SamplingFields(Request):
    """Sampling parameters shared by both endpoints (OpenAI's plus vLLM's extras)."""

    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: Float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    stop: str | list[str] | None = Field(default=None)
    presence_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1, le=1 << 20)
    min_p: Float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Float | None = Field(default=None, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0, lt=MAX_TOKENS_LIMIT)
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = Field(default=None, max_length=MAX_STOP)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    # Prefix-cache isolation: only requests with the same salt share cached pages.
    cache_salt: str | None = Field(default=None, min_length=1)
    # Disaggregated prefill/decode (vLLM's field): {"do_remote_decode": true} on a prefill request;
    # the prefill response's params on the decode request.
    kv_transfer_params: dict[str, Any] | None = None


# ---- /v1/completions ----

# Token ids are strict: JSON true / false are no token ids (lax pydantic reads them as 1 / 0).
PromptInput = str | list[str] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: PromptInput
    max_tokens: int | None = Field(default=16, ge=1, lt=MAX_TOKENS_LIMIT)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=1024)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=1024)
    add_special_tokens: bool = True


class CompletionLogprobs(Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptTokensDetails(Response):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class CompletionResponse(Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill's KV, for the decode server


# ---- /v1/chat/completions ----


class ContentPart(Request):
    """Any content part; only ``text`` parts are supported (others answer 400)."""

    type: str
    text: str | None = None


class FunctionCall(Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning, for templates that show it (gpt-oss's analysis channel);
    # vLLM's name and SGLang's (and vLLM's former) name.
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(Request):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Request):
    name: str


class NamedToolChoice(Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, lt=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(default=None, ge=1, lt=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=1024)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    # Passed to the chat template (gpt-oss's "Reasoning: ..." line; "none" also sets Qwen3's
    # enable_thinking=False), as vLLM does. include_reasoning=false leaves the reasoning out.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True


class ToolCallFunction(Response):
    name: str
    arguments: str


class ToolCallOut(Response):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)
    # A reasoning model's reasoning (gpt-oss's analysis channel), under vLLM's name and SGLang's.
    reasoning: str | None = None
    reasoning_content: str | None = None


class TopLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(Response):
    content: list[TokenLogprob] | None = None


class ChatChoice(Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill's KV, for the decode server


class DeltaFunctionCall(Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatStreamChoice(Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenizer endpoints ----


class ModelCard(Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tpuserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(Response):
    prompt: str


class VersionResponse(Response):
    version: str
