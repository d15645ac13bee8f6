"""``cacherouter eval --via-proxy``: the scripted workloads driven through ``cacherouter proxy``.

Three real HTTP hops on 127.0.0.1, as a user would deploy it:

* **the agent** -- a plain loop that speaks only the chat-completions API (httpx): every request carries the
  *whole* registry as ``tools`` (re-listed after each reload, as an unmodified agent would), it runs the tool
  calls it gets back through the gateway, and it sees the same repository events as the library path;
* **the proxy** -- :class:`cacherouter.proxy.Proxy` with the core packages' tools as ``--core`` and a router model
  (``scripted-router``) on the same upstream;
* **a local provider server** -- a STAND-IN for the LLM provider: the scripted main and router models of
  :mod:`.runner` behind ``POST /v1/chat/completions``, with the offline DeepSeek cache model filling in ``usage``
  from the request bytes it receives. The same kind of stand-in as the library path's, so the figures compare.

The input cost is what the proxy's ``/stats`` books from those usage fields. What differs from the library path
by design: no triage requests (the agent has no such phase) and one history stream; per-query router settings
(``router="off"``/``"nofilter"``) do not apply, since the proxy's router is fixed at start-up.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..canonical import canonical_json
from ..errors import CacheRouterError, ConfigError
from ..models.base import ChatModel, ChatRequest, Message, ScriptedModel, SimulatedProvider
from ..models.prompt_cache import DeepSeekCacheModel
from ..models.tokens import Tokenizer, default_tokenizer
from ..prompts import MAIN_SYSTEM, ROUTER_SYSTEM
from .runner import EVAL_REPO, EvalGateway, MainBrain, RouterBrain
from .suite import CORE_PACKAGES, Query


@dataclass(frozen=True, kw_only=True)
class ProxyRun:
    workload: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float | None
    input_cost: float | None
    routed_calls: int
    provider_tool_segments: int  # distinct tool segments the provider received in main requests


def provider_app(main: ChatModel, router: ChatModel, segments: set[str]) -> Any:
    """The stand-in provider: chat completions from the scripted models, usage from the offline cache model."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def complete(request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        messages = tuple(body["messages"])
        is_router = bool(messages) and messages[0].get("content") == ROUTER_SYSTEM
        tools_json = canonical_json(body["tools"]) if body.get("tools") else ""
        if not is_router:
            segments.add(tools_json)
        chat = ChatRequest(
            messages=messages,
            tools_json=tools_json,
            tool_choice=body.get("tool_choice"),
            channel="router" if is_router else "main",
        )
        response = (router if is_router else main).complete(chat)
        message = response.assistant_message()
        completion = {
            "id": "scripted",
            "object": "chat.completion",
            "model": body.get("model", ""),
            "choices": [
                {"index": 0, "message": message, "finish_reason": "tool_calls" if response.tool_calls else "stop"}
            ],
            "usage": dict(response.usage),
        }
        return JSONResponse(completion)

    return Starlette(routes=[Route("/v1/chat/completions", complete, methods=["POST"])])


class _Agent:
    """An unmodified agent loop on the chat-completions API: all tools, every request; it runs its own calls."""

    def __init__(self, base_url: str, gateway: Any, *, max_rounds: int = 14) -> None:
        import httpx

        self.client = httpx.Client(base_url=base_url, timeout=120)
        self.gateway = gateway
        self.history: list[Message] = []
        self.max_rounds = max_rounds

    def ask(self, text: str) -> None:
        new: list[Message] = [{"role": "user", "content": text}]
        for _ in range(self.max_rounds):
            self.gateway().poll()  # the background poller, at a deterministic point (as the library path does)
            tools = [spec.definition() for spec in self.gateway().registry]
            body = {
                "model": "scripted-main",
                "messages": [{"role": "system", "content": MAIN_SYSTEM}, *self.history, *new],
                "tools": tools,
                "tool_choice": "auto",
            }
            reply = self.client.post("/v1/chat/completions", json=body)
            if reply.status_code != 200:
                raise CacheRouterError(f"the proxy answered HTTP {reply.status_code}: {reply.text[:300]}")
            message = reply.json()["choices"][0]["message"]
            new.append(message)
            if not message.get("tool_calls"):
                break
            for call in message["tool_calls"]:
                function = call["function"]
                try:
                    result = self.gateway().call(function["name"], json.loads(function["arguments"] or "{}"))
                    content = canonical_json(result.to_json())
                except CacheRouterError as e:
                    content = canonical_json({"status": "error", "error": str(e)})
                new.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        self.history.extend(new)

    def close(self) -> None:
        self.client.close()


