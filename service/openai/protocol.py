"""OpenAI-compatible request models and error handling for `/v1/completions`, `/v1/chat/completions`
and `/v1/models` (response shapes live in `service.openai.responses` and are re-exported here).

How the ingress uses this module::

    try:
        req = ChatCompletionRequest.model_validate_json(body)     # or CompletionRequest
    except pydantic.ValidationError as exc:
        err = error_from_validation(exc)                          # 400, `param` names the field
        return JSONResponse(err.model_dump(), status_code=err.status_code)
    kwargs = to_sampling_kwargs(req, default_max_tokens=max_model_len - num_prompt_tokens)
    params = SamplingParams(**kwargs)                             # service.engine.request
    ErrorResponse.make("model 'x' not found", param="model", status=404, code="model_not_found")

Decisions (all errors are 400 with `param` set to the offending field):
- `presence_penalty` / `frequency_penalty`: only 0 (or null) is accepted; the engine has no penalties, so
  any other value is rejected instead of silently ignored. `logit_bias` must be empty, `suffix` unset,
  `best_of` unset or 1.
- `echo` (completions): only false is accepted (prompt logprobs are not computed by the engine).
- `response_format`: only `{"type": "text"}`; `json_object` / `json_schema` are rejected (no guided decoding).
- `tool_choice`: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}. A named
  choice must name one of `tools`; "required"/named need `tools`. They are validated, not enforced by
  constrained decoding: the ingress parses whatever tool calls the model emits.
- `top_k`: -1 and 0 both mean disabled; `to_sampling_kwargs` emits -1 for both.
- `max_completion_tokens` wins over `max_tokens` when both are given (as vLLM does).
- `top_logprobs` (chat) needs `logprobs: true`; `stream_options` needs `stream: true`.
- Unknown top-level fields are accepted and ignored (OpenAI clients send e.g. `store`, `metadata`);
  `request.ignored_fields` lists them so the ingress can log them.
- Completions `prompt` may be a string, a list of strings, a list of token ids or a list of lists of token
  ids; `prompts()` normalises it. With several prompts, choice index = prompt_index * n + sample_index.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.openai.responses import (  # noqa: F401  (re-exported: one import site for the ingress)
    SSE_DONE,
    ChatCompletionChoice,
    ChatCompletionLogprobs,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    CompletionTokensDetails,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ToolCall,
    TopLogprob,
    Usage,
    random_id,
    sse_event,
)

MAX_LOGPROBS = 20  # upper bound for `logprobs` (completions) and `top_logprobs` (chat)
MAX_N = 16  # upper bound for `n`
_INT64_MAX = 2**63 - 1


class ParamError(ValueError):
    """Raised by cross-field validators; carries the name of the offending request parameter."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param  # dotted parameter path, e.g. "tool_choice.function.name"


# ---------------------------------------------------------------------------------------------- errors


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content'; drops pydantic's union-branch labels
    (e.g. 'str', 'list[int]', 'NamedToolChoice', "literal['a']") which are not field names."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part.islower() and part not in _TYPE_LABELS:
            out += f".{part}" if out else part
    return out or None


_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes", "tuple"})


