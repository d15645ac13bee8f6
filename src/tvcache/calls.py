"""Tool calls as canonical bytes, their stable digests, and tool specs; the rule for task ids, which key graphs.

Two calls are the same call when their names match and their arguments are equal as JSON values: key order
and whitespace do not matter, types do (``1`` and ``1.0`` and ``true`` are three different arguments, because a
tool can tell them apart). Digests are blake2b-128 over the canonical bytes, stable across processes and
machines, so they can key durable journals and route tasks to shards.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidTaskId, InvalidToolCall

__all__ = ["MAX_TASK_ID", "ToolCall", "ToolSpec", "canonical_json", "check_task_id", "stable_digest"]

DIGEST_BYTES = 16
MAX_TASK_ID = 1024


def check_task_id(task_id: object) -> None:
    """InvalidTaskId unless ``task_id`` is a non-empty string of at most ``MAX_TASK_ID`` characters, no NUL."""
    if not isinstance(task_id, str) or not task_id or len(task_id) > MAX_TASK_ID:
        raise InvalidTaskId(
            f"task id must be a non-empty string of at most {MAX_TASK_ID} characters, got {task_id!r:.80}"
        )
    if "\x00" in task_id:
        raise InvalidTaskId("task id must not contain NUL characters")


def stable_digest(data: bytes) -> bytes:
    """A portable 128-bit digest (never Python's salted ``hash()``)."""
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


MAX_DEPTH = 64
_MAX_INT_BITS = 13_000  # about 4,000 decimal digits: below Python's int-to-str conversion limit


def _check_text(text: str, where: str) -> None:
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError as error:
            raise InvalidToolCall(f"{where} contains a lone surrogate ({error.reason}), which is not UTF-8") from error


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """A plain-JSON copy of ``value`` (dicts and lists), or InvalidToolCall naming the offending path."""
    if isinstance(value, str):
        _check_text(value, f"argument {where}")
        return value
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value.bit_length() > _MAX_INT_BITS:
            raise InvalidToolCall(f"argument {where} is an integer too large to serialise; pass it as a string")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidToolCall(f"argument {where} is {value!r}, which JSON cannot represent; use a string")
        return value
    if depth >= MAX_DEPTH:
        raise InvalidToolCall(f"argument {where} is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, list | tuple):
        return [_plain(item, f"{where}[{index}]", depth + 1) for index, item in enumerate(value)]
    if isinstance(value, Mapping):
        plain = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidToolCall(f"argument {where} has a non-string key {key!r}; JSON keys are strings")
            _check_text(key, f"a key of argument {where}")
            plain[key] = _plain(item, f"{where}.{key}", depth + 1)
        return plain
    raise InvalidToolCall(
        f"argument {where} is a {type(value).__name__} ({value!r:.60}), which is not JSON-representable; "
        "pass strings, numbers, booleans, null, lists and string-keyed objects only"
    )


def _is_flat_plain(value: Any) -> bool:
    """True for the common shape of tool arguments, a dict of ASCII keys to ASCII strings, finite numbers,
    booleans and nulls, which ``_plain`` would copy unchanged: it can be encoded as it is."""
    if type(value) is not dict:
        return False
    for key, item in value.items():
        if type(key) is not str or not key.isascii():
            return False
        kind = type(item)
        if kind is str:
            if not item.isascii():
                return False
        elif kind is int:
            if item.bit_length() > _MAX_INT_BITS:
                return False
        elif kind is float:
            if not math.isfinite(item):
                return False
        elif item is not None and kind is not bool:
            return False
    return True


# Built once: json.dumps with non-default options constructs a new encoder per call, half the cost of a hit.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_json(value: Any) -> bytes:
    """Canonical UTF-8 JSON: sorted keys, no insignificant whitespace, shortest round-trip floats."""
    plain = value if _is_flat_plain(value) else _plain(value, "arguments")
    return _ENCODER.encode(plain).encode()


class ToolCall:
    """One tool call: a tool name and JSON arguments, held as canonical bytes with a stable digest.

    Immutable and hashable; equality is by digest. ``arguments`` is decoded from the canonical bytes, so a
    sandbox executes exactly the call that was keyed.
    """

    __slots__ = ("_canonical", "digest", "name")

    name: str
    digest: bytes
    _canonical: bytes

    def __init__(self, name: str, arguments: Mapping[str, Any] | None = None) -> None:
        if not isinstance(name, str) or not name or len(name) > 256:
            raise InvalidToolCall(f"tool name must be a non-empty string of at most 256 characters, got {name!r:.80}")
        _check_text(name, "tool name")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            raise InvalidToolCall(
                f"arguments of {name!r} must be a JSON object (a dict), got {type(arguments).__name__}"
            )
        canonical = canonical_json(arguments)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_canonical", canonical)
        object.__setattr__(self, "digest", stable_digest(name.encode() + b"\x00" + canonical))

    @classmethod
    def from_json(cls, name: str, arguments_json: str | bytes) -> ToolCall:
        """Build a call from arguments given as JSON text (as LLM tool calls arrive)."""
        try:
            arguments = json.loads(arguments_json)
        except (ValueError, TypeError, RecursionError) as error:
            raise InvalidToolCall(f"arguments of {name!r:.80} are not valid JSON: {error}") from error
        if not isinstance(arguments, dict):
            raise InvalidToolCall(f"arguments of {name!r:.80} must be a JSON object, got {type(arguments).__name__}")
        return cls(name, arguments)

    @property
    def arguments(self) -> dict[str, Any]:
        """A fresh copy of the arguments, decoded from the canonical bytes."""
        decoded: dict[str, Any] = json.loads(self._canonical)
        return decoded

    @property
    def canonical_arguments(self) -> bytes:
        return self._canonical

    def canonical(self) -> bytes:
        """The whole call as canonical JSON bytes: ``{"arguments":...,"name":...}``."""
        return b'{"arguments":' + self._canonical + b',"name":' + json.dumps(self.name).encode() + b"}"

    @property
    def hexdigest(self) -> str:
        return self.digest.hex()

    def __setattr__(self, key: str, value: object) -> None:
        raise AttributeError("ToolCall is immutable")

    def __delattr__(self, key: str) -> None:
        raise AttributeError("ToolCall is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ToolCall) and other.digest == self.digest

    def __hash__(self) -> int:
        return int.from_bytes(self.digest[:8], "little")

    def __repr__(self) -> str:
        text = self._canonical.decode()
        if len(text) > 80:
            text = text[:77] + "..."
        return f"ToolCall({self.name!r}, {text})"

    __str__ = __repr__

    def __reduce__(self) -> tuple[Any, ...]:
        return (ToolCall.from_json, (self.name, self._canonical))


_TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass(frozen=True, kw_only=True)
class ToolSpec:
    """What the cache must know about a tool to serve it exactly.

    ``read_only``: the call never changes sandbox state, so its result is keyed by the state it reads and it does
    not extend the rollout's path. Leave it False when unsure: a backend may still *prove* single calls read-only.
    ``deterministic``: True declares that the same call in the same state always returns the same result; False
    that it may not: a non-deterministic tool is never served from cache, and a non-deterministic call that may
    change state ends caching for the rest of the rollout, since later states can no longer be reproduced. None
    (the default: nobody declared it) caches the tool but checks it: the first time one of its results would be
    served from cache in a task, the call is executed once more and compared (``Cache(verify_undeclared=...)``).
    ``arguments`` / ``optional_arguments``: expected argument names and Python types, checked before execution
    (None skips the check).
    """

    name: str
    read_only: bool = False
    deterministic: bool | None = None
    description: str = ""
    arguments: Mapping[str, type | tuple[type, ...]] | None = None
    optional_arguments: Mapping[str, type | tuple[type, ...]] = field(default_factory=dict)

    def validate(self, call: ToolCall) -> None:
        """Raise InvalidToolCall when the call's arguments do not fit this spec."""
        if self.arguments is None:
            return
        given = call.arguments
        missing = [key for key in self.arguments if key not in given]
        if missing:
            raise InvalidToolCall(f"tool {self.name!r} is missing required argument(s): {', '.join(missing)}")
        known = {**self.arguments, **self.optional_arguments}
        unknown = [key for key in given if key not in known]
        if unknown:
            raise InvalidToolCall(
                f"tool {self.name!r} got unexpected argument(s) {', '.join(unknown)}; "
                f"it accepts: {', '.join(known) or '(none)'}"
            )
        for key, value in given.items():
            expected = known[key]
            types = expected if isinstance(expected, tuple) else (expected,)
            if float in types and int not in types:
                types = (*types, int)  # a JSON number: LLMs write 3 where 3.0 is meant
            # bool is an int in Python but not in JSON schemas: only accept it where bool is expected.
            wrong_bool = isinstance(value, bool) and bool not in types
            if wrong_bool or not isinstance(value, types):
                names = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)
                raise InvalidToolCall(
                    f"tool {self.name!r}: argument {key!r} must be {names}, got {type(value).__name__} {value!r:.60}"
                )
