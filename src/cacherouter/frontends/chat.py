"""``cacherouter chat``: a terminal conversation with the CacheRouter agent over a tool repository.

With a real model, the main and router models are OpenAI-compatible endpoints configured by the
``CACHEROUTER_MAIN_*`` / ``CACHEROUTER_ROUTER_*`` environment variables (see
:class:`~cacherouter.models.endpoint.EndpointConfig`), and the cache figures printed after each turn are what the
provider reported in its usage fields.

With ``--scripted`` no network is used: a rule-based stand-in plays both models (it always routes the whole message
through ``INTERNAL_ROUTER``; the router picks the top candidate and fills its arguments from ``key=value`` words in
the message), and the cache figures come from the offline DeepSeek prefix-cache model. Everything it prints is
labelled SCRIPTED; it demonstrates the request architecture, not a model's intelligence.

Ctrl-C ends the chat with exit status 130 (the shell's convention for SIGINT), also in the middle of a turn: the
session file keeps every finished turn, plus -- if a model call was interrupted after tools had run -- that turn's
tool calls, marked aborted (see :meth:`Agent._abort`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..channels.agent import Agent, AgentConfig
from ..channels.conversation import ChatSession
from ..channels.mainview import MainView
from ..channels.router import Router, RouterConfig
from ..errors import CacheRouterError
from ..models.accounting import Ledger, RecordingModel, RequestRecord
from ..models.base import (
    ChatModel,
    ChatRequest,
    ChatResponse,
    ChatToolCall,
    ScriptedModel,
    SimulatedProvider,
)
from ..models.endpoint import MAIN_PREFIX, ROUTER_PREFIX, EndpointConfig, OpenAICompatibleModel
from ..models.prompt_cache import DeepSeekCacheModel
from ..prompts import DIRECT_ANSWER, NEED_TOOLS, ROUTER_TOOL
from ..tools.gateway import Gateway

COST_NOTE = (
    "(input cost is relative: 1.0 = one uncached input token at the provider's own cache discount; "
    "unknown where the provider or its prices are not known)"
)
SCRIPTED_LABEL = "SCRIPTED demo: rule-based stand-in models, offline DeepSeek cache model, no network"
# The longest message a user may send, in characters, in the terminal and in the web UI alike: far above any
# question, below what would swamp a model's context window.
MAX_MESSAGE_CHARS = 200_000
INTERRUPTED_EXIT = 130
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
    return ChatResponse(tool_calls=(ChatToolCall(id="call_0", name=ROUTER_TOOL, arguments={"task": text}),))


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
    return ChatResponse(tool_calls=(ChatToolCall(id="route_0", name=function["name"], arguments=arguments),))


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


def known_cost(records: Sequence[RequestRecord]) -> tuple[float | None, int]:
    """The summed relative input cost of the requests whose cost is known (None if there are none), and the number
    of requests whose cost is unknown -- to be shown next to the sum, so that it never passes for the whole."""
    costs = [record.cost for record in records if record.cost is not None]
    return (sum(costs) if costs else None), len(records) - len(costs)


def format_total_cost(records: Sequence[RequestRecord]) -> str:
    cost, unknown = known_cost(records)
    if cost is None or not unknown:
        return format_cost(cost)
    return f"{cost:.1f} (+{_requests(unknown)} of unknown cost)"


def message_too_long(message: str) -> str | None:
    """Why ``message`` is refused (over :data:`MAX_MESSAGE_CHARS`), or None."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return None
    return (
        f"the message has {len(message):,} characters; the limit is {MAX_MESSAGE_CHARS:,}: shorten it, or put the "
        "text in a file and ask for it to be read"
    )


def _requests(count: int) -> str:
    return f"{count} request" if count == 1 else f"{count} requests"


def _tokens(count: int | None) -> str:
    return "unknown" if count is None else str(count)


def run_chat(
    setup: ChatSetup, session: ChatSession, lines: Iterable[str], out: TextIO, *, prompt: str = "you> "
) -> int:
    """Answer each line until end of input or ``/quit``; print per-request cache figures after each turn.

    Returns the exit status: 0, or 130 after Ctrl-C (which ends the chat, during a turn too; see the module doc).
    """
    label = "SCRIPTED" if setup.scripted else "provider-reported"
    print(
        SCRIPTED_LABEL if setup.scripted else "Live models (OpenAI-compatible endpoints from CACHEROUTER_*).", file=out
    )
    print(f"session {session.id}; main view: {', '.join(session.view.core_tools)} + {ROUTER_TOOL}", file=out)
    print(prompt, end="", file=out, flush=True)
    status = 0
    turns = len(session.turns)
    try:
        for line in lines:
            query = line.strip()
            if query in _QUIT:
                break
            if query:
                turns = len(session.turns)
                _turn(setup, session, query, out, label)
                turns = len(session.turns)
            print(prompt, end="", file=out, flush=True)
    except KeyboardInterrupt:
        print(f"\n{_interrupted(setup, session, turns)}", file=out)
        status = INTERRUPTED_EXIT
    summary = setup.ledger.summary()
    rate = "n/a" if summary.hit_rate is None else f"{summary.hit_rate * 100:.2f}%"
    if summary.unknown_requests:
        rate += f" ({_requests(summary.unknown_requests)} without cache figures left out)"
    print(
        f"\n{label} totals: {_requests(summary.requests)}, token-level cache hit rate {rate}, "
        f"input cost {format_total_cost(setup.ledger.records)}",
        file=out,
    )
    print(COST_NOTE, file=out)
    return status


def _turn(setup: ChatSetup, session: ChatSession, query: str, out: TextIO, label: str) -> None:
    refused = message_too_long(query)
    if refused is not None:
        print(f"error: {refused}", file=out)
        return
    seen = len(setup.ledger.records)
    try:
        answer = setup.agent.ask(session, query)
    except CacheRouterError as e:
        print(f"error: {e}", file=out)
        return
    routed = [c.routed_to for c in answer.calls if c.routed_to]
    print(f"agent> {answer.text}", file=out)
    print(f"  [{answer.path}; router -> {', '.join(routed) or 'none'}]", file=out)
    for record in setup.ledger.records[seen:]:
        usage = record.usage
        print(
            f"  {label} {record.channel:<8} prompt {_tokens(usage.prompt_tokens)} tok, "
            f"cache hit {_tokens(usage.cached_tokens)} tok, input cost {format_cost(record.cost)}",
            file=out,
        )


def _interrupted(setup: ChatSetup, session: ChatSession, turns_before: int) -> str:
    """What Ctrl-C left behind, in one line."""
    if setup.agent.config.sessions_dir is None:
        return "interrupted; this session is not saved (no --sessions-dir)"
    if len(session.turns) > turns_before and session.turns[-1].get("path") == "aborted":
        return "interrupted; the session is saved with this turn's tool calls, marked aborted"
    return "interrupted; the session is saved as of the last finished turn"