def error_from_validation(exc: pydantic.ValidationError) -> ErrorResponse:
    """Turn a request ValidationError into a 400 OpenAI error whose `param` names the field.

    The first error is reported (for a failed union, the branch that got deepest into the input)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    union_errors = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    err = max(union_errors, key=lambda e: len(e["loc"]))
    ctx_error = (err.get("ctx") or {}).get("error")
    param = _loc_to_param(tuple(err["loc"]))
    if isinstance(ctx_error, ParamError):  # raised by a model validator at `loc`; its param is relative
        full = f"{param}.{ctx_error.param}" if param else ctx_error.param
        return ErrorResponse.make(f"Invalid value for parameter '{full}': {ctx_error}.", param=full)
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "missing":
        message = f"Missing required parameter '{param}'."
    elif err["type"] == "json_invalid":
        message = f"Request body is not valid JSON: {msg}."
    elif param is None:
        message = f"Invalid request: {msg}."
    else:
        shown = err.get("input")
        got = f" (got {shown!r})" if isinstance(shown, (int, float, str)) and len(repr(shown)) <= 60 else ""
        message = f"Invalid value for parameter '{param}': {msg}{got}."
    extra = len(errors) - len(union_errors)
    if extra > 0:
        message += f" ({extra} more error{'s' if extra > 1 else ''} in other parameters.)"
    return ErrorResponse.make(message, param=param)


# ---------------------------------------------------------------------------------------- request parts


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextContentPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Lenient):
    name: str
    arguments: str  # JSON object text, as OpenAI sends it


class ToolCallIn(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn

    @field_validator("function")
    @classmethod
    def _arguments_are_json_object(cls, v: FunctionCallIn) -> FunctionCallIn:
        try:
            parsed = json.loads(v.arguments) if v.arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"function.arguments is not valid JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise ValueError("function.arguments must be a JSON object")
        return v


class ChatMessage(_Lenient):
    """One input message. `content` is a string or a list of text parts (other part types are refused)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only
    reasoning_content: str | None = None  # assistant only (earlier turns' reasoning)

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, v: Any) -> Any:
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content part {i} has type {kind!r}; only 'text' parts are supported")
        return v

    @model_validator(mode="after")
    def _role_rules(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ParamError("tool_call_id", "a 'tool' message needs 'tool_call_id'")
        if self.role != "assistant" and self.content is None:
            raise ParamError("content", f"a '{self.role}' message needs 'content'")
        if self.role != "assistant" and self.tool_calls:
            raise ParamError("tool_calls", "only 'assistant' messages may carry 'tool_calls'")
        return self

    def text(self) -> str | None:
        """Content as one string (text parts joined with newlines), None if absent."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content

    def to_template_dict(self) -> dict[str, Any]:
        """Plain dict for the chat template: content flattened to a string, tool-call arguments parsed to a
        dict (Qwen3-coder / Nemotron templates iterate `tool_call.arguments|items`)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text() or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {
                        "name": tc.function.name,
                        "arguments": json.loads(tc.function.arguments) if tc.function.arguments.strip() else {},
                    },
                }
                for tc in self.tool_calls
            ]
        return out


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: bool = False  # send a last chunk with `usage` and empty `choices`


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise ValueError(f"response_format type {v!r} is not supported (no guided decoding); use 'text'")
        return v


# -------------------------------------------------------------------------------------------- requests


def _zero_or_none(v: float | None, what: str) -> float | None:
    if v not in (None, 0, 0.0):
        raise ValueError(f"{what} is not supported by this server; only 0 is accepted")
    return v


class _SamplingRequest(_Lenient):
    """Fields shared by chat and text completions."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # default 1.0
    top_p: float | None = Field(None, gt=0, le=1)  # default 1.0
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: disabled
    min_p: float | None = Field(None, ge=0, le=1)  # default 0.0
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=-(2**63), le=_INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[pydantic.NonNegativeInt] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True  # detokenisation option, not a SamplingParams key
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("n", "stream", "ignore_eos", "skip_special_tokens", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: pydantic.ValidationInfo) -> Any:
        """Some clients send explicit nulls for unset fields."""
        return cls.model_fields[info.field_name].default if v is None and info.field_name else v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float | None, info: pydantic.ValidationInfo) -> float | None:
        return _zero_or_none(v, info.field_name or "penalty")

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported by this server")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: str | list[str] | None) -> str | list[str] | None:
        for s in [v] if isinstance(v, str) else v or []:
            if s == "":
                raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options can only be set when stream is true")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def ignored_fields(self) -> list[str]:
        """Top-level fields the server accepted but does not understand (for logging)."""
        return sorted((self.model_extra or {}).keys())


class ChatCompletionRequest(_SamplingRequest):
    """Body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False  # return chosen-token logprobs (null: false)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; several calls are always parsed
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    response_format: ResponseFormat | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _null_logprobs(cls, v: Any) -> Any:
        return False if v is None else v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _enable_thinking_is_bool(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and "enable_thinking" in v and not isinstance(v["enable_thinking"], bool):
            raise ValueError("chat_template_kwargs.enable_thinking must be a boolean")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs to be true")
        names = [t.function.name for t in self.tools or []]
        if self.tool_choice == "required" and not names:
            raise ParamError("tool_choice", "tool_choice 'required' needs a non-empty 'tools' list")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ParamError(
                "tool_choice.function.name",
                f"tool_choice names function {self.tool_choice.function.name!r}, which is not in 'tools' ({names})",
            )
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def enable_thinking(self) -> bool:
        """`chat_template_kwargs.enable_thinking`, default true (Nemotron-3 thinks unless told not to)."""
        return bool((self.chat_template_kwargs or {}).get("enable_thinking", True))

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def tools_enabled(self) -> bool:
        """Whether the ingress should run the tool-call parser on the output."""
        return bool(self.tools) and self.effective_tool_choice != "none"

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """Tools as plain dicts for the chat template (None when absent or tool_choice is "none")."""
        if not self.tools_enabled:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or []]


