"""The real `openai` client as the oracle, wired to an in-process httpx transport (no sockets): the bodies
it sends validate as our requests, and the bodies we build (full, SSE stream, error) parse back into its
types with the values we meant."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import openai
import pydantic
import pytest

from service.openai.chat_output import ChatOutputStreamParser, chat_finish_reason, parse_chat_output
from service.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    Usage,
    error_from_validation,
    to_sampling_kwargs,
)
from service.openai.responses import SSE_DONE, sse_event

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "number"}, "why": {"type": "string"}},
                "required": ["a", "b"],
            },
        },
    }
]
MODEL_TEXT = (
    "Need to add.\n</think>\nSure.\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"
    "<parameter=b>\n0.5\n</parameter>\n<parameter=why>\nline1\n<b>line2</b>\n</parameter>\n"
    "</function>\n</tool_call>"
)
EXPECTED_ARGS = {"a": 2, "b": 0.5, "why": "line1\n<b>line2</b>"}


def _client(handler: Callable[[httpx.Request], httpx.Response]) -> openai.OpenAI:
    transport = httpx.MockTransport(handler)
    return openai.OpenAI(
        api_key="unused", base_url="http://127.0.0.1:9/v1", max_retries=0, http_client=httpx.Client(transport=transport)
    )


def _chat_request(request: httpx.Request) -> ChatCompletionRequest:
    assert request.url.path == "/v1/chat/completions"
    return ChatCompletionRequest.model_validate_json(request.content)


def test_chat_non_streaming_roundtrip():
    seen: list[ChatCompletionRequest] = []

    def handler(request: httpx.Request) -> httpx.Response:
        req = _chat_request(request)
        seen.append(req)
        out = parse_chat_output(
            MODEL_TEXT,
            reasoning_parser="nemotron_3",
            tool_parser="qwen3_coder",
            tools=req.tools,
            starts_in_reasoning=req.enable_thinking,
        )
        resp = ChatCompletionResponse(
            model=req.model,
            usage=Usage.make(12, 30, cached_tokens=8),
            choices=[
                ChatCompletionChoice(
                    index=0,
                    finish_reason=chat_finish_reason("stop", bool(out.tool_calls)),
                    message=ChatMessageOut(
                        content=out.content,
                        reasoning_content=out.reasoning_content,
                        tool_calls=list(out.tool_calls) or None,
                    ),
                )
            ],
        )
        return httpx.Response(200, content=resp.model_dump_json(), headers={"content-type": "application/json"})

    result = _client(handler).chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+0.5?"}],
        tools=TOOLS,
        tool_choice="auto",
        max_completion_tokens=64,
        temperature=0.6,
        top_p=0.95,
        seed=3,
        stop=["<|im_end|>"],
        n=1,
        logprobs=True,
        top_logprobs=2,
        extra_body={"top_k": 20, "min_p": 0.01, "chat_template_kwargs": {"enable_thinking": True}},
    )
    req = seen[0]
    assert to_sampling_kwargs(req) == {
        "max_tokens": 64,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.01,
        "seed": 3,
        "stop": ["<|im_end|>"],
        "stop_token_ids": [],
        "ignore_eos": False,
        "logprobs": True,
        "top_logprobs": 2,
        "skip_special_tokens": True,
    }
    assert req.enable_thinking and req.tools_enabled and req.tools[0].function.name == "add"
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure." and choice.message.reasoning_content == "Need to add."
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == EXPECTED_ARGS
    assert result.usage.prompt_tokens_details.cached_tokens == 8


def test_chat_streaming_roundtrip_equals_non_streaming():
    def handler(request: httpx.Request) -> httpx.Response:
        req = _chat_request(request)
        assert req.stream and req.include_usage_in_stream
        parser = ChatOutputStreamParser(
            reasoning_parser="nemotron_3", tool_parser="qwen3_coder", tools=req.tools, starts_in_reasoning=True
        )
        head = ChatCompletionStreamResponse(
            model=req.model,
            choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))],
        )
        events = [sse_event(head)]

        def chunk(delta: DeltaMessage | None, finish: str | None = None) -> None:
            if delta is None and finish is None:
                return
            events.append(
                sse_event(
                    ChatCompletionStreamResponse(
                        id=head.id,
                        created=head.created,
                        model=req.model,
                        choices=[
                            ChatCompletionStreamChoice(index=0, delta=delta or DeltaMessage(), finish_reason=finish)
                        ],
                    )
                )
            )

        for i in range(0, len(MODEL_TEXT), 3):  # engine-like small deltas
            chunk(parser.feed(MODEL_TEXT[i : i + 3]))
        chunk(parser.finish())
        chunk(None, chat_finish_reason("stop", parser.has_tool_calls))
        events.append(
            sse_event(
                ChatCompletionStreamResponse(
                    id=head.id, created=head.created, model=req.model, choices=[], usage=Usage.make(12, 30)
                )
            )
        )
        return httpx.Response(200, content="".join(events) + SSE_DONE, headers={"content-type": "text/event-stream"})

    stream = _client(handler).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "2+0.5?"}],
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    reasoning, content, calls, finish, usage = "", "", {}, None, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            finish = choice.finish_reason or finish
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                entry["arguments"] += tc.function.arguments or ""
    expected = parse_chat_output(
        MODEL_TEXT, reasoning_parser="nemotron_3", tool_parser="qwen3_coder", tools=TOOLS, starts_in_reasoning=True
    )
    assert (reasoning, content) == (expected.reasoning_content, expected.content)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in expected.tool_calls
    ]
    assert json.loads(calls[0]["arguments"]) == EXPECTED_ARGS and calls[0]["id"].startswith("call_")
    assert finish == "tool_calls" and usage.total_tokens == 42


def test_completions_with_token_prompt_and_logprobs():
    seen: list[CompletionRequest] = []

    def handler(request: httpx.Request) -> httpx.Response:
        req = CompletionRequest.model_validate_json(request.content)
        seen.append(req)
        choices = [
            CompletionChoice(
                index=i,
                text=" hi",
                finish_reason="length",
                logprobs=CompletionLogprobs(
                    tokens=[" hi"], token_logprobs=[-0.25], top_logprobs=[{" hi": -0.25, " yo": -2.0}], text_offset=[0]
                ),
            )
            for i in range(req.n * len(req.prompts()))
        ]
        resp = CompletionResponse(model=req.model, choices=choices, usage=Usage.make(3, 2))
        return httpx.Response(200, content=resp.model_dump_json(), headers={"content-type": "application/json"})

    result = _client(handler).completions.create(model="tiny", prompt=[1, 2, 3], logprobs=2, max_tokens=1, n=2)
    assert seen[0].prompts() == [[1, 2, 3]]
    kw = to_sampling_kwargs(seen[0])
    assert (kw["max_tokens"], kw["logprobs"], kw["top_logprobs"]) == (1, True, 2)
    assert [c.index for c in result.choices] == [0, 1]
    assert result.choices[0].logprobs.top_logprobs[0] == {" hi": -0.25, " yo": -2.0}


def test_models_list_and_error_body_reach_the_client():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(
                200,
                content=ModelList(data=[ModelCard(id="tiny")]).model_dump_json(),
                headers={"content-type": "application/json"},
            )
        try:
            _chat_request(request)
        except pydantic.ValidationError as exc:
            err = error_from_validation(exc)
            return httpx.Response(
                err.status_code, content=err.model_dump_json(), headers={"content-type": "application/json"}
            )
        raise AssertionError("the request should have been rejected")

    client = _client(handler)
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=3)
    assert info.value.status_code == 400 and info.value.param == "temperature"
    assert info.value.type == "invalid_request_error" and "temperature" in info.value.message
