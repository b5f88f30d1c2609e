"""Request validation (errors name the parameter), sampling kwargs, and response shapes checked against the
real `openai` package types."""

from __future__ import annotations

import json

import openai.types as oai
import pydantic
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject

from service.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    ToolCall,
    Usage,
    error_from_validation,
    to_sampling_kwargs,
)
from service.openai.responses import sse_event

MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
SAMPLING_KEYS = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    "skip_special_tokens",
}


def _error(cls, body) -> ErrorResponse:
    with pytest.raises(pydantic.ValidationError) as info:
        cls.model_validate_json(json.dumps(body)) if isinstance(body, dict) else cls.model_validate_json(body)
    err = error_from_validation(info.value)
    assert err.status_code == 400 and err.error.type == "invalid_request_error"
    ErrorObject.model_validate(err.model_dump()["error"])  # the openai package accepts the shape
    return err


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),  # needs logprobs: true
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # needs stream: true
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format.type"),
        ({"tool_choice": "bogus", "tools": [TOOL]}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "other"}}, "tools": [TOOL]},
            "tool_choice.function.name",
        ),
        ({"tool_choice": {"type": "function", "function": {}}, "tools": [TOOL]}, "tool_choice.function.name"),
        ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs"),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content",
        ),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function",
        ),
        ({"seed": 2**64}, "seed"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": MSGS + [{"role": "user"}]}, "messages[1].content"),
    ],
)
def test_chat_bad_parameter_names_it(extra, param):
    err = _error(ChatCompletionRequest, {"model": "m", "messages": MSGS, **extra})
    assert err.error.param == param
    assert param.split("[")[0].split(".")[0] in err.error.message


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"logprobs": 21}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 2.0]}, "prompt[1]"),  # token ids are JSON integers, not coerced
        ({"prompt": [1, True]}, "prompt[1]"),
        ({"prompt": [3, -1]}, "prompt[1]"),
        ({"max_tokens": -5}, "max_tokens"),
    ],
)
def test_completion_bad_parameter_names_it(extra, param):
    err = _error(CompletionRequest, {"model": "m", "prompt": "hello", **extra})
    assert err.error.param == param


def test_missing_and_malformed_bodies():
    err = _error(ChatCompletionRequest, {"model": "m"})
    assert err.error.param == "messages" and "Missing required parameter 'messages'" in err.error.message
    assert _error(CompletionRequest, {"model": "m"}).error.param == "prompt"
    err = _error(ChatCompletionRequest, '{"model": "m", "messages": [')
    assert err.error.param is None and "not valid JSON" in err.error.message


def test_error_make_statuses_and_wire_shape():
    err = ErrorResponse.make("model 'x' not found", param="model", status=404, code="model_not_found")
    body = json.loads(err.model_dump_json())
    assert body == {
        "error": {
            "message": "model 'x' not found",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert err.status_code == 404
    assert ErrorResponse.make("busy", status=503).error.type == "service_unavailable"
    ErrorObject.model_validate(body["error"])


def test_chat_sampling_kwargs():
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": MSGS,
            "max_tokens": 5,
            "max_completion_tokens": 9,
            "temperature": 0,
            "top_p": 0.9,
            "top_k": 0,
            "min_p": 0.05,
            "seed": 7,
            "stop": "END",
            "stop_token_ids": [2],
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 3,
            "presence_penalty": 0,
        }
    )
    kw = to_sampling_kwargs(req)
    assert set(kw) == SAMPLING_KEYS
    assert kw == {
        "max_tokens": 9,
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.05,
        "seed": 7,
        "stop": ["END"],
        "stop_token_ids": [2],
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
        "skip_special_tokens": True,
    }
    plain = to_sampling_kwargs(ChatCompletionRequest.model_validate({"messages": MSGS}), default_max_tokens=100)
    assert plain == {
        "max_tokens": 100,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "seed": None,
        "stop": [],
        "stop_token_ids": [],
        "ignore_eos": False,
        "logprobs": False,
        "top_logprobs": 0,
        "skip_special_tokens": True,
    }
    with pytest.raises(ValueError, match="default_max_tokens"):
        to_sampling_kwargs(ChatCompletionRequest.model_validate({"messages": MSGS}))
    nulls = ChatCompletionRequest.model_validate({"messages": MSGS, "n": None, "stream": None, "logprobs": None})
    assert (nulls.n, nulls.stream, nulls.logprobs) == (1, False, False)


def test_sampling_kwargs_build_the_engines_sampling_params():
    from service.engine.request import SamplingParams  # the real consumer of these kwargs

    chat = ChatCompletionRequest.model_validate(
        {
            "messages": MSGS,
            "max_tokens": 7,
            "top_k": 0,
            "stop": "x",
            "logprobs": True,
            "top_logprobs": 20,
            "skip_special_tokens": False,
        }
    )
    params = SamplingParams(**to_sampling_kwargs(chat))
    assert (params.max_tokens, params.top_k, params.stop, params.top_logprobs, params.skip_special_tokens) == (
        7,
        -1,
        ("x",),
        20,
        False,
    )
    comp = CompletionRequest.model_validate({"prompt": "p", "logprobs": 2, "temperature": 0, "seed": 1})
    params = SamplingParams(**to_sampling_kwargs(comp))
    assert (params.max_tokens, params.logprobs, params.top_logprobs, params.greedy, params.seed) == (
        16,
        True,
        2,
        True,
        1,
    )


