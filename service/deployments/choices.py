"""Turning engine `GenerateChunk`s into OpenAI choices (full and streamed) for one request choice.

One `ChoiceState` per choice accumulates token ids, text and logprobs, and — for chat — runs the
reasoning and tool-call parsers, streaming (`delta_*`) or once at the end (`final_*`). The ingress
owns the HTTP side; this module only builds `service.openai.protocol` objects.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

from service.deployments.engine_deployment import GenerateChunk
from service.engine.tokenizer import Tokenizer
from service.openai.chat_output import ChatOutputStreamParser, chat_finish_reason, parse_chat_output
from service.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionLogprobs,
    ChatCompletionStreamChoice,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionStreamChoice,
    DeltaMessage,
    TopLogprob,
)
from service.openai.responses import completion_choice_json, json_str


@dataclass(frozen=True)
class ChoiceOptions:
    """How one choice's output is post-processed."""

    index: int  # choice index in the response
    num_top_logprobs: int  # top alternatives per token to report (0: none)
    want_logprobs: bool  # report logprobs at all
    reasoning_parser: str | None = None  # chat: "nemotron_3" or None
    tool_parser: str | None = None  # chat: "qwen3_coder" when the request enables tools, else None
    tools: tuple[Any, ...] | None = None  # chat: the request's tools (typing the arguments)
    starts_in_reasoning: bool = False  # chat: the rendered prompt ended inside <think>


