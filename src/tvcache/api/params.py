"""Query parameters, of the native routes (``tvcache.api.routes``) and the original release's
(``tvcache.server.wire``) alike: one ``Param`` to declare them and one ``parse_query`` to read them.

The two tables read a few cases differently, because each answers as its clients expect; ``reference=True``
gives a parameter the original release's reading: a parameter given twice is refused (the native API reads the
last), an empty one counts as absent (the native API reads it, so an empty integer is refused), an integer is
ASCII digits, and the messages quote the parameter and the value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import InvalidInput

__all__ = ["Param", "QueryValues", "parse_query", "query_values"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Param:
    """A query parameter: text, or a non-negative integer (``low``..``high`` when bounded), given once or
    ``repeated`` (a list of every value, in order). ``required``: refused when absent; else ``default``."""

    name: str
    required: bool = True
    repeated: bool = False
    integer: bool = False
    default: Any = None
    low: int = 0
    high: int | None = None
    reference: bool = False  # the original release's reading (see the module docstring)


class QueryValues(Protocol):
    """A query string's parameters: Starlette's ``QueryParams``, or the hot path's ``hot.RawQuery``."""

    def getlist(self, key: str) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class _Single:
    """A mapping of one value per name (what a Ray shard is handed) read as a query string."""

    params: Mapping[str, str]

    def getlist(self, key: str) -> list[str]:
        value = self.params.get(key)
        return [] if value is None else [value]


def query_values(params: Mapping[str, str] | QueryValues) -> QueryValues:
    """``params`` as a query string's parameters."""
    return params if hasattr(params, "getlist") else _Single(params)


def parse_query(params: QueryValues, spec: Sequence[Param]) -> dict[str, Any]:
    """The declared parameters of a query string, or InvalidInput (the native API answers 422, the original
    release's routes 400) naming what is wrong."""
    parsed: dict[str, Any] = {}
    for param in spec:
        values = params.getlist(param.name)
        if param.repeated:
            parsed[param.name] = values
            if param.required and not values:
                raise InvalidInput(f"query parameter {param.name!r} is required (repeat it once per call, in order)")
            continue
        if len(values) > 1 and param.reference:
            raise InvalidInput(f"query parameter {param.name!r} is given {len(values)} times; give it once")
        if not values or (values[-1] == "" and (param.required or param.reference)):
            if param.required:
                raise InvalidInput(f"query parameter {param.name!r} is required")
            parsed[param.name] = param.default
            continue
        value: Any = values[-1]
        if param.integer:
            value = _integer(param, value)
        parsed[param.name] = value
    return parsed


def _integer(param: Param, text: str) -> int:
    if param.reference:
        if not (text.isascii() and text.isdigit()) or (
            param.high is not None and not param.low <= int(text) <= param.high
        ):
            raise InvalidInput(
                f"query parameter {param.name!r} must be an integer from {param.low} to {param.high}, "
                f"got {text!r:.40}"
            )
        return int(text)
    if not text.isdigit() or (param.high is not None and not param.low <= int(text) <= param.high):
        if param.high is None:
            raise InvalidInput(f"{param.name} must be a non-negative integer")
        raise InvalidInput(f"{param.name} must be an integer from {param.low} to {param.high}")
    return int(text)
