"""Imports of optional frameworks that, when the framework is missing, name the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str) -> ModuleType:
    """Import an optional framework, or fail with the command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"this tvcache integration needs {module.split('.')[0]!r}, which is not installed: "
            f"pip install 'tvcache[{extra}]' ({error})"
        ) from error