def _merge_deltas(a: DeltaMessage | None, b: DeltaMessage | None) -> DeltaMessage:
    parts = [d for d in (a, b) if d is not None]
    join = lambda name: "".join(getattr(d, name) or "" for d in parts) or None  # noqa: E731
    calls = [c for d in parts for c in (d.tool_calls or [])]
    return DeltaMessage(content=join("content"), reasoning_content=join("reasoning_content"), tool_calls=calls or None)


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (printable bytes map to themselves, the other 68 bytes to
    code points from 256 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes | None:
    """Raw bytes of one vocabulary token (byte-level BPE or `<0xNN>` byte fallback), None if unknown."""
    piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return None
    fallback = _BYTE_FALLBACK.fullmatch(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    table = _byte_level_decoder()
    if all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return None


def token_text_and_bytes(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token as shown in logprobs: its text, or — when it is not valid UTF-8 on its own — OpenAI's
    `bytes:\\xNN...` form, so distinct byte tokens never collide; plus its raw bytes."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text, list(text.encode("utf-8"))
    raw = token_bytes(tokenizer, token_id)
    if raw is None:
        return text, list(text.encode("utf-8"))
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def _top_entries(tokenizer: Tokenizer, top: dict[int, float], k: int) -> list[tuple[str, list[int], float]]:
    ranked = sorted(top.items(), key=lambda kv: kv[1], reverse=True)[:k]
    return [(*token_text_and_bytes(tokenizer, t), lp) for t, lp in ranked]


def chat_logprobs(
    tokenizer: Tokenizer,
    chunk_ids: tuple[int, ...],
    logprobs: tuple[float, ...] | None,
    top: tuple[dict[int, float], ...] | None,
    k: int,
) -> list[ChatTokenLogprob]:
    """Chat-style logprob entries for consecutive generated tokens."""
    if logprobs is None:
        return []
    out = []
    for i, (t, lp) in enumerate(zip(chunk_ids, logprobs)):
        text, raw = token_text_and_bytes(tokenizer, t)
        alts = _top_entries(tokenizer, top[i], k) if top is not None and k > 0 else []
        out.append(
            ChatTokenLogprob(
                token=text,
                logprob=lp,
                bytes=raw,
                top_logprobs=[TopLogprob(token=a, bytes=b, logprob=v) for a, b, v in alts],
            )
        )
    return out


def completion_logprobs(
    tokenizer: Tokenizer,
    ids: tuple[int, ...],
    logprobs: tuple[float, ...] | None,
    top: tuple[dict[int, float], ...] | None,
    k: int,
    text_offset: int,
) -> CompletionLogprobs:
    """Legacy parallel-list logprobs; `text_offset` is where the first token starts in the choice's text."""
    out = CompletionLogprobs()
    offset = text_offset
    for i, (t, lp) in enumerate(zip(ids, logprobs or ())):
        token = token_text_and_bytes(tokenizer, t)[0]
        out.tokens.append(token)
        out.token_logprobs.append(lp)
        alts = _top_entries(tokenizer, top[i], k) if top is not None and k > 0 else []
        out.top_logprobs.append({a: v for a, _, v in alts})
        out.text_offset.append(offset)
        offset += len(tokenizer.decode([t]))
    return out


@dataclass
class ChoiceState:
    """Everything produced so far for one choice, plus its streaming parsers."""

    options: ChoiceOptions
    tokenizer: Tokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprob_entries: list[ChatTokenLogprob] = field(default_factory=list)
    completion_lp: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    sent_role: bool = False
    _parser: ChatOutputStreamParser | None = None

    def __post_init__(self) -> None:
        o = self.options
        self._parser = ChatOutputStreamParser(
            reasoning_parser=o.reasoning_parser,
            tool_parser=o.tool_parser,
            tools=o.tools,
            starts_in_reasoning=o.starts_in_reasoning,
        )

    def add(self, chunk: GenerateChunk) -> None:
        """Accumulate one engine chunk (call before any `delta_*`)."""
        self.token_ids.extend(chunk.token_ids)
        self.text += chunk.text
        self.num_cached_tokens = chunk.num_cached_tokens
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason

    # ---- chat ----
    def final_chat(self) -> ChatCompletionChoice:
        o = self.options
        out = parse_chat_output(
            self.text,
            reasoning_parser=o.reasoning_parser,
            tool_parser=o.tool_parser,
            tools=o.tools,
            starts_in_reasoning=o.starts_in_reasoning,
        )
        lp = ChatCompletionLogprobs(content=self.logprob_entries) if o.want_logprobs else None
        message = ChatMessageOut(
            content=out.content, reasoning_content=out.reasoning_content, tool_calls=list(out.tool_calls) or None
        )
        return ChatCompletionChoice(
            index=o.index,
            message=message,
            logprobs=lp,
            finish_reason=chat_finish_reason(self.finish_reason or "stop", bool(out.tool_calls)),
        )

    def collect_logprobs(self, chunk: GenerateChunk) -> list[ChatTokenLogprob]:
        entries = (
            chat_logprobs(
                self.tokenizer, chunk.token_ids, chunk.logprobs, chunk.top_logprobs, self.options.num_top_logprobs
            )
            if self.options.want_logprobs
            else []
        )
        self.logprob_entries.extend(entries)
        return entries

    def delta_chat(self, chunk: GenerateChunk) -> ChatCompletionStreamChoice | None:
        """The stream choice for one chunk (after `add`), or None when there is nothing to send yet."""
        entries = self.collect_logprobs(chunk)
        assert self._parser is not None
        delta = self._parser.feed(chunk.text) if chunk.text else None
        finish = None
        if chunk.finish_reason is not None:
            delta = _merge_deltas(delta, self._parser.finish())
            finish = chat_finish_reason(chunk.finish_reason, self._parser.has_tool_calls)
        if delta is None and not entries and finish is None and self.sent_role:
            return None
        delta = delta or DeltaMessage()
        if not self.sent_role:
            delta.role = "assistant"
            self.sent_role = True
        return ChatCompletionStreamChoice(
            index=self.options.index,
            delta=delta,
            finish_reason=finish,
            logprobs=ChatCompletionLogprobs(content=entries) if entries else None,
        )

    def delta_chat_json(self, chunk: GenerateChunk) -> str | None:
        """`delta_chat` (after `add`) as JSON (`model_dump_json(exclude_none=True)`): written directly when the choice
        has no logprobs and no reasoning or tool-call parser (its delta is the chunk's text), else from the model."""
        o = self.options
        if o.want_logprobs or o.reasoning_parser or o.tool_parser:
            choice = self.delta_chat(chunk)
            return None if choice is None else choice.model_dump_json(exclude_none=True)
        finish = None if chunk.finish_reason is None else chat_finish_reason(chunk.finish_reason, False)
        if not chunk.text and finish is None and self.sent_role:
            return None
        fields = [] if self.sent_role else ['"role":"assistant"']
        self.sent_role = True
        if chunk.text:
            fields.append(f'"content":{json_str(chunk.text)}')
        tail = "" if finish is None else f',"finish_reason":{json_str(finish)}'
        return f'{{"index":{o.index},"delta":{{{",".join(fields)}}}{tail}}}'

    # ---- completions ----
    def _completion_lp(self, chunk: GenerateChunk, text_offset: int) -> CompletionLogprobs | None:
        if not self.options.want_logprobs:
            return None
        return completion_logprobs(
            self.tokenizer,
            chunk.token_ids,
            chunk.logprobs,
            chunk.top_logprobs,
            self.options.num_top_logprobs,
            text_offset,
        )

    def add_completion(self, chunk: GenerateChunk) -> CompletionStreamChoice | None:
        """Accumulate and return the stream choice for one chunk (None when nothing new)."""
        offset = len(self.text)
        self.add(chunk)
        lp = self._completion_lp(chunk, offset)
        if lp is not None:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(self.completion_lp, name).extend(getattr(lp, name))
        finish = ("length" if self.finish_reason == "length" else "stop") if chunk.finish_reason else None
        if not (chunk.text or chunk.token_ids or finish):
            return None
        return CompletionStreamChoice(index=self.options.index, text=chunk.text, logprobs=lp, finish_reason=finish)

    def add_completion_json(self, chunk: GenerateChunk) -> str | None:
        """`add_completion`, the choice as JSON (`model_dump_json(exclude_none=True)`): written directly when the
        choice has no logprobs (most streams), so no model is built per chunk."""
        if self.options.want_logprobs:
            choice = self.add_completion(chunk)
            return None if choice is None else choice.model_dump_json(exclude_none=True)
        self.add(chunk)
        if not (chunk.text or chunk.token_ids or chunk.finish_reason):
            return None
        finish = ("length" if self.finish_reason == "length" else "stop") if chunk.finish_reason else None
        return completion_choice_json(self.options.index, chunk.text, finish)

    def final_completion(self) -> CompletionChoice:
        return CompletionChoice(
            index=self.options.index,
            text=self.text,
            logprobs=self.completion_lp if self.options.want_logprobs else None,
            finish_reason="length" if self.finish_reason == "length" else "stop",
        )
