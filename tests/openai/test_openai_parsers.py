"""Reasoning (`nemotron_3`) and tool-call (`qwen3_coder`) parsers: streaming output, for every way of
cutting the text into deltas, must equal the non-streaming parse; the non-streaming parse must equal the
hand-written expectation of what the model meant."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.openai import reasoning, tool_calls
from service.openai.chat_output import ChatOutputStreamParser, chat_finish_reason, parse_chat_output

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "threshold": {"type": "number"},
                    "metric": {"type": "boolean"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "options": {"type": "object"},
                    "mode": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                },
            },
        },
    },
]

REASONING = "The user wants weather in Paris; 3 < 4 and <b> is not a tag.\nI'll call get_weather, then write."
CODE = 'if a < b:\n    print("<tag>")\n\n'  # value text between the stripped newlines
TEXT = (
    REASONING + "\n</think>\n"
    "Let me check.\n\n"
    "<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n"
    "<parameter=threshold>\n-1.5e2\n</parameter>\n"
    "<parameter=metric>\ntrue\n</parameter>\n"
    "<parameter=note>\nnull\n</parameter>\n"
    "</function>\n</tool_call>\n"
    "<tool_call>\n<function=write_file>\n"
    "<parameter=path>/tmp/a.py</parameter>\n"
    "<parameter=content>\n" + CODE + "\n</parameter>\n"
    '<parameter=options>\n{"overwrite": true, "n": [1, 2.5]}\n</parameter>\n'
    "<parameter=mode>\n0644x\n</parameter>\n"
    "</function>\n</tool_call>"
)
EXPECTED_ARGS = [
    {"city": "Paris", "days": 3, "threshold": -150.0, "metric": True, "note": None},
    {"path": "/tmp/a.py", "content": CODE, "options": {"overwrite": True, "n": [1, 2.5]}, "mode": "0644x"},
]

# Shorter texts covering the other paths (thinking off, <tool_call> ending reasoning, unknown tool,
# a block that is not a call, missing </parameter>, content after calls, truncation).
EXTRA_TEXTS = [
    (False, "Plain answer, no thinking.\n"),
    (False, "<think>\nopened by the model\n</think>\n\nAnswer"),
    (
        True,
        "thinking then a call\n<tool_call>\n<function=get_weather>\n<parameter=days>\n7\n</parameter>\n"
        "</function>\n</tool_call>\nDone.",
    ),
    (True, "short</think><tool_call><function=mystery><parameter=x>1</parameter></function></tool_call>"),
    (
        True,
        "r</think>\ntext <tool_call>\nnot a call\n</tool_call>\n more <tool_call><function=get_weather>"
        "<parameter=city>\nRome\n<parameter=days>\n2\n</function></tool_call>  \n",
    ),
    (True, "r\n</think>\n<tool_call>\n<function=write_file>\n<parameter=content>\nunterminated"),
    (True, "never closes reasoning\n"),
    (True, "</think>\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"),
]


def _non_streaming(text: str, starts_in_reasoning: bool) -> tuple[str, str, list[tuple[str, str]]]:
    out = parse_chat_output(
        text,
        reasoning_parser="nemotron_3",
        tool_parser="qwen3_coder",
        tools=TOOLS,
        starts_in_reasoning=starts_in_reasoning,
    )
    calls = [(c.function.name, c.function.arguments) for c in out.tool_calls]
    return out.reasoning_content or "", out.content or "", calls


def _streaming(chunks: list[str], starts_in_reasoning: bool) -> tuple[str, str, list[tuple[str, str]]]:
    """Feeds the chained parser and accumulates deltas the way an OpenAI client does."""
    p = ChatOutputStreamParser(
        reasoning_parser="nemotron_3", tool_parser="qwen3_coder", tools=TOOLS, starts_in_reasoning=starts_in_reasoning
    )
    r, c, calls = [], [], {}
    for delta in [p.feed(x) for x in chunks] + [p.finish()]:
        if delta is None:
            continue
        r.append(delta.reasoning_content or "")
        c.append(delta.content or "")
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.id.startswith("call_") and tc.function.name is not None
                calls[tc.index] = [tc.function.name, ""]
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index][1] += tc.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return "".join(r), "".join(c), [tuple(calls[i]) for i in range(len(calls))]


def test_non_streaming_matches_what_the_model_meant():
    out = parse_chat_output(
        TEXT, reasoning_parser="nemotron_3", tool_parser="qwen3_coder", tools=TOOLS, starts_in_reasoning=True
    )
    assert out.reasoning_content == REASONING
    assert out.content == "Let me check."
    assert [c.function.name for c in out.tool_calls] == ["get_weather", "write_file"]
    assert [json.loads(c.function.arguments) for c in out.tool_calls] == EXPECTED_ARGS
    # types survive exactly (3 is an int, not 3.0; true is a bool, not 1)
    first = json.loads(out.tool_calls[0].function.arguments)
    assert type(first["days"]) is int and type(first["threshold"]) is float and first["metric"] is True
    assert all(c.id.startswith("call_") and c.type == "function" for c in out.tool_calls)
    assert out.tool_calls[0].id != out.tool_calls[1].id
    assert out.unknown_tool_names == ()


def test_every_two_delta_split_matches_non_streaming():
    expected = _non_streaming(TEXT, True)
    for i in range(len(TEXT) + 1):
        assert _streaming([TEXT[:i], TEXT[i:]], True) == expected, f"split at {i}: {TEXT[:i][-20:]!r}"


def test_one_char_deltas_match_non_streaming():
    assert _streaming(list(TEXT), True) == _non_streaming(TEXT, True)


@pytest.mark.parametrize("starts_in_reasoning,text", EXTRA_TEXTS)
def test_other_shapes_every_split_and_single_chars(starts_in_reasoning, text):
    expected = _non_streaming(text, starts_in_reasoning)
    for i in range(len(text) + 1):
        assert _streaming([text[:i], text[i:]], starts_in_reasoning) == expected, f"split at {i}"
    assert _streaming(list(text), starts_in_reasoning) == expected


def test_every_truncation_point_streams_like_it_parses():
    """max_tokens can cut the text anywhere: each prefix, fed in random chunks, still agrees."""
    rng = random.Random(0)
    for n in range(0, len(TEXT) + 1, 3):
        prefix = TEXT[:n]
        cuts = sorted(rng.sample(range(n + 1), min(3, n + 1)))
        chunks = [prefix[a:b] for a, b in zip([0] + cuts, cuts + [n])]
        assert _streaming(chunks, True) == _non_streaming(prefix, True), f"prefix of {n} chars"


@settings(max_examples=150, deadline=None)
@given(cuts=st.lists(st.integers(0, len(TEXT)), max_size=40))
def test_random_chunkings(cuts):
    points = sorted(set(cuts))
    chunks = [TEXT[a:b] for a, b in zip([0] + points, points + [len(TEXT)])]
    assert _streaming(chunks, True) == _non_streaming(TEXT, True)


_PIECES = [
    "<think>",
    "</think>",
    "\n",
    "\n\n",
    " ",
    "<tool_call>",
    "</tool_call>",
    "<function=get_weather>",
    "<function=write_file>",
    "<function=nope>",
    "<parameter=city>",
    "<parameter=days>",
    "<parameter=options>",
    "</parameter>",
    "</function>",
    "<",
    ">",
    "</thi",
    "<tool_",
    "</para",
    "a",
    "3",
    "-2.5",
    "true",
    '{"k": [1]}',
    "null",
    "x y",
]


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(_PIECES), max_size=30),
    starts=st.booleans(),
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_random_tag_soup_streams_like_it_parses(pieces, starts, cuts):
    """Arbitrary mixes of tags, partial tags and text: both paths agree whatever the chunking."""
    text = "".join(pieces)
    points = sorted({c for c in cuts if c <= len(text)})
    chunks = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    assert _streaming(chunks, starts) == _non_streaming(text, starts)
    assert _streaming(list(text), starts) == _non_streaming(text, starts)


# ------------------------------------------------------------------------------ targeted behaviour


def test_reasoning_rules():
    assert reasoning.parse("abc\n</think>\nanswer", True) == ("abc", "answer")
    assert reasoning.parse("abc\n\n</think>\n\nanswer", True) == ("abc\n", "\nanswer")  # one newline each
    assert reasoning.parse("abc", True) == ("abc", None)  # truncated reasoning
    assert reasoning.parse("abc\n", True) == ("abc\n", None)
    assert reasoning.parse("answer only", False) == (None, "answer only")
    assert reasoning.parse("<think>\nr\n</think>\na", False) == ("r", "a")  # model opened it itself
    assert reasoning.parse("r\n<tool_call>x", True) == ("r", "<tool_call>x")  # tool call ends reasoning
    assert reasoning.parse("</think>a</think>", True) == (None, "a</think>")  # later tags are content
    assert reasoning.parse("", True) == (None, None)
    assert reasoning.prompt_starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not reasoning.prompt_starts_in_reasoning("<|im_start|>assistant\n<think></think>")


def test_reasoning_stream_holds_back_partial_tags():
    p = reasoning.ReasoningStreamParser(starts_in_reasoning=True)
    assert p.feed("abc\n</th") == ("abc", "")
    assert p.feed("ink>\nhi") == ("", "hi")
    assert p.finish() == ("", "")
    p = reasoning.ReasoningStreamParser(starts_in_reasoning=True)
    assert p.feed("a <b") == ("a <b", "")  # '<b' cannot become a tag: released at once
    assert p.feed("\n</x") == ("\n</x", "")


def test_convert_value_follows_schema():
    cv = tool_calls.convert_value
    assert cv("42", {"type": "integer"}) == 42
    assert cv("4.5", {"type": "integer"}) == "4.5"  # not an integer: kept as string
    assert cv("4.5", {"type": "number"}) == 4.5
    assert cv("1e3", {"type": "number"}) == 1000.0
    assert cv("nan", {"type": "number"}) == "nan"
    assert cv("True", {"type": "boolean"}) is True
    assert cv("yes", {"type": "boolean"}) == "yes"
    assert cv("null", {"type": ["integer", "null"]}) is None
    assert cv("7", {"anyOf": [{"type": "string"}, {"type": "integer"}]}) == 7
    assert cv("7", {"type": "string"}) == "7"
    assert cv("2", {"enum": [1, 2, 3]}) == 2
    assert cv("b", {"enum": ["a", "b"]}) == "b"
    assert cv('{"a": 1}', {"type": "object"}) == {"a": 1}
    assert cv("[1, 2]", {"type": "object"}) == "[1, 2]"  # an array is not an object
    assert cv("[1, 2]", {"type": "array", "items": {"type": "integer"}}) == [1, 2]
    assert cv("{bad json", {"type": "object"}) == "{bad json"
    assert cv("42", None) == "42"  # parameter not in the schema


def test_unknown_function_is_kept_and_flagged():
    text = "<tool_call>\n<function=launch>\n<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>"
    content, calls = tool_calls.parse(text, TOOLS)
    assert content is None and [c.function.name for c in calls] == ["launch"]
    assert json.loads(calls[0].function.arguments) == {"count": "3"}  # no schema: string
    assert tool_calls.unknown_tool_names(calls, TOOLS) == ["launch"]
    events = tool_calls.ToolCallStreamParser(TOOLS).feed(text)
    assert events[0].name == "launch" and events[0].known_function is False


def test_stream_emits_each_argument_once_complete():
    p = tool_calls.ToolCallStreamParser(TOOLS)
    assert p.feed("Hi <tool_call>\n<function=get_wea") == [tool_calls.DeltaEvent(content="Hi")]
    (name_event,) = p.feed("ther>\n<parameter=city>\nPar")
    assert name_event.name == "get_weather" and name_event.tool_index == 0 and name_event.arguments == ""
    assert p.feed("is\n</parameter") == []  # the value is not complete until its end tag
    assert [e.arguments for e in p.feed(">\n<parameter=days>\n3\n</parameter>\n")] == [
        '{"city": "Paris"',
        ', "days": 3',
    ]
    assert [e.arguments for e in p.feed("</function>\n</tool_call>")] == ["}"]
    assert p.finish() == []


def test_duplicate_parameter_keeps_first_value():
    text = (
        "<tool_call><function=get_weather><parameter=days>1</parameter><parameter=days>2</parameter>"
        "</function></tool_call>"
    )
    _, calls = tool_calls.parse(text, TOOLS)
    assert calls[0].function.arguments == '{"days": 1}'
    assert _streaming(list("</think>" + text), True)[2] == [("get_weather", '{"days": 1}')]


def test_finish_reason_mapping():
    assert chat_finish_reason("stop", True) == "tool_calls"
    assert chat_finish_reason("stop", False) == "stop"
    assert chat_finish_reason("length", True) == "length"
    assert chat_finish_reason("abort", False) == "stop"


def test_without_parsers_text_passes_through():
    raw = "x</think><tool_call><function=get_weather></function></tool_call>"
    out = parse_chat_output(raw, reasoning_parser=None, tool_parser=None, tools=None, starts_in_reasoning=True)
    assert (out.reasoning_content, out.content, out.tool_calls) == (None, raw, ())
    with pytest.raises(ValueError, match="reasoning_parser"):
        parse_chat_output(raw, reasoning_parser="deepseek", tool_parser=None, tools=None, starts_in_reasoning=True)
