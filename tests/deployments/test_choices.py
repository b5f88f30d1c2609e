"""Engine chunks -> OpenAI chat/completion choices, checked with the `openai` package's own response types
(no Ray): reasoning, content and typed tool calls, streamed one character at a time and in one piece."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from service.deployments.choices import ChoiceOptions, ChoiceState, token_text_and_bytes
from service.deployments.engine_deployment import GenerateChunk
from service.engine.tokenizer import Tokenizer
from service.openai.protocol import (
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatTool,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    Usage,
)
from service.openai.responses import StreamEvents, completion_choice_json, sse_event

TOOLS = (
    ChatTool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer"},
                        "metric": {"type": "boolean"},
                    },
                },
            },
        }
    ),
)
MODEL_TEXT = (
    "The user wants the weather.\n</think>\nLet me look that up.\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    "<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path) -> Tokenizer:
    return Tokenizer.from_model_path(tiny_model_path)


def _chunk(text: str, finish: str | None, ids: tuple[int, ...] = ()) -> GenerateChunk:
    return GenerateChunk("r", ids, text, None, None, finish, 10, 4)


def _state(tokenizer: Tokenizer) -> ChoiceState:
    return ChoiceState(
        ChoiceOptions(
            0, 0, False, reasoning_parser="nemotron_3", tool_parser="qwen3_coder", tools=TOOLS, starts_in_reasoning=True
        ),
        tokenizer,
    )


def test_chat_tool_call_streamed_per_character_matches_full(tokenizer):
    full_state = _state(tokenizer)
    full_state.add(_chunk(MODEL_TEXT, "stop"))
    full = ChatCompletion.model_validate_json(
        ChatCompletionResponse(model="tiny", choices=[full_state.final_chat()]).model_dump_json()
    )
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls"
    assert message.model_extra["reasoning_content"] == "The user wants the weather."
    assert message.content == "Let me look that up."
    assert message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3, "metric": True}

    state = _state(tokenizer)
    chunks = []
    for i, ch in enumerate(MODEL_TEXT):
        c = _chunk(ch, "stop" if i == len(MODEL_TEXT) - 1 else None)
        state.add(c)
        choice = state.delta_chat(c)
        if choice is not None:
            chunks.append(
                ChatCompletionChunk.model_validate_json(
                    ChatCompletionStreamResponse(model="tiny", choices=[choice]).model_dump_json(exclude_none=True)
                )
            )
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "The user wants the weather."
    assert "".join(d.content or "" for d in deltas) == "Let me look that up."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].function.name == "get_weather" and calls[0].id and calls[0].index == 0
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {
        "city": "Paris",
        "days": 3,
        "metric": True,
    }
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_chat_without_parsers_is_plain_content(tokenizer):
    state = ChoiceState(ChoiceOptions(1, 0, False), tokenizer)
    state.add(_chunk("<think>raw</think> text", "length"))
    choice = ChatCompletion.model_validate_json(
        ChatCompletionResponse(model="tiny", choices=[state.final_chat()]).model_dump_json()
    ).choices[0]
    assert choice.index == 1 and choice.finish_reason == "length"
    assert choice.message.content == "<think>raw</think> text" and choice.message.tool_calls is None


def test_completion_logprobs_shapes_and_byte_tokens(tokenizer):
    ids = tuple(tokenizer.encode("The cat sees the dog"))
    top = tuple({t: -0.5, (t + 1) % tokenizer.vocab_size: -1.5} for t in ids)
    state = ChoiceState(ChoiceOptions(0, 2, True), tokenizer)
    for i, t in enumerate(ids):
        text = tokenizer.decode([t])
        state.add_completion(
            GenerateChunk("r", (t,), text, (-0.5,), (top[i],), "length" if i == len(ids) - 1 else None, 3, 0)
        )
    resp = Completion.model_validate_json(
        CompletionResponse(model="tiny", choices=[state.final_completion()]).model_dump_json()
    )
    lp = resp.choices[0].logprobs
    assert "".join(lp.tokens) == resp.choices[0].text == "The cat sees the dog"
    assert lp.token_logprobs == [-0.5] * len(ids) and all(len(d) == 2 for d in lp.top_logprobs)
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:k]) for k in range(len(ids))]


def test_partial_utf8_tokens_get_distinct_byte_names(tokenizer):
    byte_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd"]
    assert len(byte_ids) >= 2, "the tiny tokenizer should have lone-byte tokens"
    names = {token_text_and_bytes(tokenizer, i)[0] for i in byte_ids}
    assert len(names) == len(byte_ids) and all(n.startswith("bytes:\\x") for n in names)
    raw = token_text_and_bytes(tokenizer, byte_ids[0])[1]
    assert len(raw) >= 1 and bytes(raw).decode("utf-8", errors="replace") == "\ufffd"


STREAM_TEXTS = ("", "Hel", 'lo "w\\orld"\n', "", "\t\x01é漢😀\u2028", "</s>")


@pytest.mark.parametrize("finish", ["stop", "length"])
@pytest.mark.parametrize("want_logprobs", [False, True])
def test_stream_choice_json_is_the_models_json(tokenizer, finish, want_logprobs):
    """The choices the ingress writes without building models are byte for byte the models' `exclude_none` JSON."""
    chunks = [_chunk(t, None, (5,) if t else ()) for t in STREAM_TEXTS] + [_chunk("!", finish, (6,))]
    if want_logprobs:
        chunks = [GenerateChunk("r", c.token_ids, c.text, (-0.5,) * len(c.token_ids), None, c.finish_reason, 10, 4)
                  for c in chunks]  # fmt: skip
    options = ChoiceOptions(2, 0, want_logprobs)
    fast_chat, model_chat = ChoiceState(options, tokenizer), ChoiceState(options, tokenizer)
    fast_cmpl, model_cmpl = ChoiceState(options, tokenizer), ChoiceState(options, tokenizer)
    for chunk in chunks:
        fast_chat.add(chunk)
        model_chat.add(chunk)
        choice = model_chat.delta_chat(chunk)
        assert fast_chat.delta_chat_json(chunk) == (
            None if choice is None else choice.model_dump_json(exclude_none=True)
        )
        choice = model_cmpl.add_completion(chunk)
        assert fast_cmpl.add_completion_json(chunk) == (
            None if choice is None else choice.model_dump_json(exclude_none=True)
        )
    assert fast_cmpl.text == model_cmpl.text == "".join(STREAM_TEXTS) + "!"


def test_stream_events_are_the_chunk_models_events():
    """A stream's events from its shared head are what `sse_event` writes for the whole chunk model."""
    events = StreamEvents("chat.completion.chunk", 'chatcmpl-"x"', "tiny/é", 1234)
    choice = ChatCompletionStreamChoice(
        index=1, delta=DeltaMessage(role="assistant", content="hi"), finish_reason="stop"
    )
    whole = ChatCompletionStreamResponse(id='chatcmpl-"x"', created=1234, model="tiny/é", choices=[choice])
    assert events.choice(choice.model_dump_json(exclude_none=True)) == sse_event(whole)
    usage = Usage.make(3, 4, cached_tokens=1)
    last = ChatCompletionStreamResponse(id='chatcmpl-"x"', created=1234, model="tiny/é", choices=[], usage=usage)
    assert events.usage(usage) == sse_event(last)
    text = StreamEvents("text_completion", "cmpl-1", "m", 5).choice(completion_choice_json(0, "a\nb", "length"))
    whole = CompletionStreamResponse(
        id="cmpl-1",
        created=5,
        model="m",
        choices=[CompletionStreamChoice(index=0, text="a\nb", finish_reason="length")],
    )
    assert text == sse_event(whole)
