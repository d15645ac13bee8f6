"""Exceptions as cached answers: the ``{"raise": ...}`` payload every harness adapter writes for a call that
raised, how it is rebuilt on a hit, and the table that keeps in memory what cannot be recorded.

A payload names the exception's class (``module:qualname``) and what rebuilds it. Its shape is part of the
cached value, so each adapter keeps the shape it has always written (a change would turn journaled entries into
misses or wrong rebuilds):

* Harbor and SWE-ReX's replay flavour: ``{"class", "args"}``, only for an exception ``recorded_exception`` finds
  that ``cls(*args)`` rebuilds exactly;
* SWE-ReX's shell flavour: ``{"class", "args", "kwargs"}``, for the exceptions it raises itself;
* mini-swe-agent: ``{"class", "messages"}`` (``field="messages"``), for ``InterruptAgentFlow`` and its kin;
* OpenHands: ``{"class", "args", "attrs"}`` (plus ``filename`` for an ``OSError``), described inside the sandbox
  and rebuilt without calling ``__init__`` (``rebuilt_described``).
"""

from __future__ import annotations

import importlib
import itertools
import json
from collections.abc import Iterable, Mapping
from typing import Any

from ..protocol import Outcome
from .optional_imports import import_ref

__all__ = [
    "UnrecordedErrors",
    "class_path",
    "raise_recorded",
    "rebuilt_described",
    "rebuilt_exception",
    "recorded_exception",
    "recorded_payload",
]


def class_path(cls: type) -> str:
    """``module:qualname``: how a payload names a class (``import_ref`` imports it)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def recorded_payload(
    cls: type[BaseException], args: Iterable[Any], *, field: str = "args", kwargs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``{"raise": {"class": ..., field: [...]}}``, with ``"kwargs"`` after them when given (even empty)."""
    recorded: dict[str, Any] = {"class": class_path(cls), field: list(args)}
    if kwargs is not None:
        recorded["kwargs"] = dict(kwargs)
    return {"raise": recorded}


def recorded_exception(error: BaseException) -> dict[str, Any] | None:
    """``{"raise": ...}`` for an exception that ``raise_recorded`` rebuilds exactly (same importable class, same
    JSON arguments, same message), else None."""
    cls = type(error)
    args = list(error.args)
    try:
        json.dumps(args)
        module = importlib.import_module(cls.__module__)
        if getattr(module, cls.__qualname__, None) is not cls:
            return None
        rebuilt = cls(*args)
    except Exception:
        return None
    same = type(rebuilt) is cls and list(rebuilt.args) == args and str(rebuilt) == str(error)
    if not same or vars(rebuilt) != vars(error):  # attributes __init__ set from elsewhere would be lost
        return None
    return recorded_payload(cls, args)


def rebuilt_exception(recorded: Mapping[str, Any], *, field: str = "args") -> BaseException:
    """The exception a payload's ``"raise"`` value describes, built by its class from ``field`` (and
    ``"kwargs"``, if there)."""
    built: BaseException = import_ref(recorded["class"])(*recorded[field], **recorded.get("kwargs", {}))
    return built


def raise_recorded(payload: Mapping[str, Any], *, field: str = "args") -> None:
    """Raise the exception ``payload`` holds under ``"raise"``, if it holds one."""
    recorded = payload.get("raise")
    if recorded is not None:
        raise rebuilt_exception(recorded, field=field)


def rebuilt_described(found: Mapping[str, Any]) -> BaseException:
    """The exception ``found`` describes (class, arguments, attributes), as it was raised where it was described:
    an ``OSError`` of (errno, message) through its constructor (which sets ``errno`` and the file names), any
    other without calling ``__init__``, its ``args`` and attributes set as they were."""
    cls = import_ref(found["class"])
    args = found["args"]
    if issubclass(cls, OSError) and len(args) == 2:
        error: BaseException = cls(args[0], args[1], found.get("filename"), None, found.get("filename2"))
    else:
        error = cls.__new__(cls)
        error.args = tuple(args)
    error.__dict__.update(found.get("attrs", {}))
    return error


class UnrecordedErrors:
    """Exceptions that cannot be recorded (or must not be: a timeout's effects depend on timing), kept in memory
    under a key. The call's outcome names the key and is non-deterministic, so it is never served from cache; the
    adapter raises the kept exception itself when the outcome comes back."""

    def __init__(self) -> None:
        self._kept: dict[int, BaseException] = {}
        self._ids = itertools.count()

    def outcome(self, error: BaseException, *, timeouts: tuple[type[BaseException], ...]) -> Outcome:
        """The outcome of a call that raised ``error``: its ``recorded_exception`` payload, or, for one that
        cannot be recorded or is one of ``timeouts``, the key it is kept under."""
        recorded = recorded_exception(error)
        if recorded is None or isinstance(error, timeouts):
            key = next(self._ids)
            self._kept[key] = error
            return Outcome(output=json.dumps({"unrecorded": key}), is_error=True, deterministic=False)
        return Outcome(output=json.dumps(recorded), is_error=True)

    def raise_any(self, payload: Mapping[str, Any]) -> None:
        """Raise the exception ``payload`` stands for, kept here or recorded in it; return if it holds none."""
        if "unrecorded" in payload:
            raise self._kept.pop(payload["unrecorded"])
        raise_recorded(payload)
