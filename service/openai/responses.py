"""OpenAI-compatible response shapes: chat/text completions (full and streaming chunks), `/v1/models`,
usage and the error object. Import them from `service.openai.protocol` (re-exported there).

Wire format:
- full responses: `resp.model_dump_json()` (nulls kept, as OpenAI does);
- streaming: `sse_event(chunk)` per chunk (nulls dropped), then `SSE_DONE`. All chunks of one stream share
  `id`, `created` and `model`: build the first one and pass those three on.
- chat streams: the first chunk of each choice carries `delta.role="assistant"`; the last carries
  `finish_reason`; with `stream_options.include_usage` a final chunk has `choices=[]` and `usage` set.
- errors: `ErrorResponse.make(...)`; send `err.model_dump_json()` with HTTP status `err.status_code`.

Logprob values are clamped to >= -9999.0 (JSON has no -inf; vLLM does the same).
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, field_validator

SSE_DONE = "data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # stand-in for -inf / nan


def random_id(prefix: str) -> str:
    """e.g. random_id("chatcmpl") -> "chatcmpl-3f2a..." (32 hex digits)."""
    return f"{prefix}-{os.urandom(16).hex()}"


def tool_call_id() -> str:
    """OpenAI-style tool call id: "call_" + 24 random hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def _now() -> int:
    return int(time.time())


def _clamp(v: float) -> float:
    return MIN_LOGPROB if math.isnan(v) or v < MIN_LOGPROB else v


def sse_event(chunk: BaseModel) -> str:
    """One server-sent event: `data: {json}\\n\\n` with null fields dropped."""
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


json_str = json.JSONEncoder(ensure_ascii=False).encode  # a str as JSON, as pydantic writes it (UTF-8 kept)


class StreamEvents:
    """The SSE events of one stream, byte for byte what `sse_event` of each chunk model gives: the chunks of a
    stream share `id`, `object`, `created` and `model`, so that head is written once and each event is the head
    plus its choice's JSON (`choice_json`, or a choice model's `model_dump_json(exclude_none=True)`)."""

    def __init__(self, object_name: str, request_id: str, model: str, created: int | None = None):
        self.created = _now() if created is None else created
        self._head = (
            f'data: {{"id":{json_str(request_id)},"object":{json_str(object_name)},"created":{self.created},'
            f'"model":{json_str(model)},"choices":['
        )

    def choice(self, choice_json: str) -> str:
        """The event of a chunk holding one choice."""
        return f"{self._head}{choice_json}]}}\n\n"

    def usage(self, usage: Usage) -> str:
        """The last chunk with `stream_options.include_usage`: no choices, the usage."""
        return f'{self._head}],"usage":{usage.model_dump_json(exclude_none=True)}}}\n\n'


def completion_choice_json(index: int, text: str, finish_reason: str | None) -> str:
    """A `CompletionStreamChoice` without logprobs as `model_dump_json(exclude_none=True)` writes it."""
    finish = "" if finish_reason is None else f',"finish_reason":{json_str(finish_reason)}'
    return f'{{"index":{index},"text":{json_str(text)}{finish}}}'


# ---------------------------------------------------------------------------------------------- errors

_DEFAULT_ERROR_TYPE = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ErrorInfo(BaseModel):
    message: str  # human-readable, names the parameter when there is one
    type: str  # e.g. "invalid_request_error", "server_error"
    param: str | None = None  # offending request field, dotted: "messages[0].content"
    code: str | None = None  # machine-readable, e.g. "model_not_found", "context_length_exceeded"


class ErrorResponse(BaseModel):
    """`{"error": {"message", "type", "param", "code"}}`; `status_code` is the HTTP status (not serialised)."""

    error: ErrorInfo
    status_code: int = Field(400, exclude=True)

    @classmethod
    def make(
        cls, message: str, type: str | None = None, param: str | None = None, status: int = 400, code: str | None = None
    ) -> ErrorResponse:
        """`type` defaults from the status: 4xx -> "invalid_request_error", 503 -> "service_unavailable"."""
        kind = type or _DEFAULT_ERROR_TYPE.get(status, "invalid_request_error" if status < 500 else "server_error")
        return cls(error=ErrorInfo(message=message, type=kind, param=param, code=code), status_code=status)


# ----------------------------------------------------------------------------------------------- usage


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # completion tokens inside the reasoning section


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @classmethod
    def make(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int | None = None,
        reasoning_tokens: int | None = None,
    ) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=(
                None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
            ),
        )


# -------------------------------------------------------------------------------------------- logprobs


class TopLogprob(BaseModel):
    token: str
    logprob: float  # natural log
    bytes: list[int] | None = None  # UTF-8 bytes of `token`

    @field_validator("logprob")
    @classmethod
    def _clamp_logprob(cls, v: float) -> float:
        return _clamp(v)


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)

    @field_validator("logprob")
    @classmethod
    def _clamp_logprob(cls, v: float) -> float:
        return _clamp(v)

    @classmethod
    def make(cls, token: str, logprob: float, top: list[tuple[str, float]] = ()) -> ChatTokenLogprob:
        """`top`: (token, logprob) pairs, most likely first."""
        return cls(
            token=token,
            logprob=logprob,
            bytes=list(token.encode("utf-8")),
            top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8"))) for t, lp in top],
        )


class ChatCompletionLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)  # token -> logprob
    text_offset: list[int] = Field(default_factory=list)  # character offset of each token in the text

    @field_validator("token_logprobs")
    @classmethod
    def _clamp_all(cls, v: list[float]) -> list[float]:
        return [_clamp(x) for x in v]

    @field_validator("top_logprobs")
    @classmethod
    def _clamp_top(cls, v: list[dict[str, float]]) -> list[dict[str, float]]:
        return [{t: _clamp(x) for t, x in d.items()} for d in v]


# ---------------------------------------------------------------------------------------------- chat

FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON object text


class ToolCall(BaseModel):
    id: str = Field(default_factory=tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # vLLM/SGLang extension, read by most clients
    tool_calls: list[ToolCall] | None = None  # None rather than [] when the model called no tool


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)  # unix seconds
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # only in the first delta of a tool call
    arguments: str | None = None  # a fragment; fragments concatenate to the JSON object


class DeltaToolCall(BaseModel):
    index: int  # position of the tool call in the message
    id: str | None = None  # only in the first delta of a tool call
    type: Literal["function"] | None = None  # only in the first delta
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None  # only in a choice's first chunk
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Usage | None = None  # only in the last chunk, with stream_options.include_usage


# ---------------------------------------------------------------------------------------- completions


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "content_filter"]


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionStreamChoice(BaseModel):
    index: int
    text: str  # the new text of this chunk
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "content_filter"] | None = None


class CompletionStreamResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None


# --------------------------------------------------------------------------------------------- models


class ModelCard(BaseModel):
    id: str  # served model name
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "hybrid-serve"
    root: str | None = None  # model path
    max_model_len: int | None = None  # context length in tokens


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
