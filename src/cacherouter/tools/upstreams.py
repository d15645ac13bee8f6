"""MCP servers as registry sources: the upstreams config file, stable tool names, and the checks a tool must pass.

The config is JSON, in the shape most MCP clients already use (``mcpServers`` or ``servers``)::

    {"servers": {
        "git":  {"command": "mcp-server-git", "args": ["--repository", "/src/app"]},
        "time": {"command": "mcp-server-time", "env": {"TZ": "UTC"}, "deny": ["get_current_time"]},
        "docs": {"url": "http://127.0.0.1:8000/mcp", "headers": {"Authorization": "Bearer ..."}},
        "fs":   {"command": "npx", "args": ["@modelcontextprotocol/server-filesystem", "/data"],
                 "allow": ["read_text_file", "list_directory"], "timeout": 20, "keep_tools_for": 60}
    }}

Every tool of server ``S`` named ``t`` enters the registry's long tail as ``S__t`` (:func:`namespaced_name`): the
name depends on nothing but the two names, so a reconnect, a restart or another server coming and going never
renames a tool. Server names may not contain ``_``, so the ``__`` separator is unambiguous. A tool name the
OpenAI-style function-name rules cannot carry (dots, slashes, more than 64 characters) is spelled with ``_`` and a
short hash of the original, so two upstream names never meet in one registry name.

This module is standard-library only; the connections live in :mod:`cacherouter.tools.upstream_hub`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..canonical import canonical_json
from ..errors import ConfigError

SERVER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,23}$")
_TOOL_SAFE = re.compile(r"[^A-Za-z0-9_-]")
MAX_NAME = 64
#: The longest canonical JSON of one input schema a registry accepts: larger ones would crowd the router prompt.
MAX_SCHEMA_CHARS = 32_000
_JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
_KEYS = frozenset(
    {"command", "args", "env", "cwd", "url", "headers", "allow", "deny", "timeout", "call_timeout", "keep_tools_for"}
)


@dataclass(frozen=True, kw_only=True)
class UpstreamConfig:
    """One upstream MCP server: a stdio command or a streamable-HTTP URL, and what to take from it.

    ``allow`` (if non-empty) and ``deny`` name the server's own tool names. ``timeout`` bounds connecting
    (initialize) and each listing; ``call_timeout`` each tool call unless the caller gives a shorter one.
    ``keep_tools_for``: how long the tools of a server that went away stay registered while it is reconnected
    (calls to them fail at once meanwhile); after that they are dropped until it is back.
    """

    name: str
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    url: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    allow: frozenset[str] = frozenset()
    deny: frozenset[str] = frozenset()
    timeout: float = 30.0
    call_timeout: float = 60.0
    keep_tools_for: float = 30.0

    def __post_init__(self) -> None:
        if not SERVER_NAME.fullmatch(self.name):
            raise ConfigError(
                f"upstream name {self.name!r}: use a letter, then letters, digits or '-' (at most 24; no '_', "
                "which separates server and tool in the registry names)"
            )
        if bool(self.command) == bool(self.url):
            raise ConfigError(f"upstream {self.name!r}: give exactly one of 'command' (stdio) and 'url' (HTTP)")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"upstream {self.name!r}: url {self.url!r} is not an http(s) URL")
        for option in ("timeout", "call_timeout", "keep_tools_for"):
            value = getattr(self, option)
            if not (0 <= value < math.inf) or (option != "keep_tools_for" and value == 0):
                raise ConfigError(f"upstream {self.name!r}: {option} must be a finite number of seconds > 0")

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"

    def takes(self, tool: str) -> bool:
        """Whether the allow/deny lists let tool ``tool`` (the server's own name) into the registry."""
        return tool not in self.deny and (not self.allow or tool in self.allow)


def parse_upstreams(data: Any, *, source: str = "the upstreams config") -> tuple[UpstreamConfig, ...]:
    """The upstreams a config document lists, sorted by name. Raises :class:`ConfigError` naming the problem."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object with a 'servers' object")
    servers = data.get("servers", data.get("mcpServers"))
    if not isinstance(servers, dict):
        raise ConfigError(f"{source}: expected a 'servers' (or 'mcpServers') object mapping names to servers")
    out: list[UpstreamConfig] = []
    for name, entry in sorted(servers.items()):
        where = f"{source}: server {name!r}"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected an object")
        unknown = sorted(set(entry) - _KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        out.append(
            UpstreamConfig(
                name=str(name),
                command=_string(entry, "command", where),
                args=tuple(_strings(entry, "args", where)),
                env=tuple(sorted(_string_map(entry, "env", where).items())),
                cwd=_string(entry, "cwd", where) or None,
                url=_string(entry, "url", where),
                headers=tuple(sorted(_string_map(entry, "headers", where).items())),
                allow=frozenset(_strings(entry, "allow", where)),
                deny=frozenset(_strings(entry, "deny", where)),
                timeout=_seconds(entry, "timeout", where, 30.0),
                call_timeout=_seconds(entry, "call_timeout", where, 60.0),
                keep_tools_for=_seconds(entry, "keep_tools_for", where, 30.0),
            )
        )
    return tuple(out)


def load_upstreams(path: Path) -> tuple[UpstreamConfig, ...]:
    """Read and check an upstreams config file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"upstreams config {path}: cannot read it ({e.strerror or e})") from e
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"upstreams config {path}: not valid JSON ({e})") from e
    return parse_upstreams(data, source=f"upstreams config {path}")