def run_via_proxy(
    workload: str,
    queries: Sequence[Query],
    *,
    tokenizer: Tokenizer | None = None,
    repo: Path = EVAL_REPO,
    mcp_servers: bool = False,
) -> ProxyRun:
    """Run ``queries`` through a real proxy in front of the stand-in provider, on a fresh copy of ``repo``."""
    try:
        import httpx

        from tvcache.server.runner import AppThread

        from ..proxy import Proxy, ProxyConfig, create_app
    except ImportError as e:
        raise ConfigError("eval --via-proxy needs the proxy extra: pip install 'tvcache[proxy]'") from e
    tokenizer = tokenizer or default_tokenizer()
    with tempfile.TemporaryDirectory(prefix="cacherouter-eval-proxy-") as tmp:
        workload_gateway = EvalGateway(Path(tmp), repo, mcp_servers=mcp_servers)
        gateway = workload_gateway.current

        cache = DeepSeekCacheModel()  # one account: main and router requests share the provider's cache
        main = SimulatedProvider(ScriptedModel(MainBrain(queries, via_router=True)), cache, tokenizer=tokenizer)
        router = SimulatedProvider(ScriptedModel(RouterBrain(queries)), cache, tokenizer=tokenizer)
        segments: set[str] = set()
        core = tuple(spec.name for spec in gateway().registry.in_packages(CORE_PACKAGES))
        with AppThread(provider_app(main, router, segments)) as provider:
            proxy = Proxy(
                ProxyConfig(
                    upstream=provider.url + "/v1", core=core, router_model="scripted-router", provider="deepseek"
                )
            )
            with AppThread(create_app(proxy)) as served:
                agent = _Agent(served.url, gateway)
                try:
                    for query in queries:
                        for event in query.events:
                            workload_gateway.handle(event)
                        agent.ask(query.text)
                finally:
                    agent.close()
                total = httpx.get(served.url + "/stats", timeout=30).json()["total"]
        gateway().close()
    return ProxyRun(
        workload=workload,
        requests=total["requests"],
        prompt_tokens=total["prompt_tokens"],
        cached_tokens=total["cached_tokens"],
        hit_rate=total["hit_rate"],
        input_cost=total["input_cost"],
        routed_calls=total["routed_calls"],
        provider_tool_segments=len(segments),
    )


def run_all_via_proxy(workloads: Sequence[str], *, tokenizer: Tokenizer | None = None) -> list[ProxyRun]:
    """:func:`run_via_proxy` for each workload, on the repositories :func:`.runner.run_all` uses."""
    from .longtail import generate_repository
    from .runner import _ON_LONGTAIL_REPOSITORY, _WITH_MCP_SERVERS, WORKLOADS

    runs = []
    with tempfile.TemporaryDirectory(prefix="cacherouter-longtail-") as tmp:
        for workload in workloads:
            repo = EVAL_REPO
            if workload in _ON_LONGTAIL_REPOSITORY:
                repo = Path(tmp) / "repo"
                if not repo.exists():
                    generate_repository(EVAL_REPO, repo)
            runs.append(
                run_via_proxy(
                    workload,
                    WORKLOADS[workload],
                    tokenizer=tokenizer,
                    repo=repo,
                    mcp_servers=workload in _WITH_MCP_SERVERS,
                )
            )
    return runs
