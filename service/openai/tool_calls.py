"""`qwen3_coder` tool-call parser (the format Nemotron-3 emits)::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    value
    </parameter>
    ...
    </function>
    </tool_call>

Non-streaming: `parse(text, tools) -> (content, [ToolCall])`. Streaming: `ToolCallStreamParser(tools)`,
`feed(delta) -> [DeltaEvent]`, then `finish()`. Run it on the *content* coming out of the reasoning parser.
The concatenated streaming output always equals `parse(full_text)` (tool call ids excepted): content
fragments join to `content`, and each call's `arguments` fragments join to the same JSON text.

Rules (both paths):
- Values: one leading and one trailing "\\n" are stripped, then typed by the tool's JSON schema for that
  parameter (`convert_value`): null, boolean, integer, number, object/array (json.loads), string; `type`
  lists, `anyOf`/`oneOf` and untyped `enum`s are honoured, non-string types tried first. A parameter the
  schema does not know, or a value that does not parse as any allowed type, stays a string.
- A value ends at `</parameter>`, or (model forgot it) at the next `<parameter=`, `</function>` or
  `</tool_call>`. A repeated parameter name keeps its first value.
- A call starts once `<function=NAME>` is complete after `<tool_call>` and ends at `</function>` (plus an
  optional `</tool_call>`) or at `</tool_call>`. Several calls per message are parsed.
- Unknown function names are kept (as vLLM does), their values stay strings, and they are flagged (not
  logged here): `DeltaEvent.known_function` is False on the name event and `unknown_tool_names()` lists them.
- A `<tool_call>` block that never gets a complete `<function=NAME>` before `</tool_call>` (or the end of
  the text) is not a call: its raw text stays content.
- Content is the text outside calls; whitespace that only separates text from a call (just before
  `<tool_call>` or just after a call) is dropped. Empty content is None.
- Truncated output (max_tokens inside a call): the call is returned with the parameters completed so far
  and its JSON closed; a partial parameter is dropped.

Streaming events: for each call, first `DeltaEvent(tool_index=i, tool_call_id=..., name=...)` as soon as the
name is complete, then one `arguments` fragment per parameter as soon as it is complete (`{"a": 1`,
`, "b": "x"`), then the closing `}` (or `{}` for no parameters). `DeltaEvent.to_delta_tool_call()` gives
the OpenAI `DeltaToolCall`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.openai.responses import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall, tool_call_id

TC_OPEN, TC_CLOSE = "<tool_call>", "</tool_call>"
FN_OPEN, FN_CLOSE = "<function=", "</function>"
P_OPEN, P_CLOSE = "<parameter=", "</parameter>"
_BODY_TAGS = (P_OPEN, FN_CLOSE, TC_CLOSE)  # what may follow inside a function
_VALUE_END_TAGS = (P_CLOSE, P_OPEN, FN_CLOSE, TC_CLOSE)  # what may end a parameter value
_MAX_TAG_LEN = max(len(t) for t in _VALUE_END_TAGS)
_INT_RE = re.compile(r"-?(?:0|[1-9]\d*)")
_NUMBER_RE = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_TYPE_ORDER = ("null", "boolean", "integer", "number", "object", "array")  # "string" is the fallback


# ------------------------------------------------------------------------------------------ schemas


def tool_schemas(tools: Sequence[Any] | None) -> dict[str, dict[str, Any]]:
    """name -> JSON schema of the arguments object, from the request's `tools` (pydantic `ChatTool`s or
    the equivalent dicts)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool["function"] if isinstance(tool, dict) else tool.function
        name = fn["name"] if isinstance(fn, dict) else fn.name
        params = fn.get("parameters") if isinstance(fn, dict) else fn.parameters
        out[name] = params if isinstance(params, dict) else {}
    return out