TokenId = Annotated[pydantic.StrictInt, Field(ge=0)]  # a JSON integer: "7", 7.0 and true are refused, not coerced
# Members tried in order, the first that validates wins: token ids first, as most prompts of a busy server are (the
# default "smart" mode validates a long id list against every member, ~5x the work); strict ids keep ["1"] text.
PromptT = Annotated[list[TokenId] | list[list[TokenId]] | str | list[str], Field(union_mode="left_to_right")]


class CompletionRequest(_SamplingRequest):
    """Body of `POST /v1/completions`."""

    prompt: PromptT
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # number of top logprobs; 0 = chosen only
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_nonempty(cls, v: PromptT) -> PromptT:
        if len(v) == 0 or (not isinstance(v, str) and not isinstance(v[0], int) and not all(v)):
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo", mode="before")
    @classmethod
    def _no_echo(cls, v: Any) -> Any:
        if v is None:
            return False
        if v is True or (isinstance(v, str) and v.lower() == "true"):
            raise ValueError("echo is not supported by this server")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported by this server")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("best_of is not supported by this server; only 1 is accepted")
        return v

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):  # one list of token ids (the members are lists of one kind each)
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def to_sampling_kwargs(
    request: ChatCompletionRequest | CompletionRequest, *, default_max_tokens: int | None = None
) -> dict[str, Any]:
    """Keyword arguments for `service.engine.request.SamplingParams`, with exactly the keys
    max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, logprobs,
    top_logprobs, skip_special_tokens.

    `max_tokens` is the request's (chat: max_completion_tokens, else max_tokens; completions default 16) or
    else `default_max_tokens` (the ingress passes max_model_len - num_prompt_tokens); ValueError if neither
    is known. `logprobs` is a bool (return the chosen token's logprob), `top_logprobs` an int (0 = none).
    `top_k` 0 becomes -1. The request may still ask for more tokens than fit: the ingress checks
    num_prompt_tokens + max_tokens against the context length."""
    if isinstance(request, ChatCompletionRequest):
        want_logprobs = request.logprobs
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else 0
    else:
        want_logprobs = request.logprobs is not None
        top_logprobs = request.logprobs or 0
    max_tokens = request.effective_max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is None:
        raise ValueError("the request sets no max_tokens: pass default_max_tokens (context room left)")
    top_k = request.top_k if request.top_k is not None else -1
    return {
        "max_tokens": max_tokens,
        "temperature": 1.0 if request.temperature is None else float(request.temperature),
        "top_p": 1.0 if request.top_p is None else float(request.top_p),
        "top_k": -1 if top_k == 0 else top_k,
        "min_p": 0.0 if request.min_p is None else float(request.min_p),
        "seed": request.seed,
        "stop": request.stop_list,
        "stop_token_ids": list(request.stop_token_ids or []),
        "ignore_eos": request.ignore_eos,
        "logprobs": want_logprobs,
        "top_logprobs": top_logprobs,
        "skip_special_tokens": request.skip_special_tokens,
    }