def test_completion_sampling_kwargs_and_prompts():
    req = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3], "logprobs": 0, "top_k": 20})
    kw = to_sampling_kwargs(req)
    assert set(kw) == SAMPLING_KEYS
    assert (kw["max_tokens"], kw["logprobs"], kw["top_logprobs"], kw["top_k"]) == (16, True, 0, 20)
    assert req.prompts() == [[1, 2, 3]]
    assert to_sampling_kwargs(CompletionRequest.model_validate({"prompt": "x", "logprobs": 5}))["top_logprobs"] == 5
    assert not to_sampling_kwargs(CompletionRequest.model_validate({"prompt": "x"}))["logprobs"]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert CompletionRequest.model_validate({"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    assert CompletionRequest.model_validate_json('{"prompt": ["1", "2"]}').prompts() == ["1", "2"]  # text, not ids


def test_request_helpers():
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "store": True,
            "tools": [TOOL],
            "chat_template_kwargs": {"enable_thinking": False},
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "r",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"x": 1}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
        }
    )
    assert req.ignored_fields == ["store"]
    assert req.enable_thinking is False and req.tools_enabled and req.effective_tool_choice == "auto"
    msgs = req.template_messages()
    assert msgs[0] == {"role": "system", "content": "a\nb"}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1} and msgs[1]["reasoning_content"] == "r"
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert req.template_tools() == [TOOL]
    none_req = ChatCompletionRequest.model_validate({"messages": MSGS, "tools": [TOOL], "tool_choice": "none"})
    assert not none_req.tools_enabled and none_req.template_tools() is None
    assert ChatCompletionRequest.model_validate({"messages": MSGS}).enable_thinking is True


# ---------------------------------------------------------------- responses against openai's own types


def _usage() -> Usage:
    return Usage.make(prompt_tokens=10, completion_tokens=4, cached_tokens=8, reasoning_tokens=2)


def test_chat_completion_matches_openai_type():
    resp = ChatCompletionResponse(
        model="m",
        usage=_usage(),
        choices=[
            ChatCompletionChoice(
                index=0,
                finish_reason="tool_calls",
                message=ChatMessageOut(
                    content="ok",
                    reasoning_content="because",
                    tool_calls=[ToolCall(function=FunctionCall(name="f", arguments='{"a": 1}'))],
                ),
                logprobs=ChatCompletionLogprobs(content=[ChatTokenLogprob.make("ok", float("-inf"), [("ok", -0.1)])]),
            )
        ],
    )
    parsed = ChatCompletion.model_validate(json.loads(resp.model_dump_json()))
    assert parsed.object == "chat.completion" and parsed.id.startswith("chatcmpl-")
    msg = parsed.choices[0].message
    assert msg.tool_calls[0].function.arguments == '{"a": 1}' and msg.tool_calls[0].id.startswith("call_")
    assert msg.reasoning_content == "because"  # extension field kept
    assert parsed.usage.prompt_tokens_details.cached_tokens == 8 and parsed.usage.total_tokens == 14
    assert parsed.usage.completion_tokens_details.reasoning_tokens == 2
    lp = parsed.choices[0].logprobs.content[0]
    assert lp.logprob == -9999.0 and lp.bytes == list(b"ok") and lp.top_logprobs[0].logprob == -0.1


def test_chat_chunks_match_openai_type():
    first = ChatCompletionStreamResponse(
        model="m",
        choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant", reasoning_content="hm"))],
    )
    later = ChatCompletionStreamResponse(
        id=first.id,
        created=first.created,
        model="m",
        choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="x"), finish_reason="stop")],
    )
    usage = ChatCompletionStreamResponse(id=first.id, model="m", choices=[], usage=_usage())
    for chunk in (first, later, usage):
        for wire in (chunk.model_dump_json(), sse_event(chunk).removeprefix("data: ").strip()):
            parsed = ChatCompletionChunk.model_validate(json.loads(wire))
            assert parsed.object == "chat.completion.chunk" and parsed.id == first.id
    assert ChatCompletionChunk.model_validate(json.loads(later.model_dump_json())).choices[0].finish_reason == "stop"
    assert sse_event(later).startswith("data: {") and sse_event(later).endswith("}\n\n")


def test_completion_and_models_match_openai_types():
    resp = CompletionResponse(
        model="m",
        usage=_usage(),
        choices=[
            CompletionChoice(
                index=0,
                text=" world",
                finish_reason="length",
                logprobs=CompletionLogprobs(
                    tokens=[" world"], token_logprobs=[-0.5], top_logprobs=[{" world": -0.5}], text_offset=[0]
                ),
            )
        ],
    )
    parsed = oai.Completion.model_validate(json.loads(resp.model_dump_json()))
    assert parsed.object == "text_completion" and parsed.choices[0].logprobs.token_logprobs == [-0.5]
    chunk = CompletionStreamResponse(
        model="m", choices=[CompletionStreamChoice(index=0, text="x", finish_reason="stop")]
    )
    assert oai.Completion.model_validate(json.loads(chunk.model_dump_json())).choices[0].text == "x"
    models = ModelList(data=[ModelCard(id="tiny", root="/models/tiny", max_model_len=4096)])
    for card in json.loads(models.model_dump_json())["data"]:
        assert oai.Model.model_validate(card).id == "tiny"
