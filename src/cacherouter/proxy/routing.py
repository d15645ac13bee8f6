"""What the proxy decides, whatever the API: the session's fixed view, routed-call ids, and INTERNAL_ROUTER's answers.

Standard library only (plus cacherouter's own registry, relevance and router stages); the HTTP side is in
:mod:`cacherouter.proxy.app` and the two API dialects in :mod:`.openai_api` and :mod:`.anthropic_api`.

* :class:`ToolView` -- the core tools (as the client first defined them) plus ``INTERNAL_ROUTER``, rendered once
  to canonical JSON (definitions sorted by name, keys sorted, fixed separators) and reused byte for byte.
* Routed-call ids (:func:`encode_routed_id`) -- a call of ``INTERNAL_ROUTER`` that the proxy turns into a call of
  the client's own tool gets an id that *carries* the provider's original call (its id and its arguments' text,
  zlib-compressed, base64url). When the client sends that call and its result back, the original is decoded from
  the id alone: no state, so a restarted proxy or another proxy process rewrites the history the same way.
* :class:`TurnStore` -- what cannot ride in an id: ``INTERNAL_ROUTER`` calls the proxy answered itself (a
  retrieval search, a call it refused) and the rounds that took. A bounded in-memory LRU keyed by the session
  and the ids (or text) of the reply the client received; lost on restart, and then the provider sees the
  conversation without those hidden rounds -- a valid history, but a new prefix from that point on.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..canonical import canonical_json
from ..channels.relevance import Ranker
from ..channels.router import RouterConfig, filter_candidates
from ..prompts import ROUTER_TOOL
from ..tools.registry import RegisteredTool

ROUTED_PREFIX = "crr1_"
DETERMINISTIC = "deterministic retrieval (no router model configured)"
ROUTER_KEYS = frozenset({"task", "hint", "tool", "arguments"})


def dumps(value: Any) -> str:
    """The proxy's one serialisation of a client's JSON: member order as parsed, compact separators, UTF-8 text."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True, kw_only=True)
class ClientTool:
    """One tool of the client's ``tools`` array: its name, what retrieval reads, and its definition as sent."""

    name: str
    description: str
    parameters: dict[str, Any]
    definition: dict[str, Any]

    def registered(self) -> RegisteredTool:
        """The tool as a registry entry, so the router's filter and rankers work on it unchanged."""
        return RegisteredTool(
            name=self.name,
            package="client",
            skill="client",
            description=self.description,
            upstream="client",
            upstream_tool=self.name,
            declared_schema=dumps(self.parameters),
            digest=hashlib.sha256(canonical_json(self.definition).encode("utf-8")).hexdigest(),
        )


@dataclass(frozen=True, kw_only=True)
class ToolView:
    """The provider-facing tool segment of one session: fixed when the session starts, never re-rendered."""

    core: tuple[str, ...]
    tools_json: str

    @classmethod
    def build(
        cls,
        core: Sequence[ClientTool],
        router_definition: dict[str, Any],
        *,
        name_of: Callable[[dict[str, Any]], str],
    ) -> ToolView:
        definitions = [tool.definition for tool in core] + [router_definition]
        ordered = sorted(definitions, key=name_of)
        return cls(core=tuple(sorted(tool.name for tool in core)), tools_json=canonical_json(ordered))

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.tools_json.encode("utf-8")).hexdigest()


def encode_routed_id(provider_id: str, arguments: str) -> str:
    """The id the client sees for a routed call: the provider's call id and argument text, recoverable."""
    payload = dumps([provider_id, arguments]).encode("utf-8")
    packed = base64.urlsafe_b64encode(zlib.compress(payload, 9)).rstrip(b"=").decode("ascii")
    return ROUTED_PREFIX + packed


def decode_routed_id(call_id: str) -> tuple[str, str] | None:
    """(provider id, arguments text) of a routed call's id, or None for any other id."""
    if not call_id.startswith(ROUTED_PREFIX):
        return None
    packed = call_id[len(ROUTED_PREFIX) :]
    try:
        raw = zlib.decompress(base64.urlsafe_b64decode(packed + "=" * (-len(packed) % 4)))
        value = json.loads(raw)
    except (binascii.Error, zlib.error, ValueError):
        return None
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return value[0], value[1]
    return None


@dataclass(frozen=True, kw_only=True)
class ProviderCall:
    """One tool call as the provider produced it; ``arguments`` is the JSON text of its arguments."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, kw_only=True)
class Routed:
    """INTERNAL_ROUTER resolved to a call of the client's tool ``tool`` with ``arguments`` (JSON text)."""

    tool: str
    arguments: str
    candidates: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Answered:
    """A call the proxy answers itself (its result goes to the provider; the client never sees the call)."""

    text: str
    is_error: bool = False


@dataclass(frozen=True, kw_only=True)
class StoredTurn:
    """The provider-side parts of one client-visible reply that the client's history does not carry.

    ``before``: whole messages of hidden rounds that precede the reply (provider-side form). ``inserted``:
    calls answered by the proxy within the reply itself, as (position, call object). ``results``: their results,
    as the dialect's tool-result objects, put after the client's own results for that reply.
    """

    before: tuple[Any, ...] = ()
    inserted: tuple[tuple[int, Any], ...] = ()
    results: tuple[Any, ...] = ()


