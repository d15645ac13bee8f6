"""Canonical serialisation: the same value always becomes the same bytes.

Provider prompt caches match byte-identical (token-identical) prefixes, and tool definitions sit at the head of
every request, so the main model's tool segment is rendered once with sorted keys, fixed separators and no
ASCII escaping, and that exact string is reused for every request.
"""

from __future__ import annotations

import json
from typing import Any


def canonical_json(value: Any) -> str:
    """Deterministic JSON text for ``value``."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def render_tools(definitions: list[dict[str, Any]]) -> str:
    """The canonical tool segment: definitions sorted by function name, then canonical JSON."""
    ordered = sorted(definitions, key=lambda d: str(d.get("function", {}).get("name", "")))
    return canonical_json(ordered)
