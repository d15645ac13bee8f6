"""Run the scripted workloads under three request architectures and account them under DeepSeek's cache rules.

* ``cacherouter`` — fixed main view (core packages + INTERNAL_ROUTER + placeholder), triage, router channel.
* ``all-tools`` — every registered tool in every request (re-listed after each reload, as a live gateway would).
* ``dynamic`` — per-query disclosure: the BM25 top-5 for the query plus the tools the plan needs (an oracle
  retriever, which favours this baseline), re-chosen for every query.

All three run the same plans, execute the same real tool scripts on a private copy of the repository, and see the
same repository events (gateway restarts, a new tool, an edited tool, a broken tool, bootstrapped skills).
The models are scripted; only the request bytes and the cache model are real.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..canonical import canonical_json, render_tools
from ..channels.agent import Agent, AgentConfig
from ..channels.conversation import ChatSession
from ..channels.mainview import MainView
from ..channels.relevance import BM25
from ..channels.router import Router, RouterConfig
from ..errors import CacheRouterError
from ..models.accounting import Ledger, RecordingModel, Summary
from ..models.base import ChatModel, ChatRequest, ChatResponse, ChatToolCall, Message, ScriptedModel, SimulatedProvider
from ..models.prompt_cache import DeepSeekCacheModel
from ..models.tokens import Tokenizer, default_tokenizer
from ..prompts import DIRECT_ANSWER, MAIN_SYSTEM, NEED_TOOLS, ROUTER_TOOL, UNCERTAIN
from ..tools.gateway import Gateway, GatewayConfig
from ..tools.upstreams import UpstreamConfig
from .longtail import LONGTAIL, generate_repository
from .mcp_workload import INITIAL as MCP_INITIAL
from .mcp_workload import MCP_QUERIES, prepare_workspace, upstream_configs
from .suite import CORE_PACKAGES, DIALOGUE, SUITE, Query

ARCHITECTURES = ("cacherouter", "all-tools", "dynamic")
EVAL_REPO = Path(__file__).resolve().parent.parent / "evaldata" / "repo"
_NOTES = ("[RE-PLAN]", "[FINAL]")


def _current_query(messages: Sequence[Message]) -> tuple[str, int]:
    """The user query being worked on, and how many assistant turns followed it."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        content = str(message.get("content", ""))
        if message.get("role") == "user" and not content.startswith(_NOTES):
            rounds = sum(1 for m in messages[index + 1 :] if m.get("role") == "assistant")
            return content, rounds
    return "", 0


class MainBrain:
    """The scripted main model: follows each query's plan."""

    def __init__(self, queries: Sequence[Query], *, via_router: bool) -> None:
        self.plans = {q.text: q for q in queries}
        self.via_router = via_router

    def __call__(self, request: ChatRequest) -> ChatResponse:
        text, done = _current_query(request.messages)
        plan = self.plans[text]
        if request.channel == "triage":
            if plan.direct:
                return ChatResponse(content=f"{plan.direct} {DIRECT_ANSWER}")
            return ChatResponse(content=f"Sub-tasks: gather the data, then answer. External calls needed. {NEED_TOOLS}")
        if request.channel == "fallback":
            return ChatResponse(content=f"{UNCERTAIN} {plan.final}")
        if plan.direct:
            return ChatResponse(content=plan.direct)
        if done >= len(plan.rounds):
            return ChatResponse(content=plan.final)
        calls = []
        for i, action in enumerate(plan.rounds[done]):
            call_id = f"call_{plan.id}_{done}_{i}"
            if action.routed and self.via_router:
                calls.append(ChatToolCall(id=call_id, name=ROUTER_TOOL, arguments={"task": action.task}))
            else:
                calls.append(ChatToolCall(id=call_id, name=action.tool, arguments=dict(action.arguments)))
        return ChatResponse(tool_calls=tuple(calls))


