"""What the original TVCache release's wire format (``tvcache.server.wire``) needs of the service below it.

The service serves the native API and knows the wire format only through this module: the tool its calls are
stored under (``WIRE_TOOL``), the rule a native insert of such a call must keep so wire readers can serve it
(``check_wire_insert``), how a wire node's value is read back (``decode_value``), and the hooks run after each
lease is released (``ReleaseHooks``: the wire format evicts what only a lease kept over the budget). A lease the
wire format takes is tagged with its env id (``HeldLease.tag``), which ``/unref`` releases by.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..calls import canonical_json
from ..errors import InvalidInput, InvalidToolCall

__all__ = ["WIRE_TOOL", "ReleaseHooks", "check_wire_insert", "decode_value"]

WIRE_TOOL = "tvcache.wire"

L = TypeVar("L")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# Built once, as ``json.loads(text, parse_constant=...)`` would build it on every call (each /get hit reads one).
_VALUE_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def _parse_value(text: str) -> Any:
    """The JSON value ``text`` holds, or ValueError: not JSON, a non-finite number, or a value the cache could
    not store itself (too deep, a huge integer, a lone surrogate) -- exactly what ``PUT /put`` accepts."""
    try:
        value = _VALUE_DECODER.decode(text)
        canonical_json(value)
    except (ValueError, RecursionError, InvalidToolCall) as error:
        raise ValueError(str(error) or type(error).__name__) from None
    return value


def decode_value(text: str) -> Any:
    """A wire node's value. Nodes written through ``PUT /put`` hold canonical JSON; a record that does not (one
    written before ``/v1/insert`` checked it, or edited by hand) is served as its text, so one client's bad data
    never breaks another client's reads."""
    try:
        return _parse_value(text)
    except ValueError:
        return text


def check_wire_insert(name: str, arguments: dict[str, Any], output: str) -> None:
    """Refuse a native ``/v1/insert`` of a ``tvcache.wire`` call that wire readers could not serve: the wire format
    reads the call's string from ``arguments["call"]`` and decodes the output as a JSON value."""
    if name != WIRE_TOOL:
        return
    if set(arguments) != {"call"} or not isinstance(arguments["call"], str):
        raise InvalidInput(
            f'a {WIRE_TOOL!r} call takes exactly one argument, "call", the reference client\'s call string'
        )
    try:
        _parse_value(output)
    except ValueError as error:
        raise InvalidInput(
            f"the output of a {WIRE_TOOL!r} call is the value the wire format serves, so it must be JSON text "
            f"(encode a string as a JSON string); this one is not: {error}"
        ) from None


class ReleaseHooks(Generic[L]):
    """What runs after each lease (an ``L``) is released, expiry included."""

    def __init__(self) -> None:
        self._hooks: list[Callable[[L], None]] = []

    def add(self, hook: Callable[[L], None]) -> None:
        self._hooks.append(hook)

    def run(self, lease: L) -> None:
        for hook in self._hooks:
            hook(lease)

    def clear(self) -> None:
        self._hooks.clear()
