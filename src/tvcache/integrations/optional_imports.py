"""Imports of optional frameworks that, when the framework is missing, name the extra to install; and of the
object a ``module:Qualified.Name`` reference names (how payloads and configs name a class)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["import_ref", "require"]


def require(module: str, extra: str) -> ModuleType:
    """Import an optional framework, or fail with the command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"this tvcache integration needs {module.split('.')[0]!r}, which is not installed: "
            f"pip install 'tvcache[{extra}]' ({error})"
        ) from error


def import_ref(ref: str) -> Any:
    """The object a ``module:Qualified.Name`` reference names."""
    module, _, qualname = ref.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found