class RouterBrain:
    """The scripted router sub-model: calls the planned tool if the filter left it among the candidates."""

    def __init__(self, queries: Sequence[Query]) -> None:
        self.routes = {a.task: a for q in queries for r in q.rounds for a in r if a.routed}

    def __call__(self, request: ChatRequest) -> ChatResponse:
        summary = str(request.messages[-1]["content"])
        action = self.routes.get(summary.split("\n", 1)[0])
        names = {d["function"]["name"] for d in json.loads(request.tools_json or "[]")}
        if action is None or action.tool not in names:
            return ChatResponse(content="No listed tool can do this task.")
        return ChatResponse(
            tool_calls=(ChatToolCall(id="route_0", name=action.tool, arguments=dict(action.arguments)),)
        )


class _Polling:
    """Polls the gateway before each request, standing in for the background poller at a deterministic point."""

    def __init__(self, inner: ChatModel, gateway: Callable[[], Gateway]) -> None:
        self.inner, self.gateway, self.name = inner, gateway, inner.name

    def complete(self, request: ChatRequest) -> ChatResponse:
        self.gateway().poll()
        return self.inner.complete(request)


_NEW_TOOL = '''"""Convert Celsius to Fahrenheit."""
import argparse
parser = argparse.ArgumentParser(description="Convert a Celsius temperature to Fahrenheit.")
parser.add_argument("--celsius", type=float, required=True, help="temperature in Celsius")
args = parser.parse_args()
print(round(args.celsius * 9 / 5 + 32, 1))
'''


def apply_event(event: str, root: Path) -> None:
    """Change the repository the way the long-chain experiment does."""
    if event == "add_tool":
        (root / "other" / "convert").mkdir(parents=True, exist_ok=True)
        (root / "other" / "convert" / "SKILL.md").write_text("---\nname: convert\ndescription: Unit conversion.\n---\n")
        (root / "other" / "convert" / "unit_convert.py").write_text(_NEW_TOOL)
    elif event == "edit_tool":
        path = root / "computer-program" / "files" / "write_file.py"
        path.write_text(path.read_text().replace("with the given content.", "with the given content (UTF-8)."))
    elif event == "break_tool":
        (root / "other" / "broken").mkdir(parents=True, exist_ok=True)
        (root / "other" / "broken" / "broken_tool.py").write_text("import argparse\nparser = (\n")


@dataclass
class _Baseline:
    """A conventional agent loop: one request per round, tools chosen by ``tools_for``."""

    gateway: Callable[[], Gateway]
    model: ChatModel
    tools_for: Callable[[Query], str]
    history: list[Message] = field(default_factory=list)
    max_rounds: int = 14

    def ask(self, query: Query) -> None:
        system: Message = {"role": "system", "content": MAIN_SYSTEM}
        new: list[Message] = [{"role": "user", "content": query.text}]
        for _ in range(self.max_rounds):
            reply = self.model.complete(
                ChatRequest(
                    messages=(system, *self.history, *new), tools_json=self.tools_for(query), tool_choice="auto"
                )
            )
            new.append(reply.assistant_message())
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                try:
                    content = canonical_json(self.gateway().call(call.name, call.arguments).to_json())
                except CacheRouterError as e:
                    content = canonical_json({"status": "error", "error": str(e)})
                new.append({"role": "tool", "tool_call_id": call.id, "content": content})
        self.history.extend(new)


@dataclass(frozen=True, kw_only=True)
class RunResult:
    architecture: str
    workload: str
    summary: Summary
    by_channel: dict[str, Summary]
    main_tool_segments: int  # distinct tool segments among main-model requests
    paths: dict[str, int]
    router_calls: int
    problems: tuple[str, ...]
    misses: dict[str, int]  # miss tokens: the cold first request, then the rest by channel


def _miss_breakdown(ledger: Ledger) -> dict[str, int]:
    """Where the miss tokens go: the first request (a cold cache: the whole head) apart, the rest by channel.
    Requests whose provider did not report cached tokens are left out, as in the hit rate."""
    out: dict[str, int] = {}
    for index, record in enumerate(ledger.records):
        usage = record.usage
        if usage.prompt_tokens is None or usage.cached_tokens is None:
            continue
        key = "first request" if index == 0 else record.channel
        out[key] = out.get(key, 0) + usage.prompt_tokens - usage.cached_tokens
    return out


