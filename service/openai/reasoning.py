"""`nemotron_3` reasoning parser: splits generated text into `reasoning_content` and `content`.

Nemotron-3's chat template ends the generation prompt with `<think>\\n` when thinking is on, so the
generated text starts *inside* reasoning; with thinking off the prompt ends with `<think></think>` and the
text is plain content. Pass `starts_in_reasoning=prompt_starts_in_reasoning(prompt_text)`.

Rules (identical for `parse` and `ReasoningStreamParser`):
1. If the generated text itself starts with `<think>` (model re-opens, or opens although the prompt did
   not), that tag and one following "\\n" are consumed and the text is reasoning.
2. Reasoning ends at the first `</think>` or `<tool_call>`, whichever comes first.
   - `</think>` is dropped, as is one "\\n" right before it and one "\\n" right after it (the template
     renders history as `<think>\\n{reasoning}\\n</think>\\n{content}`, so these newlines are format,
     not text; vLLM/SGLang keep them, we strip exactly one on each side).
   - `<tool_call>` is kept: it and everything after is content (for the tool-call parser); one "\\n"
     right before it is dropped from the reasoning.
3. Reasoning that never ends (e.g. cut by max_tokens) is returned whole, nothing stripped.
4. After reasoning ends, everything is content; later tags are not interpreted.
Empty parts come back as None from `parse`; streaming deltas are "" when there is nothing to emit.

Streaming use (per choice)::

    p = ReasoningStreamParser(starts_in_reasoning=True)
    for text in engine_deltas:
        reasoning_delta, content_delta = p.feed(text)
    reasoning_delta, content_delta = p.finish()

A possible tag prefix (e.g. a trailing "</thi" or "\\n") is held back until it is decided, so the
concatenated deltas always equal `parse(full_text)`.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"


def prompt_starts_in_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt leaves the model inside an open `<think>` block."""
    tail = prompt_text.rstrip(" \n")
    return tail.endswith(THINK_START)


def _strip_one(text: str, *, leading: bool = False, trailing: bool = False) -> str:
    if leading and text.startswith("\n"):
        text = text[1:]
    if trailing and text.endswith("\n"):
        text = text[:-1]
    return text


def _find_end(text: str) -> tuple[int, str | None]:
    """Position and kind of the first reasoning terminator in `text` ((-1, None) if none)."""
    i_end, i_tool = text.find(THINK_END), text.find(TOOL_CALL_START)
    if i_end >= 0 and (i_tool < 0 or i_end < i_tool):
        return i_end, THINK_END
    if i_tool >= 0:
        return i_tool, TOOL_CALL_START
    return -1, None


def parse(text: str, starts_in_reasoning: bool) -> tuple[str | None, str | None]:
    """Non-streaming: (reasoning_content, content), each None when empty."""
    in_reasoning = starts_in_reasoning
    if text.startswith(THINK_START):
        text, in_reasoning = _strip_one(text[len(THINK_START) :], leading=True), True
    if not in_reasoning:
        return None, text or None
    pos, kind = _find_end(text)
    if kind is None:
        return text or None, None
    reasoning = _strip_one(text[:pos], trailing=True)
    if kind == THINK_END:
        content = _strip_one(text[pos + len(THINK_END) :], leading=True)
    else:
        content = text[pos:]
    return reasoning or None, content or None


def _held_suffix_len(text: str) -> int:
    """Length of the longest suffix of `text` that could still grow into a terminator (plus the one "\\n"
    before it that a terminator would strip)."""
    n = 0
    for tag in (THINK_END, TOOL_CALL_START):
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:k]):
                n = max(n, k)
                break
    if text[: len(text) - n].endswith("\n"):
        n += 1
    return n


class ReasoningStreamParser:
    """Streaming twin of `parse`: `feed(delta) -> (reasoning_delta, content_delta)`, then `finish()`."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._starts_in_reasoning = starts_in_reasoning  # prompt ended inside `<think>`
        self._state = "start"  # "start" (may still see <think>) | "reasoning" | "content"
        self._buf = ""  # undecided text
        self._strip_newline = False  # drop one "\n" at the start of the next text

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning, content = [], []
        while True:
            if self._strip_newline:
                if not self._buf:
                    break
                self._buf = _strip_one(self._buf, leading=True)
                self._strip_newline = False
            if self._state == "start":
                if self._buf.startswith(THINK_START):
                    self._buf = self._buf[len(THINK_START) :]
                    self._state, self._strip_newline = "reasoning", True
                    continue
                if THINK_START.startswith(self._buf):  # still a possible `<think>` (or empty)
                    break
                self._state = "reasoning" if self._starts_in_reasoning else "content"
            if self._state == "content":
                content.append(self._buf)
                self._buf = ""
                break
            if not self._step_reasoning(reasoning, content):
                break
        return "".join(reasoning), "".join(content)

    def _step_reasoning(self, reasoning: list[str], content: list[str]) -> bool:
        """Consume reasoning text from the buffer; True if the state changed and the loop must go on."""
        pos, kind = _find_end(self._buf)
        if kind is None:
            keep = _held_suffix_len(self._buf)
            reasoning.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        reasoning.append(_strip_one(self._buf[:pos], trailing=True))
        self._state = "content"
        if kind == THINK_END:
            self._buf = self._buf[pos + len(THINK_END) :]
            self._strip_newline = True
        else:
            self._buf = self._buf[pos:]
        return True

    def finish(self) -> tuple[str, str]:
        """Flush held-back text at the end of generation."""
        buf, self._buf = self._buf, ""
        if self._state == "start":
            in_reasoning = self._starts_in_reasoning
        else:
            in_reasoning = self._state == "reasoning"
        return (buf, "") if in_reasoning else ("", buf)
