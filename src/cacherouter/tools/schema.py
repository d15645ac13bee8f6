"""The data model of a tool script's command line, and its JSON Schema.

An :class:`ArgumentSpec` describes one argparse argument the way a tool call needs it: the property name
the model fills in (``dest``), the option strings used to build the argument vector, and the JSON type. A
:class:`ScriptSchema` is a whole parser. Both are produced by static analysis (``argparse_ast``) or, only
when asked, by reflection (``reflection``), and both producers must agree on this one model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

JsonType = Literal["string", "integer", "number", "boolean"]

#: How the value of an argument is put on the command line.
Action = Literal[
    "store",  # --name VALUE (or a positional VALUE)
    "store_true",  # --name when the value is true
    "store_false",  # --name when the value is false
    "store_const",  # --name when the value is true (argparse stores a constant)
    "boolean_optional",  # --name / --no-name (argparse.BooleanOptionalAction)
    "append",  # --name V1 --name V2 ...
    "extend",  # --name V1 V2 ...
    "count",  # --name repeated N times
]

FLAG_ACTIONS: frozenset[str] = frozenset({"store_true", "store_false", "store_const", "boolean_optional"})

#: A sentinel text for "argparse.SUPPRESS" / "no default", kept out of JSON.
NO_DEFAULT: Any = None


@dataclass(frozen=True, kw_only=True)
class ArgumentSpec:
    """One argparse argument as a tool parameter."""

    dest: str
    option_strings: tuple[str, ...] = ()  # empty for a positional argument
    action: Action = "store"
    json_type: JsonType = "string"
    nargs: int | str | None = None  # None, "?", "*", "+", "...", or an exact count
    choices: tuple[Any, ...] | None = None
    default: Any = NO_DEFAULT
    has_default: bool = False
    required: bool = False
    help: str = ""
    path_like: bool = False  # type=Path / FileType: still a string, but worth telling the model

    @property
    def positional(self) -> bool:
        return not self.option_strings

    @property
    def is_array(self) -> bool:
        if self.action in ("append", "extend"):
            return True
        return self.nargs in ("*", "+", "...") or (isinstance(self.nargs, int) and self.nargs != 1)

    def json_schema(self) -> dict[str, Any]:
        """The JSON Schema of this argument's value."""
        if self.action in FLAG_ACTIONS:
            item: dict[str, Any] = {"type": "boolean"}
        elif self.action == "count":
            item = {"type": "integer", "minimum": 0}
        else:
            item = {"type": self.json_type}
            if self.choices is not None:
                item["enum"] = list(self.choices)
            if self.path_like:
                item["format"] = "path"
        if self.is_array and self.action not in FLAG_ACTIONS and self.action != "count":
            schema: dict[str, Any] = {"type": "array", "items": item}
            if self.nargs == "+":
                schema["minItems"] = 1
            elif isinstance(self.nargs, int):
                schema["minItems"] = self.nargs
                schema["maxItems"] = self.nargs
        else:
            schema = item
        if self.help:
            schema["description"] = self.help
        if self.has_default and self.default is not None:
            schema["default"] = list(self.default) if isinstance(self.default, tuple) else self.default
        return schema


@dataclass(frozen=True, kw_only=True)
class ScriptSchema:
    """The command line of one tool script."""

    description: str = ""
    arguments: tuple[ArgumentSpec, ...] = ()
    # Each group lists dests of which at most one may be given (exactly one when the flag is true).
    exclusive_groups: tuple[tuple[tuple[str, ...], bool], ...] = ()
    source: Literal["static", "reflection", "none"] = "static"
    warnings: tuple[str, ...] = field(default=())

    def argument(self, dest: str) -> ArgumentSpec | None:
        for spec in self.arguments:
            if spec.dest == dest:
                return spec
        return None

    def json_schema(self) -> dict[str, Any]:
        """The ``inputSchema`` of the tool: an object with one property per argument."""
        properties = {spec.dest: spec.json_schema() for spec in self.arguments}
        required = [spec.dest for spec in self.arguments if spec.required]
        schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
        if required:
            schema["required"] = required
        return schema