class EvalGateway:
    """The gateway a workload runs against: over a fresh copy of ``repo`` under ``tmp`` (and, with
    ``mcp_servers``, the real MCP servers of :mod:`.mcp_workload` in a fresh workspace, the initial ones joined).
    A query's events change it: ``restart`` builds a new gateway, ``join:``/``leave:`` change its MCP upstreams,
    anything else edits the repository (``apply_event``)."""

    def __init__(self, tmp: Path, repo: Path, *, mcp_servers: bool) -> None:
        self.root = tmp / "repo"
        shutil.copytree(repo, self.root, ignore=shutil.ignore_patterns("__pycache__"))
        self.workspace = tmp / "workspace"
        self.active: set[str] = set()
        if mcp_servers:
            prepare_workspace(self.workspace)
            self.active = set(MCP_INITIAL)
        self.config = GatewayConfig(root=self.root, tool_timeout=30.0, upstreams=self._upstreams())
        self.gateway = Gateway(self.config)

    def _upstreams(self) -> tuple[UpstreamConfig, ...]:
        return upstream_configs(self.workspace, tuple(self.active)) if self.active else ()

    def current(self) -> Gateway:
        """The gateway now (a ``restart`` replaces it)."""
        return self.gateway

    def handle(self, event: str) -> None:
        kind, _, server = event.partition(":")
        if event == "restart":
            self.gateway.close()
            self.gateway = Gateway(replace(self.config, upstreams=self._upstreams()))
        elif kind in ("join", "leave"):
            (self.active.add if kind == "join" else self.active.discard)(server)
            self.gateway.set_upstreams(upstream_configs(self.workspace, tuple(self.active)))
        else:
            apply_event(event, self.root)


