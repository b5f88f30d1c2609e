"""Settings declared as data: a frozen dataclass whose fields carry their help text and checks in
`field(metadata=...)`, and the generic code that turns such a class into command-line flags,
validation and a JSON Schema (the Helm chart's values). `EngineConfig` is declared this way, so a
setting added there reaches `hybrid-serve serve`, `hybrid-serve generate`, the Serve app's
arguments and the chart without being written down anywhere else.

Field types: `bool`, `int`, `float`, `str`, or one of them `| None`. Metadata keys:
  help     (str, required)       one line for --help and the chart schema's description
  choices  (tuple, optional)     the allowed values
  min      (number, optional)    the smallest allowed value
  pattern  (str, optional)       a regular expression the whole string must match
  aliases  (tuple, optional)     more CLI spellings, e.g. another server's flag for the same setting
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

_SCALARS = (bool, int, float, str)
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


@dataclass(frozen=True)
class Setting:
    """One field of a settings dataclass, as the CLI, the validator and the schema see it."""

    name: str  # field name (snake_case); the CLI flag is --name-with-dashes
    type: type  # bool | int | float | str (the non-None part of the annotation)
    optional: bool  # the annotation allows None
    default: Any  # dataclasses.MISSING when the field is required
    help: str
    choices: tuple | None = None
    minimum: float | None = None
    pattern: str | None = None
    aliases: tuple[str, ...] = ()

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def camel_name(self) -> str:
        """The name as a Helm value key: page_size -> pageSize."""
        head, *rest = self.name.split("_")
        return head + "".join(part.capitalize() for part in rest)


def _scalar_of(name: str, hint: Any) -> tuple[type, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and args[0] in _SCALARS and len(typing.get_args(hint)) == 2:
            return args[0], True
    elif hint in _SCALARS:
        return hint, False
    raise TypeError(f"setting {name!r} has type {hint!r}; use bool, int, float, str or one of them | None")


def settings_of(cls: type) -> tuple[Setting, ...]:
    """The settings of dataclass `cls`, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            raise TypeError(f"setting {cls.__name__}.{f.name} needs metadata={{'help': ...}}")
        scalar, optional = _scalar_of(f.name, hints[f.name])
        m = f.metadata
        out.append(
            Setting(
                f.name,
                scalar,
                optional,
                f.default,
                m["help"],
                m.get("choices"),
                m.get("min"),
                m.get("pattern"),
                tuple(m.get("aliases", ())),
            )
        )
    return tuple(out)


def check_settings(obj: Any) -> None:
    """Raise ValueError naming the field if a value of dataclass instance `obj` breaks its declaration."""
    for s in settings_of(type(obj)):
        value = getattr(obj, s.name)
        if value is None and s.optional:
            continue
        ok_type = isinstance(value, s.type) and not (s.type is not bool and isinstance(value, bool))
        if s.type is float and isinstance(value, int) and not isinstance(value, bool):
            ok_type = True
        if not ok_type:
            raise ValueError(f"{s.name} must be {s.type.__name__}{' or None' if s.optional else ''}, got {value!r}")
        if s.choices is not None and value not in s.choices:
            raise ValueError(f"{s.name} must be one of {s.choices}, got {value!r}")
        if s.minimum is not None and value < s.minimum:
            raise ValueError(f"{s.name} must be >= {s.minimum}, got {value!r}")
        if s.pattern is not None and not re.fullmatch(s.pattern, value):
            raise ValueError(f"{s.name} must match {s.pattern!r}, got {value!r}")


def _help_text(s: Setting) -> str:
    if s.required or s.default is None:
        return s.help
    shown = str(s.default).lower() if s.type is bool else s.default
    return f"{s.help} (default: {shown})"


def add_setting_arguments(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One flag per setting of `cls` in an argument group: bools as --x/--no-x, others typed, with choices.

    Unset flags stay out of the parsed namespace, so the dataclass' own defaults apply.
    """
    group = parser.add_argument_group(title)
    for s in settings_of(cls):
        kwargs: dict[str, Any] = {
            "dest": s.name,
            "help": _help_text(s),
            "default": argparse.SUPPRESS,
            "required": s.required,
        }
        if s.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=s.type, choices=s.choices)
        group.add_argument(s.flag, *s.aliases, **kwargs)


def settings_from_namespace(ns: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The settings of `cls` given on the command line (flags left unset are omitted)."""
    return {s.name: getattr(ns, s.name) for s in settings_of(cls) if hasattr(ns, s.name)}


def json_schema(s: Setting) -> dict[str, Any]:
    """JSON Schema (draft-07) of one setting's value; string choices become a pattern, so that a
    validator's message quotes the rejected value."""
    schema: dict[str, Any] = {"type": _JSON_TYPES[s.type]}
    help_text = s.help
    if s.choices is not None and s.type is str:
        schema["pattern"] = "^(" + "|".join(re.escape(c) for c in s.choices) + ")$"
        help_text = f"{s.help}. One of: {', '.join(s.choices)}."
    elif s.choices is not None:
        schema["enum"] = list(s.choices)
    if s.pattern is not None:
        schema["pattern"] = f"^({s.pattern})$"
    if s.minimum is not None:
        schema["minimum"] = s.minimum
    if s.optional:
        schema = {"anyOf": [schema, {"type": "null"}]}
    return {**schema, "description": help_text}
