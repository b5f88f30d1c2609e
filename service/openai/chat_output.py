"""Reasoning parser + tool-call parser chained for one chat choice, in OpenAI shapes.

Non-streaming::

    out = parse_chat_output(text, reasoning_parser=args.reasoning_parser, tool_parser=tool_parser,
                            tools=req.tools, starts_in_reasoning=prompt_starts_in_reasoning(prompt_text))
    ChatMessageOut(content=out.content, reasoning_content=out.reasoning_content,
                   tool_calls=list(out.tool_calls) or None)
    finish_reason = chat_finish_reason(engine_finish_reason, bool(out.tool_calls))

Streaming (one parser per choice)::

    p = ChatOutputStreamParser(reasoning_parser=..., tool_parser=..., tools=req.tools, starts_in_reasoning=...)
    for text in engine_deltas:
        delta = p.feed(text)          # DeltaMessage or None (nothing to send yet)
    delta = p.finish()                # flush; then send finish_reason (p.has_tool_calls -> "tool_calls")

`tool_parser` should be None when `req.tools_enabled` is false (no tools, or tool_choice "none"): tool-call
text then stays content. `reasoning_parser=None` leaves everything as content.
Parser names: reasoning "nemotron_3", tool "qwen3_coder" (`service.deployments.args.AppArgs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.openai import reasoning, tool_calls
from service.openai.responses import DeltaMessage, DeltaToolCall, ToolCall

REASONING_PARSERS = ("nemotron_3",)
TOOL_PARSERS = ("qwen3_coder",)


def _check_names(reasoning_parser: str | None, tool_parser: str | None) -> None:
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser {reasoning_parser!r} unknown; known: {REASONING_PARSERS}")
    if tool_parser is not None and tool_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_parser {tool_parser!r} unknown; known: {TOOL_PARSERS}")


@dataclass(frozen=True)
class ParsedChatOutput:
    reasoning_content: str | None  # text of the reasoning section, None if empty
    content: str | None  # visible answer outside tool calls, None if empty
    tool_calls: tuple[ToolCall, ...]  # in order of appearance
    unknown_tool_names: tuple[str, ...]  # names of calls to functions not in the request's tools


def parse_chat_output(
    text: str,
    *,
    reasoning_parser: str | None,
    tool_parser: str | None,
    tools: Sequence[Any] | None,
    starts_in_reasoning: bool,
) -> ParsedChatOutput:
    _check_names(reasoning_parser, tool_parser)
    reasoning_text, content = reasoning.parse(text, starts_in_reasoning) if reasoning_parser else (None, text or None)
    calls: list[ToolCall] = []
    if tool_parser and content:
        content, calls = tool_calls.parse(content, tools)
    return ParsedChatOutput(reasoning_text, content, tuple(calls), tuple(tool_calls.unknown_tool_names(calls, tools)))


def chat_finish_reason(engine_reason: str, has_tool_calls: bool) -> str:
    """OpenAI finish_reason from the engine's ("stop" | "length" | "abort" ...): a natural stop after tool
    calls is "tool_calls"; anything but "length" counts as "stop"."""
    if engine_reason == "length":
        return "length"
    return "tool_calls" if has_tool_calls else "stop"


def _merge_tool_events(events: Sequence[tool_calls.DeltaEvent]) -> list[DeltaToolCall]:
    """Consecutive events of one call become one DeltaToolCall (name and argument fragments joined)."""
    out: list[DeltaToolCall] = []
    for ev in events:
        if ev.tool_index is None:
            continue
        last = out[-1] if out else None
        if last is not None and last.index == ev.tool_index and ev.name is None and last.function is not None:
            last.function.arguments = (last.function.arguments or "") + ev.arguments
        else:
            out.append(ev.to_delta_tool_call())
    return out


class ChatOutputStreamParser:
    """Streaming twin of `parse_chat_output`: `feed(delta) -> DeltaMessage | None`, then `finish()`."""

    def __init__(
        self,
        *,
        reasoning_parser: str | None,
        tool_parser: str | None,
        tools: Sequence[Any] | None,
        starts_in_reasoning: bool,
    ) -> None:
        _check_names(reasoning_parser, tool_parser)
        self._reasoning = reasoning.ReasoningStreamParser(starts_in_reasoning) if reasoning_parser else None
        self._tools = tool_calls.ToolCallStreamParser(tools) if tool_parser else None

    @property
    def has_tool_calls(self) -> bool:
        return self._tools is not None and self._tools.num_tool_calls > 0

    def feed(self, delta: str) -> DeltaMessage | None:
        reasoning_delta, content_delta = self._reasoning.feed(delta) if self._reasoning else ("", delta)
        return self._build(reasoning_delta, content_delta, final=False)

    def finish(self) -> DeltaMessage | None:
        reasoning_delta, content_delta = self._reasoning.finish() if self._reasoning else ("", "")
        return self._build(reasoning_delta, content_delta, final=True)

    def _build(self, reasoning_delta: str, content_delta: str, final: bool) -> DeltaMessage | None:
        if self._tools is None:
            content = content_delta
            calls: list[DeltaToolCall] = []
        else:
            events = self._tools.feed(content_delta) if content_delta else []
            if final:
                events += self._tools.finish()
            content = "".join(ev.content for ev in events)
            calls = _merge_tool_events(events)
        if not (reasoning_delta or content or calls):
            return None
        return DeltaMessage(
            reasoning_content=reasoning_delta or None, content=content or None, tool_calls=calls or None
        )