def _schema_types(schema: Any) -> list[str]:
    """JSON types a schema allows: `type` (string or list), `anyOf`/`oneOf` members, else inferred from
    `enum` values / `properties` / `items`."""
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    types = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types += _schema_types(sub)
    if not types and isinstance(schema.get("enum"), list):
        types = [_json_type(v) for v in schema["enum"]]
    if not types and "properties" in schema:
        types = ["object"]
    if not types and "items" in schema:
        types = ["array"]
    return list(dict.fromkeys(types))


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    return {dict: "object", list: "array"}.get(type(v), "string")


def _try_type(kind: str, raw: str) -> tuple[bool, Any]:
    s = raw.strip()
    if kind == "null":
        return s.lower() in ("null", "none"), None
    if kind == "boolean":
        return s.lower() in ("true", "false"), s.lower() == "true"
    if kind == "integer":
        return (True, int(s)) if _INT_RE.fullmatch(s) else (False, None)
    if kind == "number":
        if not _NUMBER_RE.fullmatch(s):
            return False, None
        if _INT_RE.fullmatch(s):
            return True, int(s)
        v = float(s)
        return math.isfinite(v), v
    try:
        v = json.loads(s)
    except json.JSONDecodeError:
        return False, None
    return isinstance(v, dict if kind == "object" else list), v


def convert_value(raw: str, schema: Any) -> Any:
    """Type one parameter value by its JSON schema (None: unknown parameter -> the string itself)."""
    types = _schema_types(schema)
    for kind in _TYPE_ORDER:
        if kind in types:
            ok, value = _try_type(kind, raw)
            if ok:
                return value
    return raw


def _param_schema(fn_schema: dict[str, Any] | None, key: str) -> Any:
    props = (fn_schema or {}).get("properties")
    return props.get(key) if isinstance(props, dict) else None


def _strip_newlines(raw: str) -> str:
    if raw.startswith("\n"):
        raw = raw[1:]
    return raw[:-1] if raw.endswith("\n") else raw


def _earliest(text: str, tags: Sequence[str], start: int = 0) -> tuple[int, str | None]:
    best, kind = -1, None
    for tag in tags:
        i = text.find(tag, start)
        if i >= 0 and (best < 0 or i < best):
            best, kind = i, tag
    return best, kind


def _find_header(text: str, start: int) -> tuple[str, int] | None:
    """(name, end of `<function=NAME>`) if a complete header comes before any `</tool_call>`."""
    close = text.find(TC_CLOSE, start)
    j = text.find(FN_OPEN, start)
    if j < 0 or 0 <= close < j:
        return None
    k = text.find(">", j + len(FN_OPEN))
    if k < 0 or 0 <= close < k:
        return None
    return text[j + len(FN_OPEN) : k].strip(), k + 1


def unknown_tool_names(calls: Sequence[ToolCall], tools: Sequence[Any] | None) -> list[str]:
    """Names of parsed calls that are not among the request's tools."""
    known = tool_schemas(tools)
    return [c.function.name for c in calls if c.function.name not in known]


# ------------------------------------------------------------------------------------- non-streaming


def _parse_body(text: str, p: int, fn_schema: dict[str, Any] | None) -> tuple[dict[str, Any], int]:
    """Parameters of one call starting at `p` (after the header); returns (arguments, end position)."""
    args: dict[str, Any] = {}
    while True:
        idx, kind = _earliest(text, _BODY_TAGS, p)
        if kind is None:
            return args, len(text)
        if kind == TC_CLOSE:
            return args, idx + len(TC_CLOSE)
        if kind == FN_CLOSE:
            p = idx + len(FN_CLOSE)
            rest = text[p:].lstrip()
            if rest.startswith(TC_CLOSE):
                p = len(text) - len(rest) + len(TC_CLOSE)
            return args, p
        k = text.find(">", idx + len(P_OPEN))
        if k < 0:
            return args, len(text)
        key = text[idx + len(P_OPEN) : k].strip()
        t, end_kind = _earliest(text, _VALUE_END_TAGS, k + 1)
        if end_kind is None:
            return args, len(text)
        if key not in args:
            args[key] = convert_value(_strip_newlines(text[k + 1 : t]), _param_schema(fn_schema, key))
        p = t + len(P_CLOSE) if end_kind == P_CLOSE else t


