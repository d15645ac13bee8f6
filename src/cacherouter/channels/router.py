"""The router channel behind ``INTERNAL_ROUTER``: compress, list everything, filter, one sub-model call, run.

Stages (each its own function so a test can check it alone):

1. :func:`compress_task` — the task plus recent context, cut to at most 800 characters.
2. The *whole* registry, not just the main model's core packages (new and bootstrapped tools included).
3. :func:`filter_candidates` — blacklist (hard), whitelist (if any), top-k relevance, then the yellowlist: core
   tools are avoided because the main model can call them itself, unless nothing else is left (keep the top 1).
4. One router sub-model request with only those candidates and ``tool_choice="auto"``.
5. Run the chosen tool -- never with arguments the sub-model garbled (a retry instead); return JSON text. Tool
   definitions never leave this module.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..canonical import canonical_json, render_tools
from ..errors import CacheRouterError
from ..models.base import ChatModel, ChatRequest, Message
from ..prompts import MAX_TASK_CHARS, ROUTER_SYSTEM
from ..tools.gateway import Gateway
from ..tools.registry import RegisteredTool
from .relevance import Ranker, make_ranker


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    blacklist: frozenset[str] = frozenset()
    whitelist: frozenset[str] = frozenset()
    top_k: int = 5
    ranker: str = "auto"  # see relevance.RANKERS
    yellowlist_core: bool = True  # add the main model's core tools to the yellowlist
    yellowlist: frozenset[str] = frozenset()
    filtering: bool = True  # False = the "no filter" configuration: every tool goes to the sub-model
    max_tokens: int = 2000
    tool_timeout: float = 60.0
    enabled: bool = True  # False = a deployment without a router: INTERNAL_ROUTER always answers "retry"


@dataclass(frozen=True, kw_only=True)
class RouterOutcome:
    status: str  # "ok", "tool_error" or "retry"
    tool: str | None
    payload: dict[str, Any]
    candidates: tuple[str, ...]

    def to_text(self) -> str:
        return canonical_json(self.payload)


def compress_task(task: str, context: Sequence[str] = (), *, limit: int = MAX_TASK_CHARS) -> str:
    """The task first (it matters most), then the most recent context lines, within ``limit`` characters."""
    task = " ".join(task.split())
    if len(task) >= limit:
        return task[: limit - 3] + "..."
    parts = [task]
    budget = limit - len(task)
    for line in reversed(context):
        line = " ".join(line.split())
        if not line:
            continue
        piece = "\n- " + line
        if len(piece) > budget:
            if budget > 20:
                parts.insert(1, piece[: budget - 3] + "...")
            break
        parts.insert(1, piece)
        budget -= len(piece)
    return "".join(parts)[:limit]


def filter_candidates(
    query: str,
    tools: Sequence[RegisteredTool],
    *,
    config: RouterConfig,
    core_tools: frozenset[str],
    ranker: Ranker | None = None,
) -> tuple[RegisteredTool, ...]:
    """Blacklist -> whitelist -> top-k -> yellowlist (top-1 fallback). Later stages never re-add tools."""
    if not config.filtering:
        return tuple(tools)
    stage = [t for t in tools if t.name not in config.blacklist]
    if config.whitelist:
        stage = [t for t in stage if t.name in config.whitelist]
    ranked = [tool for _, tool in (ranker or make_ranker(config.ranker)).rank(query, stage)][: config.top_k]
    yellow = config.yellowlist | (core_tools if config.yellowlist_core else frozenset())
    preferred = [t for t in ranked if t.name not in yellow]
    if preferred:
        return tuple(preferred)
    return tuple(ranked[:1])  # cache priority, not cache absolutism: a core tool beats no tool


class Router:
    def __init__(
        self, gateway: Gateway, model: ChatModel, *, core_tools: frozenset[str], config: RouterConfig | None = None
    ) -> None:
        self.gateway = gateway
        self.model = model
        self.core_tools = core_tools
        self.config = config or RouterConfig()
        self.ranker = make_ranker(self.config.ranker)  # built once: a missing extra fails here, not mid-task

    def route(self, task: str, *, hint: str = "", context: Sequence[str] = ()) -> RouterOutcome:
        if not self.config.enabled:
            return RouterOutcome(
                status="retry",
                tool=None,
                candidates=(),
                payload={"status": "retry", "reason": "the router is disabled in this deployment"},
            )
        summary = compress_task(task, context)
        registry = self.gateway.registry  # one snapshot for the whole call, even if a reload swaps it
        query = f"{task} {hint}".strip()
        candidates = filter_candidates(
            query, list(registry), config=self.config, core_tools=self.core_tools, ranker=self.ranker
        )
        names = tuple(t.name for t in candidates)
        if not candidates:
            return RouterOutcome(
                status="retry",
                tool=None,
                candidates=(),
                payload={
                    "status": "retry",
                    "reason": "no registered tool matches this task; "
                    "rephrase it with other keywords or solve it without tools",
                },
            )
        messages: tuple[Message, ...] = (
            {"role": "system", "content": ROUTER_SYSTEM},
            {"role": "user", "content": summary},
        )
        response = self.model.complete(
            ChatRequest(
                messages=messages,
                tools_json=render_tools([t.definition() for t in candidates]),
                tool_choice="auto",
                max_tokens=self.config.max_tokens,
                channel="router",
            )
        )
        chosen = next((call for call in response.tool_calls if call.name in names), None)
        if chosen is None:
            reason = response.content.strip() or "the router model called no suitable tool"
            return RouterOutcome(
                status="retry", tool=None, candidates=names, payload={"status": "retry", "reason": reason[:500]}
            )
        if chosen.raw_arguments:  # invalid JSON or not an object: running the tool with {} would be a guess
            reason = (
                f"the router model's arguments for {chosen.name} are not a JSON object "
                f"({chosen.raw_arguments[:200]}); the tool was not run: give the task's inputs explicitly"
            )
            return RouterOutcome(
                status="retry",
                tool=None,
                candidates=names,
                payload={"status": "retry", "tool": chosen.name, "reason": reason},
            )
        try:
            result = registry.tools[chosen.name]
            spec_result = self.gateway.call(result.name, chosen.arguments, timeout=self.config.tool_timeout)
        except CacheRouterError as e:
            return RouterOutcome(
                status="tool_error",
                tool=chosen.name,
                candidates=names,
                payload={"status": "error", "tool": chosen.name, "error": str(e)},
            )
        payload: dict[str, Any] = {"status": "ok" if spec_result.ok else "error", **spec_result.to_json()}
        return RouterOutcome(
            status="ok" if spec_result.ok else "tool_error", tool=chosen.name, candidates=names, payload=payload
        )


def router_arguments(arguments: dict[str, Any]) -> tuple[str, str]:
    """(task, hint) from an INTERNAL_ROUTER call, tolerating a model that sent a bare string."""
    task = arguments.get("task")
    if not isinstance(task, str) or not task.strip():
        task = json.dumps(arguments, ensure_ascii=False)
    hint = arguments.get("hint")
    return task, hint if isinstance(hint, str) else ""