@dataclass
class TurnStore:
    """A bounded LRU of :class:`StoredTurn` by :func:`turn_key`. Thread-safe; in memory only."""

    capacity: int = 4096
    _entries: OrderedDict[str, StoredTurn] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def put(self, key: str, turn: StoredTurn) -> None:
        with self._lock:
            self._entries[key] = turn
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, key: str) -> StoredTurn | None:
        with self._lock:
            turn = self._entries.get(key)
            if turn is not None:
                self._entries.move_to_end(key)
            return turn

    def __len__(self) -> int:
        return len(self._entries)


def turn_key(session: str, call_ids: Sequence[str], text: str) -> str:
    """The store key of a reply: its call ids (unique per provider call) or, for a reply without calls, its text."""
    basis = "calls:" + "\n".join(call_ids) if call_ids else "text:" + text
    return hashlib.sha256(f"{session}\n{basis}".encode()).hexdigest()


def retrieval_definition_parameters() -> dict[str, Any]:
    """INTERNAL_ROUTER's input schema with deterministic retrieval: find tools by task, then call one."""
    return {
        "type": "object",
        "properties": {
            "task": {"type": "string", "description": "What to do, with all concrete inputs: lists matching tools."},
            "hint": {"type": "string", "description": "Optional keywords or a tool name, if known."},
            "tool": {"type": "string", "description": "The tool to call, from an earlier answer."},
            "arguments": {"type": "object", "description": "The arguments for `tool`, fitting its schema."},
        },
        "additionalProperties": False,
    }


def retrieval_description() -> str:
    return (
        f"Reach every tool not listed here, by {DETERMINISTIC}. Call it with `task` (and an optional `hint`) to "
        "get the best-matching tools and their input schemas; then call it with `tool` (one of those names) and "
        "`arguments` (an object fitting that tool's schema) to call it."
    )


def parse_router_arguments(text: str) -> dict[str, Any] | str:
    """The arguments of an INTERNAL_ROUTER call, checked against its schema; a message saying why, if they fail."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return f"{ROUTER_TOOL}: the arguments are not JSON ({text[:200]!r}); send an object"
    if not isinstance(value, dict):
        return f"{ROUTER_TOOL}: the arguments must be an object, got {dumps(value)[:200]}"
    unknown = sorted(set(value) - ROUTER_KEYS)
    if unknown:
        return f"{ROUTER_TOOL}: unknown argument(s) {unknown}; allowed: {sorted(ROUTER_KEYS)}"
    for key in ("task", "hint", "tool"):
        if key in value and not isinstance(value[key], str):
            return f"{ROUTER_TOOL}: '{key}' must be a string"
    if "arguments" in value and not isinstance(value["arguments"], dict):
        return f"{ROUTER_TOOL}: 'arguments' must be an object fitting the tool's input schema"
    return value


def resolve_deterministic(
    arguments_text: str,
    tools: dict[str, ClientTool],
    *,
    core: frozenset[str],
    config: RouterConfig,
    ranker: Ranker,
) -> Routed | Answered:
    """INTERNAL_ROUTER without a router model: ``{"tool", "arguments"}`` calls a tool; ``{"task"}`` searches."""
    parsed = parse_router_arguments(arguments_text)
    if isinstance(parsed, str):
        return Answered(text=parsed, is_error=True)
    tool, task = parsed.get("tool"), parsed.get("task")
    if tool and task:
        return Answered(
            text=f"{ROUTER_TOOL}: give either 'task' (to find tools) or 'tool' and 'arguments' (to call one)",
            is_error=True,
        )
    if tool:
        if tool not in tools:
            return Answered(
                text=f"{ROUTER_TOOL}: no tool {tool!r} is available (now); call it with a 'task' to find tools",
                is_error=True,
            )
        return Routed(tool=tool, arguments=dumps(parsed.get("arguments", {})))
    if "arguments" in parsed:
        return Answered(text=f"{ROUTER_TOOL}: 'arguments' needs 'tool', the tool to call", is_error=True)
    if not task or not task.strip():
        return Answered(
            text=f"{ROUTER_TOOL}: give a 'task' to find tools, or a 'tool' and its 'arguments' to call one",
            is_error=True,
        )
    hint = parsed.get("hint") or ""
    candidates = filter_candidates(
        f"{task} {hint}".strip(),
        [t.registered() for t in sorted(tools.values(), key=lambda t: t.name)],
        config=config,
        core_tools=core,
        ranker=ranker,
    )
    payload: dict[str, Any] = {
        "mode": DETERMINISTIC,
        "candidates": [
            {"name": t.name, "description": t.description, "inputSchema": tools[t.name].parameters} for t in candidates
        ],
        "next": f"call {ROUTER_TOOL} with 'tool' (one of these names) and 'arguments' to call it",
    }
    if not candidates:
        payload["next"] = "no available tool matches this task; rephrase it or solve it without tools"
    return Answered(text=canonical_json(payload))