def parse(text: str, tools: Sequence[Any] | None) -> tuple[str | None, list[ToolCall]]:
    """Non-streaming: (content or None, tool calls in order)."""
    schemas = tool_schemas(tools)
    content: list[str] = []
    calls: list[ToolCall] = []
    pos, after_call = 0, False
    while True:
        i = text.find(TC_OPEN, pos)
        seg = text[pos:] if i < 0 else text[pos:i]
        if after_call:
            seg = seg.lstrip()
        if i < 0:
            content.append(seg)
            break
        header = _find_header(text, i + len(TC_OPEN))
        if header is None:  # not a call: raw text stays content
            close = text.find(TC_CLOSE, i + len(TC_OPEN))
            end = len(text) if close < 0 else close + len(TC_CLOSE)
            content.append(seg + text[i:end])
            pos, after_call = end, False
            continue
        content.append(seg.rstrip())
        name, body_start = header
        args, pos = _parse_body(text, body_start, schemas.get(name))
        calls.append(ToolCall(function=FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False))))
        after_call = True
    return "".join(content) or None, calls


# ----------------------------------------------------------------------------------------- streaming


@dataclass(frozen=True)
class DeltaEvent:
    """One piece of streamed output: either content or a fragment of tool call `tool_index`."""

    content: str = ""  # text outside tool calls ("" on tool-call events)
    tool_index: int | None = None  # 0-based index of the call in this message; None for content
    tool_call_id: str | None = None  # first event of a call only
    name: str | None = None  # first event of a call only
    arguments: str = ""  # fragment of function.arguments ("" on the name event)
    known_function: bool = True  # name event: whether `name` is one of the request's tools

    def to_delta_tool_call(self) -> DeltaToolCall:
        """OpenAI streaming shape; the first event carries id, type and name (arguments "")."""
        assert self.tool_index is not None, "content events have no tool call"
        if self.name is not None:
            return DeltaToolCall(
                index=self.tool_index,
                id=self.tool_call_id,
                type="function",
                function=DeltaFunctionCall(name=self.name, arguments=self.arguments),
            )
        return DeltaToolCall(index=self.tool_index, function=DeltaFunctionCall(arguments=self.arguments))