def _string(entry: Mapping[str, Any], key: str, where: str) -> str:
    value = entry.get(key, "")
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {key!r} must be a string")
    return value


def _strings(entry: Mapping[str, Any], key: str, where: str) -> list[str]:
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: {key!r} must be a list of strings")
    return value


def _string_map(entry: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    value = entry.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ConfigError(f"{where}: {key!r} must be an object of strings")
    return {str(k): v for k, v in value.items()}


def _seconds(entry: Mapping[str, Any], key: str, where: str, default: float) -> float:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: {key!r} must be a number of seconds")
    return float(value)


def namespaced_name(server: str, tool: str) -> str:
    """The registry name of ``server``'s tool ``tool``: ``server__tool``, stable and collision-free.

    Names already safe (letters, digits, ``_``, ``-``) and short enough are kept as they are; any other name is
    made safe and suffixed with 8 hex digits of its SHA-256, so that ``a.b`` and ``a_b`` stay two tools.
    """
    prefix = f"{server}__"
    safe = _TOOL_SAFE.sub("_", tool)
    if safe == tool and tool and len(prefix) + len(tool) <= MAX_NAME:
        return prefix + tool
    digest = hashlib.sha256(tool.encode("utf-8")).hexdigest()[:8]
    room = MAX_NAME - len(prefix) - len(digest) - 1
    return f"{prefix}{safe[:room]}-{digest}"


def check_input_schema(schema: Any) -> str | None:
    """Why ``schema`` cannot serve as a tool's input schema, or None when it can.

    The MCP SDK checks a listing against the protocol's types; this checks what a model and the router need on
    top: an object schema whose properties are schemas, whose ``required`` names properties, with JSON types
    that exist, and small enough for a prompt.
    """
    if not isinstance(schema, dict):
        return "inputSchema is not a JSON object"
    if schema.get("type") != "object":
        return f"inputSchema type is {schema.get('type')!r}, not 'object'"
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        return "inputSchema properties is not an object"
    for key, value in properties.items():
        if not isinstance(value, dict | bool):
            return f"inputSchema property {key!r} is not a schema (got {type(value).__name__})"
        problem = _check_types(value, f"property {key!r}")
        if problem:
            return problem
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return "inputSchema required is not a list of property names"
    try:
        size = len(canonical_json(schema))
    except (TypeError, ValueError) as e:
        return f"inputSchema is not plain JSON ({e})"
    if size > MAX_SCHEMA_CHARS:
        return f"inputSchema is {size} characters of JSON; at most {MAX_SCHEMA_CHARS} are accepted"
    return None


def _check_types(schema: Any, where: str, depth: int = 0) -> str | None:
    if not isinstance(schema, dict) or depth > 32:
        return None if depth <= 32 else f"inputSchema {where} nests more than 32 levels"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if k not in _JSON_TYPES:
            return f"inputSchema {where} has type {k!r}, which JSON Schema does not know"
    for key in ("items", "additionalProperties"):
        problem = _check_types(schema.get(key), where, depth + 1)
        if problem:
            return problem
    nested = schema.get("properties")
    if isinstance(nested, dict):
        for name, value in nested.items():
            problem = _check_types(value, f"{where}.{name}", depth + 1)
            if problem:
                return problem
    return None