def run_workload(
    architecture: str,
    workload: str,
    queries: Sequence[Query],
    *,
    tokenizer: Tokenizer | None = None,
    repo: Path = EVAL_REPO,
    mcp_servers: bool = False,
) -> RunResult:
    """Run ``queries`` under ``architecture`` on a fresh copy of ``repo`` and a fresh DeepSeek cache model.

    With ``mcp_servers``, the real MCP servers of :mod:`.mcp_workload` join the registry (the initial ones at the
    start, the others as the queries' ``join:``/``leave:`` events say), working in a fresh workspace.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; choose from {ARCHITECTURES}")
    tokenizer = tokenizer or default_tokenizer()
    with tempfile.TemporaryDirectory(prefix="cacherouter-eval-") as tmp:
        workload_gateway = EvalGateway(Path(tmp), repo, mcp_servers=mcp_servers)
        gateway, handle = workload_gateway.current, workload_gateway.handle

        ledger = Ledger()
        cache = DeepSeekCacheModel()  # one account: main and router requests share the provider's cache
        via_router = architecture == "cacherouter"
        main = RecordingModel(
            SimulatedProvider(
                _Polling(ScriptedModel(MainBrain(queries, via_router=via_router), name="scripted-main"), gateway),
                cache,
                tokenizer=tokenizer,
            ),
            ledger,
            provider="deepseek",
        )
        paths: dict[str, int] = {}
        router_calls = 0
        if via_router:
            router_model = RecordingModel(
                SimulatedProvider(
                    ScriptedModel(RouterBrain(queries), name="scripted-router"), cache, tokenizer=tokenizer
                ),
                ledger,
                provider="deepseek",
            )
            view = MainView.from_registry(gateway().registry, CORE_PACKAGES)
            session = ChatSession(view=view)
            for query in queries:
                for event in query.events:
                    handle(event)
                router_config = RouterConfig(enabled=query.router != "off", filtering=query.router != "nofilter")
                router = Router(gateway(), router_model, core_tools=frozenset(view.core_tools), config=router_config)
                agent = Agent(gateway=gateway(), main_model=main, router=router, config=AgentConfig(tool_timeout=30.0))
                answer = agent.ask(session, query.text)
                paths[answer.path] = paths.get(answer.path, 0) + 1
                router_calls += answer.router_calls
        else:
            ranker = BM25()

            def tools_for(query: Query) -> str:
                registry = gateway().registry
                if architecture == "all-tools":
                    return render_tools([spec.definition() for spec in registry])
                needed = {a.tool for r in query.rounds for a in r}
                top = {tool.name for _, tool in ranker.rank(query.text, list(registry))[:5]}
                return render_tools([spec.definition() for spec in registry if spec.name in needed | top])

            baseline = _Baseline(gateway=gateway, model=main, tools_for=tools_for)
            for query in queries:
                for event in query.events:
                    handle(event)
                baseline.ask(query)
        problems = tuple(p.path for p in gateway().registry.problems)
        gateway().close()
    main_segments = {r.tools_digest for r in ledger.records if r.channel in ("triage", "main", "fallback")}
    channels = sorted({r.channel for r in ledger.records})
    return RunResult(
        architecture=architecture,
        workload=workload,
        summary=ledger.summary(),
        by_channel={c: ledger.summary((c,)) for c in channels},
        main_tool_segments=len(main_segments),
        paths=paths,
        router_calls=router_calls,
        problems=problems,
        misses=_miss_breakdown(ledger),
    )


WORKLOADS: dict[str, tuple[Query, ...]] = {
    "suite": SUITE,
    "dialogue": DIALOGUE,
    "longtail": LONGTAIL,
    # The same 30 turns over the 211-tool registry: what the dialogue costs when the tool list is large.
    "dialogue-211": DIALOGUE,
    # The evaluation repository plus the tools of five real MCP servers, joining and leaving mid-run.
    "mcp": MCP_QUERIES,
}
_ON_LONGTAIL_REPOSITORY = frozenset({"longtail", "dialogue-211"})
_WITH_MCP_SERVERS = frozenset({"mcp"})


def run_all(
    *,
    architectures: Sequence[str] = ARCHITECTURES,
    workloads: Sequence[str] = tuple(WORKLOADS),
    tokenizer: Tokenizer | None = None,
) -> list[RunResult]:
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="cacherouter-longtail-") as tmp:
        for workload in workloads:
            repo = EVAL_REPO
            if workload in _ON_LONGTAIL_REPOSITORY:  # the base repository plus 200 generated tools in 25 packages
                repo = Path(tmp) / "repo"
                if not repo.exists():
                    generate_repository(EVAL_REPO, repo)
            mcp_servers = workload in _WITH_MCP_SERVERS
            results += [
                run_workload(a, workload, WORKLOADS[workload], tokenizer=tokenizer, repo=repo, mcp_servers=mcp_servers)
                for a in architectures
            ]
    return results


def results_json(results: Sequence[RunResult], tokenizer_name: str, *, ranker: str) -> dict[str, Any]:
    def summary(s: Summary) -> dict[str, Any]:
        return {
            "requests": s.requests,
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "hit_rate": s.hit_rate,
            "cost_ratio": s.cost_ratio,
            "cost_miss_token_equivalents": (s.prompt_tokens - s.cached_tokens) + s.cached_tokens / 30,
        }

    return {
        "models": "scripted (no LLM API reachable); cache: offline DeepSeek prefix-cache model, hit price 1/30",
        "tokenizer": tokenizer_name,
        "router_relevance": ranker,
        "runs": [
            {
                "architecture": r.architecture,
                "workload": r.workload,
                **summary(r.summary),
                "by_channel": {c: summary(s) for c, s in r.by_channel.items()},
                "main_tool_segments": r.main_tool_segments,
                "paths": r.paths,
                "router_calls": r.router_calls,
                "registry_problems": list(r.problems),
                "miss_tokens_by_source": r.misses,
            }
            for r in results
        ],
    }
