"""Tokenizer layer: HF `tokenizer.json` + `tokenizer_config.json`, chat templates, incremental detokenizing.

`Tokenizer` wraps the `tokenizers` library (no `transformers` at runtime) and renders chat templates
the way `transformers` does: a sandboxed jinja2 environment with `trim_blocks`/`lstrip_blocks`,
`raise_exception`, a non-HTML-escaping `tojson` filter and `strftime_now`; messages get their
`None` values dropped and `reasoning`/`thinking` aliased to `reasoning_content`; the special-token
strings (`bos_token`, `eos_token`, ...) are template variables that template kwargs may override.

`IncrementalDetokenizer` turns a growing token stream into text deltas in O(new tokens) per call
using a prefix/read window (as vLLM does): it only re-decodes the tokens after the last point where
the text was complete, and holds text back while it ends in a partial UTF-8 character.
"""

from __future__ import annotations

import array
import json
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

_REPLACEMENT_CHAR = "\ufffd"
_IM_END = "<|im_end|>"
# tokenizer_config keys whose strings are exposed to chat templates (transformers' special_tokens_map).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_REASONING_ALIASES = ("reasoning_content", "thinking", "reasoning")


def as_token_ids(prompt: Iterable[int]) -> list[int]:
    """The prompt's ids as a list of Python ints, converted at C speed (a long prompt crosses several processes);
    ValueError if one is not an integer (a float or a string is refused, not truncated or parsed)."""
    try:
        return array.array("q", prompt).tolist()
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"prompt token ids must be integers: {exc}") from None


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens either as a string or as an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"tokenizer_config special token must be a string or {{'content': ...}}, got {value!r}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """jinja's builtin tojson HTML-escapes; chat templates expect plain json.dumps."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses for `apply_chat_template`."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    """Drop None-valued keys (OpenAI sends `content=None`) and alias reasoning fields."""
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object, got {type(message).__name__}")
    out = {key: value for key, value in message.items() if value is not None}
    reasoning = next((out[key] for key in _REASONING_ALIASES if key in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


class Tokenizer:
    """A model folder's tokenizer. Token ids are ints in `[0, vocab_size)`."""

    def __init__(self, hf_tokenizer: _HFTokenizer, tokenizer_config: dict[str, Any]) -> None:
        self._tk = hf_tokenizer
        self._config = tokenizer_config
        self._special_token_strings = {
            key: content
            for key in _SPECIAL_TOKEN_KEYS
            if (content := _token_content(tokenizer_config.get(key))) is not None
        }
        self._special_token_ids = self._collect_special_ids()
        self._eos_token_ids = self._collect_eos_ids()
        source = tokenizer_config.get("chat_template")
        if isinstance(source, list):  # HF allows [{"name": "default", "template": ...}, ...]
            named = {item["name"]: item["template"] for item in source}
            source = named.get("default")
        self._chat_template_source: str | None = source
        self._chat_template = compile_chat_template(source) if source is not None else None

    @classmethod
    def from_model_path(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load `<path>/tokenizer.json` and (optional) `<path>/tokenizer_config.json`."""
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"model_path: no tokenizer.json in {path!s}")
        config_file = os.path.join(path, "tokenizer_config.json")
        config: dict[str, Any] = {}
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        return cls(_HFTokenizer.from_file(tokenizer_file), config)

    # ---- vocabulary -------------------------------------------------------------------------
    def _collect_special_ids(self) -> frozenset[int]:
        ids = {int(i) for i, tok in self._tk.get_added_tokens_decoder().items() if tok.special}
        for key, entry in (self._config.get("added_tokens_decoder") or {}).items():
            if entry.get("special", False):
                ids.add(int(key))
            else:
                ids.discard(int(key))
        for content in self._special_token_strings.values():
            token_id = self._tk.token_to_id(content)
            if token_id is not None:
                ids.add(token_id)
        return frozenset(ids)

    def _collect_eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for content in (self._special_token_strings.get("eos_token"), _IM_END):
            token_id = self._tk.token_to_id(content) if content is not None else None
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
        return tuple(ids)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """tokenizer_config `eos_token`, then `<|im_end|>` if the vocabulary has it (no duplicates)."""
        return self._eos_token_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids removed by `skip_special_tokens` (added tokens flagged special)."""
        return self._special_token_ids

    @property
    def special_tokens(self) -> dict[str, str]:
        """tokenizer_config special-token strings by key, e.g. {"eos_token": "<|im_end|>"}."""
        return dict(self._special_token_strings)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_source

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    # ---- encode / decode --------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = list(token_ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_token_ids]
        return self._tk.decode(ids, skip_special_tokens=False)

    def validate_token_ids(self, token_ids: Iterable[int], field: str = "prompt") -> None:
        """Raise ValueError naming `field` and the first id that is not an int in [0, vocab_size)."""
        vocab_size = self.vocab_size
        ids = token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids)
        if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size):
            return  # all valid, checked at C speed; else the loop below names the first bad id
        for position, token_id in enumerate(ids):
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise ValueError(f"{field}: token at position {position} is {token_id!r}, not an integer id")
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"{field}: token id {token_id} at position {position} is out of range [0, {vocab_size})"
                )

    # ---- chat -------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` (OpenAI-style dicts) to the prompt string, like transformers does."""
        if self._chat_template is None:
            raise ValueError("chat_template: this model's tokenizer_config.json has no chat template")
        if not isinstance(messages, list):
            raise ValueError("messages must be a list")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools must be a list of JSON-schema objects")
        chat = [_normalize_message(i, m) for i, m in enumerate(messages)]
        variables = {**self._special_token_strings, **template_kwargs}
        try:
            return self._chat_template.render(
                messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"messages: chat template rejected the conversation: {exc}") from exc

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Streams text for a growing list of token ids.

    Invariant: the concatenation of everything `add` (and `finish`) returned equals
    `tokenizer.decode(all_ids, skip_special_tokens)`; `add` never returns a partial UTF-8 character.
    Each call decodes only the ids after the last emitted chunk plus that chunk as context (vLLM's
    prefix/read offsets), so the cost is O(new tokens) while text flows.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = []  # every id kept (special ids dropped when skipping them)
        self._prefix_offset = 0  # window start: ids [prefix, read) are decoded only as context
        self._read_offset = 0  # ids before this index have had their text emitted
        self._text_parts: list[str] = []  # emitted deltas

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text_parts)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ids; return the newly completed text ("" while a character is incomplete)."""
        special = self._tokenizer.special_token_ids
        new_ids = [i for i in token_ids if not (self._skip_special_tokens and i in special)]
        if not new_ids:
            return ""
        self._token_ids.extend(new_ids)
        delta = self._pending_delta()
        if not delta or delta.endswith(_REPLACEMENT_CHAR):
            return ""  # partial UTF-8 character at the end: wait for the next token
        self._advance(delta)
        return delta

    def add_many(self, token_ids: Sequence[int]) -> str:
        """The text `add` would return over one call per id, with one decode when the ids end on a complete
        character; otherwise the text up to the last id after which it is complete (a few more decodes)."""
        text = self.add(token_ids)
        if text or len(token_ids) <= 1 or self._read_offset == len(self._token_ids):
            return text
        for end in range(len(self._token_ids) - 1, self._read_offset, -1):
            delta = self._pending_delta(end)
            if delta and not delta.endswith(_REPLACEMENT_CHAR):
                self._advance(delta, end)
                return delta
        return ""

    def _pending_delta(self, end: int | None = None) -> str:
        """Text of the ids in [read_offset, end) (end: all), decoded with the ids from `prefix_offset` as context."""
        decode = self._tokenizer.decode
        context = decode(self._token_ids[self._prefix_offset : self._read_offset])
        return decode(self._token_ids[self._prefix_offset : end])[len(context) :]

    def _advance(self, delta: str, end: int | None = None) -> None:
        """delta is the text of the ids up to `end` (all when None)."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids) if end is None else end
        self._text_parts.append(delta)

    def finish(self) -> str:
        """Flush held-back text at the end of the stream (invalid or truncated UTF-8 decodes to U+FFFD)."""
        if self._read_offset == len(self._token_ids):
            return ""
        delta = self._pending_delta()
        self._advance(delta)
        return delta