class ToolCallStreamParser:
    """Streaming twin of `parse`. States: text -> open (after `<tool_call>`) -> func (after the header)
    <-> param (inside a value) -> after_func (after `</function>`) -> text."""

    def __init__(self, tools: Sequence[Any] | None) -> None:
        self._schemas = tool_schemas(tools)  # function name -> arguments schema
        self._state = "text"
        self._buf = ""  # undecided text of the current state
        self._pending_ws = ""  # whitespace held before a `<tool_call>` that may turn out not to be a call
        self._after_call = False  # drop whitespace at the start of the text state
        self._num_calls = 0  # calls started so far (index of the next call)
        self._name = ""  # current call's function name
        self._keys: set[str] = set()  # parameters already emitted for the current call
        self._key = ""  # parameter being read in the param state
        self._scan_from = 0  # param state: buffer offset already searched for an end tag

    @property
    def num_tool_calls(self) -> int:
        return self._num_calls

    def feed(self, delta: str) -> list[DeltaEvent]:
        self._buf += delta
        events: list[DeltaEvent] = []
        step = {
            "text": self._step_text,
            "open": self._step_open,
            "func": self._step_func,
            "param": self._step_param,
            "after_func": self._step_after_func,
        }
        while step[self._state](events):
            pass
        return events

    def finish(self) -> list[DeltaEvent]:
        """Flush at the end of generation (closes a truncated call)."""
        events: list[DeltaEvent] = []
        buf, self._buf = self._buf, ""
        if self._state in ("func", "param"):
            self._close_call(events)
        elif self._state == "open":
            self._content(events, self._pending_ws + TC_OPEN + buf)
        else:  # text / after_func: the rest is content (after a call, leading whitespace dropped)
            self._content(events, buf.lstrip() if self._after_call or self._state == "after_func" else buf)
        self._state, self._pending_ws, self._after_call = "text", "", False
        return events

    # ---------------------------------------------------------------------------------------- states

    @staticmethod
    def _content(events: list[DeltaEvent], text: str) -> None:
        if text:
            events.append(DeltaEvent(content=text))

    def _step_text(self, events: list[DeltaEvent]) -> bool:
        if self._after_call:
            stripped = self._buf.lstrip()
            if not stripped:
                self._buf = ""
                return False
            self._buf, self._after_call = stripped, False
        i = self._buf.find(TC_OPEN)
        if i >= 0:
            seg = self._buf[:i]
            body = seg.rstrip()
            self._content(events, body)
            self._pending_ws = seg[len(body) :]
            self._buf, self._state = self._buf[i + len(TC_OPEN) :], "open"
            return True
        keep = 0
        for k in range(min(len(TC_OPEN) - 1, len(self._buf)), 0, -1):
            if self._buf.endswith(TC_OPEN[:k]):
                keep = k
                break
        head, tail = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
        body = head.rstrip()
        self._content(events, body)
        self._buf = head[len(body) :] + tail
        return False

    def _step_open(self, events: list[DeltaEvent]) -> bool:
        header = _find_header(self._buf, 0)
        if header is not None:
            self._name, end = header
            events.append(
                DeltaEvent(
                    tool_index=self._num_calls,
                    tool_call_id=tool_call_id(),
                    name=self._name,
                    known_function=self._name in self._schemas,
                )
            )
            self._num_calls += 1
            self._keys = set()
            self._buf, self._pending_ws, self._state = self._buf[end:], "", "func"
            return True
        close = self._buf.find(TC_CLOSE)
        if close < 0:
            return False
        end = close + len(TC_CLOSE)  # a block without a function header: raw text is content
        self._content(events, self._pending_ws + TC_OPEN + self._buf[:end])
        self._buf, self._pending_ws, self._state = self._buf[end:], "", "text"
        return True

    def _step_func(self, events: list[DeltaEvent]) -> bool:
        idx, kind = _earliest(self._buf, _BODY_TAGS)
        if kind is None:
            return False
        if kind == P_OPEN:
            k = self._buf.find(">", idx + len(P_OPEN))
            if k < 0:
                return False
            self._key = self._buf[idx + len(P_OPEN) : k].strip()
            self._buf, self._state, self._scan_from = self._buf[k + 1 :], "param", 0
            return True
        self._close_call(events)
        if kind == FN_CLOSE:
            self._buf, self._state = self._buf[idx + len(FN_CLOSE) :], "after_func"
        else:
            self._buf, self._state, self._after_call = self._buf[idx + len(TC_CLOSE) :], "text", True
        return True

    def _step_param(self, events: list[DeltaEvent]) -> bool:
        t, kind = _earliest(self._buf, _VALUE_END_TAGS, max(0, self._scan_from - _MAX_TAG_LEN + 1))
        if kind is None:
            self._scan_from = len(self._buf)
            return False
        if self._key not in self._keys:
            value = convert_value(
                _strip_newlines(self._buf[:t]), _param_schema(self._schemas.get(self._name), self._key)
            )
            sep = ", " if self._keys else "{"
            frag = f"{sep}{json.dumps(self._key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
            events.append(DeltaEvent(tool_index=self._num_calls - 1, arguments=frag))
            self._keys.add(self._key)
        self._buf = self._buf[t + len(P_CLOSE) :] if kind == P_CLOSE else self._buf[t:]
        self._state = "func"
        return True

    def _step_after_func(self, events: list[DeltaEvent]) -> bool:
        rest = self._buf.lstrip()
        if rest.startswith(TC_CLOSE):
            self._buf = rest[len(TC_CLOSE) :]
        elif TC_CLOSE.startswith(rest):  # maybe `</tool_call>` still coming
            return False
        self._state, self._after_call = "text", True
        return True

    def _close_call(self, events: list[DeltaEvent]) -> None:
        events.append(DeltaEvent(tool_index=self._num_calls - 1, arguments="}" if self._keys else "{}"))
