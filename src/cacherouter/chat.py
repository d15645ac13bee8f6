"""``cacherouter chat``: a terminal conversation with the CacheRouter agent over a tool repository.

With a real model, the main and router models are OpenAI-compatible endpoints configured by the
``CACHEROUTER_MAIN_*`` / ``CACHEROUTER_ROUTER_*`` environment variables (see
:class:`~cacherouter.models.EndpointConfig`), and the cache figures printed after each turn are what the provider
reported in its usage fields.

With ``--scripted`` no network is used: a rule-based stand-in plays both models (it always routes the whole message
through ``INTERNAL_ROUTER``; the router picks the top candidate and fills its arguments from ``key=value`` words in
the message), and the cache figures come from the offline DeepSeek prefix-cache model. Everything it prints is
labelled SCRIPTED; it demonstrates the request architecture, not a model's intelligence.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .accounting import Ledger, RecordingModel
from .agent import Agent, AgentConfig
from .cachemodel import DeepSeekCacheModel
from .errors import CacheRouterError
from .gateway import Gateway
from .mainview import MainView
from .models import (
    MAIN_PREFIX,
    ROUTER_PREFIX,
    ChatModel,
    ChatRequest,
    ChatResponse,
    EndpointConfig,
    OpenAICompatibleModel,
    ScriptedModel,
    SimulatedProvider,
    ToolCall,
)
from .prompts import DIRECT_ANSWER, NEED_TOOLS, ROUTER_TOOL
from .router import Router, RouterConfig
from .session import Session

COST_NOTE = (
    "(input cost is relative: 1.0 = one uncached input token at the provider's own cache discount; "
    "unknown where the provider or its prices are not known)"
)
SCRIPTED_LABEL = "SCRIPTED demo: rule-based stand-in models, offline DeepSeek cache model, no network"
_PAIR = re.compile(r"(\w+)=(\"[^\"]*\"|\S+)")
_QUIT = {"/quit", "/exit", ":q"}


@dataclass(frozen=True, kw_only=True)
class ChatSetup:
    agent: Agent
    ledger: Ledger
    scripted: bool


def _latest_user_text(request: ChatRequest) -> str:
    for message in reversed(request.messages):
        if message.get("role") == "user":
            return str(message.get("content", ""))
    return ""


def scripted_main(request: ChatRequest) -> ChatResponse:
    """Stand-in main model: route every message once, then report the last tool result verbatim."""
    text = _latest_user_text(request)
    if request.channel == "triage":
        if text.rstrip().endswith("?") and "=" not in text:
            return ChatResponse(
                content=f"(scripted) I only answer by running tools; try 'weather city=Beijing'. {DIRECT_ANSWER}"
            )
        return ChatResponse(content=f"(scripted) this needs a tool. {NEED_TOOLS}")
    last = request.messages[-1]
    if last.get("role") == "tool":
        return ChatResponse(content=f"(scripted) the tool answered: {last.get('content', '')}")
    if request.channel == "fallback":
        return ChatResponse(content="(scripted) I could not get a tool result for this.")
    return ChatResponse(tool_calls=(ToolCall(id="call_0", name=ROUTER_TOOL, arguments={"task": text}),))


def _coerce(value: str, schema: dict[str, Any]) -> Any:
    value = value.strip('"')
    kind = schema.get("type")
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            return float(value)
    except ValueError:
        return value
    if kind == "boolean":
        return value.lower() in ("1", "true", "yes")
    if kind == "array":
        return value.split(",")
    return value


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def scripted_router(request: ChatRequest) -> ChatResponse:
    """Stand-in router model: call the candidate sharing most words with the task, with its ``key=value`` words.

    The candidates arrive in canonical (name) order, not ranked, so the stand-in does its own crude matching.
    """
    tools = json.loads(request.tools_json or "[]")
    if not tools:
        return ChatResponse(content="(scripted) no candidate tools.")
    task = str(request.messages[-1].get("content", ""))
    wanted = _words(_PAIR.sub(" ", task))
    function = max(
        (t["function"] for t in tools),
        key=lambda f: len(wanted & _words(f"{f['name'].replace('_', ' ')} {f.get('description', '')}")),
    )
    properties: dict[str, Any] = function["parameters"].get("properties", {})
    arguments = {key: _coerce(value, properties[key]) for key, value in _PAIR.findall(task) if key in properties}
    return ChatResponse(tool_calls=(ToolCall(id="route_0", name=function["name"], arguments=arguments),))


def build_chat(
    gateway: Gateway,
    *,
    view: MainView,
    scripted: bool,
    sessions_dir: Path | None,
    router_config: RouterConfig | None = None,
) -> ChatSetup:
    """The agent for one conversation over ``view``: pass the new session's view, or a resumed session's own.

    The router's yellowlist holds ``view``'s core tools, so a resumed session routes as it did when it began.
    ``router_config.tool_timeout`` bounds every tool run, core or routed.
    """
    router_config = router_config or RouterConfig()
    ledger = Ledger()
    main: ChatModel
    router_model: ChatModel
    if scripted:
        cache = DeepSeekCacheModel()
        main = RecordingModel(
            SimulatedProvider(ScriptedModel(scripted_main, name="scripted-main"), cache), ledger, provider="deepseek"
        )
        router_model = RecordingModel(
            SimulatedProvider(ScriptedModel(scripted_router, name="scripted-router"), cache),
            ledger,
            provider="deepseek",
        )
    else:
        main_endpoint = EndpointConfig.from_env(MAIN_PREFIX)
        router_endpoint = EndpointConfig.from_env(ROUTER_PREFIX)
        main = RecordingModel(OpenAICompatibleModel(main_endpoint), ledger, provider=main_endpoint.provider)
        router_model = RecordingModel(OpenAICompatibleModel(router_endpoint), ledger, provider=router_endpoint.provider)
    router = Router(gateway, router_model, core_tools=frozenset(view.core_tools), config=router_config)
    config = AgentConfig(sessions_dir=sessions_dir, tool_timeout=router_config.tool_timeout)
    agent = Agent(gateway=gateway, main_model=main, router=router, config=config)
    return ChatSetup(agent=agent, ledger=ledger, scripted=scripted)


def format_cost(cost: float | None) -> str:
    """A relative input cost as shown to users: uncached-token units, or "unknown" (never a guess)."""
    return "unknown" if cost is None else f"{cost:.1f}"


def run_chat(setup: ChatSetup, session: Session, lines: Iterable[str], out: TextIO, *, prompt: str = "you> ") -> int:
    """Answer each line until end of input or ``/quit``; print per-request cache figures after each turn."""
    label = "SCRIPTED" if setup.scripted else "provider-reported"
    print(
        SCRIPTED_LABEL if setup.scripted else "Live models (OpenAI-compatible endpoints from CACHEROUTER_*).", file=out
    )
    print(f"session {session.id}; main view: {', '.join(session.view.core_tools)} + {ROUTER_TOOL}", file=out)
    print(prompt, end="", file=out, flush=True)
    for line in lines:
        query = line.strip()
        if query in _QUIT:
            break
        if query:
            seen = len(setup.ledger.records)
            try:
                answer = setup.agent.ask(session, query)
            except CacheRouterError as e:
                print(f"error: {e}", file=out)
            else:
                routed = [c.routed_to for c in answer.calls if c.routed_to]
                print(f"agent> {answer.text}", file=out)
                print(f"  [{answer.path}; router -> {', '.join(routed) or 'none'}]", file=out)
                for record in setup.ledger.records[seen:]:
                    usage = record.usage
                    cached = "unknown" if usage.cached_tokens is None else str(usage.cached_tokens)
                    print(
                        f"  {label} {record.channel:<8} prompt {usage.prompt_tokens} tok, cache hit {cached} tok, "
                        f"input cost {format_cost(record.cost)}",
                        file=out,
                    )
        print(prompt, end="", file=out, flush=True)
    summary = setup.ledger.summary()
    rate = "n/a" if summary.hit_rate is None else f"{summary.hit_rate * 100:.2f}%"
    print(
        f"\n{label} totals: {summary.requests} requests, token-level cache hit rate {rate}, "
        f"input cost {format_cost(summary.cost)}",
        file=out,
    )
    print(COST_NOTE, file=out)
    return 0
