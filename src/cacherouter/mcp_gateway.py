"""The cache-preserving MCP gateway: ``cacherouter serve-mcp --upstreams CONFIG``.

An MCP client pointed at this server sees a tool list that never changes while the server runs: the core tools
chosen at start-up (``--core NAME...``, their definitions frozen as they were then) and ``INTERNAL_ROUTER``.
Every other tool of the upstream MCP servers (and of ``--repo``, if given) is reached through
``INTERNAL_ROUTER``, however many come and go: the client's tool segment -- and its provider's prompt cache --
stays byte for byte the same. The server never announces a list change (its ``tools`` capability says
``listChanged: false``).

``INTERNAL_ROUTER`` works in one of two modes, fixed at start-up and named in its description:

* **router model** (``CACHEROUTER_ROUTER_BASE_URL`` and the other ``CACHEROUTER_ROUTER_*`` settings are set):
  ``{"task", "hint"}``; the router filters the registry, asks its sub-model to pick and fill one tool, runs it
  and returns that tool's result;
* **deterministic retrieval** (no router model configured): ``{"task", "hint"}`` returns the top-k matching
  tools with their input schemas, as text; ``{"tool", "arguments"}`` runs one of them. No model is involved: the
  client's own model fills the arguments.

An upstream tool's result comes back as the server sent it: ``content``, ``structuredContent`` and ``isError``
unchanged, and ``_meta`` with one more key, ``io.github.cacherouter/route`` (which tool ran). Errors that leave no
result (an upstream down, timed out or crashed; unknown tools; arguments that do not fit) are ``isError``
results with one text block saying what went wrong.
"""

from __future__ import annotations

import contextvars
import functools
import os
from typing import Any

from .canonical import canonical_json
from .errors import ArgumentError, CacheRouterError, ConfigError
from .executor import Cancellation, ScriptResult, kill_running
from .gateway import Gateway
from .mcp_server import _exit_on_signals
from .mcp_upstream import UpstreamResult
from .models import ChatModel
from .prompts import ROUTER_TOOL, router_tool_definition
from .registry import RegisteredTool
from .relevance import make_ranker
from .router import Router, RouterConfig, filter_candidates

try:
    import anyio
    import mcp.types as types
    from mcp import MCPError
    from mcp.server import NotificationOptions, Server
    from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
    from mcp.server.stdio import stdio_server
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ConfigError("serving over MCP needs the 'mcp' SDK: pip install 'tvcache[mcp]' (mcp>=2.3,<3)") from e

__all__ = ["DETERMINISTIC_LABEL", "RoutingMCPServer", "serve_gateway_stdio"]

SERVER_NAME = "cacherouter-mcp-gateway"
ROUTE_META = "io.github.cacherouter/route"
DETERMINISTIC_LABEL = "deterministic retrieval (no router model configured)"
# The raw result of the call being answered, for the middleware that puts it on the wire unchanged.
_RAW: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("cacherouter_raw_result", default=None)


def retrieval_tool_definition() -> dict[str, Any]:
    """INTERNAL_ROUTER when no router model is configured: find tools, then run one."""
    return {
        "type": "function",
        "function": {
            "name": ROUTER_TOOL,
            "description": (
                f"Reach every tool not listed here, by {DETERMINISTIC_LABEL}. Call it with `task` (and an optional "
                "`hint`) to get the best-matching tools and their input schemas; then call it with `tool` (one of "
                "those names) and `arguments` (an object fitting that tool's schema) to run it and get its result."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "task": {"type": "string", "description": "What to do, with all concrete inputs."},
                    "hint": {"type": "string", "description": "Optional keywords or a tool name, if known."},
                    "tool": {"type": "string", "description": "The tool to run, from an earlier answer."},
                    "arguments": {"type": "object", "description": "The arguments for `tool`."},
                },
                "additionalProperties": False,
            },
        },
    }


def router_model_from_env(env: dict[str, str] | None = None) -> ChatModel | None:
    """The router sub-model from the ``CACHEROUTER_ROUTER_*`` settings, or None when they are not set.

    Only ``CACHEROUTER_ROUTER_BASE_URL`` switches it on: the gateway's client brings its own main model, so
    nothing is borrowed from ``CACHEROUTER_MAIN_*`` here.
    """
    from .endpoint import ROUTER_PREFIX, EndpointConfig, OpenAICompatibleModel

    source = os.environ if env is None else env
    if not source.get(f"{ROUTER_PREFIX}_BASE_URL"):
        return None
    return OpenAICompatibleModel(EndpointConfig.from_env(ROUTER_PREFIX, dict(source)))


class RoutingMCPServer:
    """An MCP server (``self.server``) listing only core tools and INTERNAL_ROUTER over a gateway's registry."""

    def __init__(
        self,
        gateway: Gateway,
        *,
        core: tuple[str, ...] = (),
        router_model: ChatModel | None = None,
        router_config: RouterConfig | None = None,
        max_concurrent_calls: int = 16,
    ) -> None:
        if max_concurrent_calls < 1:
            raise ConfigError(f"max_concurrent_calls must be at least 1, got {max_concurrent_calls}")
        registry = gateway.registry
        missing = sorted(set(core) - set(registry.tools))
        if missing:
            raise ConfigError(f"core tool(s) {missing} are not registered; registered: {sorted(registry.tools)}")
        self.gateway = gateway
        self.core: dict[str, RegisteredTool] = {name: registry.tools[name] for name in sorted(core)}  # frozen here
        self.config = router_config or RouterConfig()
        self.router = (
            Router(gateway, router_model, core_tools=frozenset(self.core), config=self.config)
            if router_model is not None
            else None
        )
        self.mode = "router model" if self.router is not None else DETERMINISTIC_LABEL
        self.ranker = self.router.ranker if self.router is not None else make_ranker(self.config.ranker)
        router = (router_tool_definition() if self.router is not None else retrieval_tool_definition())["function"]
        # Built once: the listing's bytes are the same for the life of the server, whatever the upstreams do.
        self._tools = [
            *(
                types.Tool(name=spec.name, description=spec.description, input_schema=spec.input_schema())
                for spec in self.core.values()
            ),
            types.Tool(name=ROUTER_TOOL, description=router["description"], input_schema=router["parameters"]),
        ]
        self._limiter = anyio.CapacityLimiter(max_concurrent_calls)
        self.server: Server[Any] = Server(
            SERVER_NAME,
            instructions=(
                f"cacherouter gateway ({self.mode}): a fixed tool list; {ROUTER_TOOL} reaches every other tool of "
                "the configured MCP servers."
            ),
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )
        self.server.middleware.append(self._verbatim_results)

    def initialization_options(self) -> Any:
        return self.server.create_initialization_options(NotificationOptions(tools_changed=False))

    def listing(self) -> str:
        """The JSON of the ``tools/list`` result, as the transport writes it: the same for the server's life."""
        return types.ListToolsResult(tools=self._tools).model_dump_json(by_alias=True, exclude_unset=True)

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self._tools)

    async def _verbatim_results(self, ctx: ServerRequestContext[Any], call_next: CallNext) -> HandlerResult:
        """Put an upstream's result on the wire field for field: the SDK's typed result would drop what it lacks."""
        if ctx.method != "tools/call":
            return await call_next(ctx)
        holder: dict[str, Any] = {}
        token = _RAW.set(holder)
        try:
            result = await call_next(ctx)
        finally:
            _RAW.reset(token)
        raw = holder.get("raw")
        if raw is None or not isinstance(result, dict):
            return result
        out = {key: value for key, value in result.items() if key not in ("content", "structuredContent", "isError")}
        out.update({key: raw[key] for key in ("content", "structuredContent", "isError") if key in raw})
        out["_meta"] = {**(raw.get("_meta") or {}), ROUTE_META: holder["route"]}
        return out

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        arguments = dict(params.arguments or {})
        if params.name in self.core:
            return await self._run(params.name, arguments, route={"tool": params.name, "mode": "core"})
        if params.name != ROUTER_TOOL:
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {params.name}; this gateway lists its tools")
        if self.router is None:
            return await self._retrieve(arguments)
        return await self._route(arguments)

    async def _retrieve(self, arguments: dict[str, Any]) -> types.CallToolResult:
        tool = arguments.get("tool")
        if isinstance(tool, str) and tool:
            chosen = arguments.get("arguments", {})
            if not isinstance(chosen, dict):
                return _error(f"{ROUTER_TOOL}: 'arguments' must be an object fitting {tool}'s input schema")
            if tool not in self.gateway.registry.tools:
                return _error(f"{ROUTER_TOOL}: no tool {tool!r} is registered (now); call with a task to find tools")
            return await self._run(tool, chosen, route={"tool": tool, "mode": DETERMINISTIC_LABEL})
        task = arguments.get("task")
        if not isinstance(task, str) or not task.strip():
            return _error(f"{ROUTER_TOOL}: give a 'task' to find tools, or a 'tool' and its 'arguments' to run one")
        hint = arguments.get("hint") if isinstance(arguments.get("hint"), str) else ""
        registry = self.gateway.registry
        candidates = filter_candidates(
            f"{task} {hint}".strip(),
            list(registry),
            config=self.config,
            core_tools=frozenset(self.core),
            ranker=self.ranker,
        )
        payload = {
            "mode": DETERMINISTIC_LABEL,
            "candidates": [
                {"name": t.name, "description": t.description, "inputSchema": t.input_schema()} for t in candidates
            ],
            "next": f"call {ROUTER_TOOL} with 'tool' (one of these names) and 'arguments' to run it",
        }
        if not candidates:
            payload["next"] = "no registered tool matches this task; rephrase it or solve it without tools"
        return types.CallToolResult(content=[types.TextContent(type="text", text=canonical_json(payload))])

    async def _route(self, arguments: dict[str, Any]) -> types.CallToolResult:
        from .router import router_arguments

        assert self.router is not None
        task, hint = router_arguments(arguments)
        router = self.router
        try:
            outcome = await anyio.to_thread.run_sync(
                functools.partial(router.route, task, hint=hint), abandon_on_cancel=True, limiter=self._limiter
            )
        except CacheRouterError as e:
            return _error(f"{ROUTER_TOOL} failed: {e}")
        result = outcome.payload.get("result")
        if outcome.tool is not None and isinstance(result, dict):  # an upstream tool ran: its own result, verbatim
            return self._verbatim(result, {"tool": outcome.tool, "mode": "router model"})
        text = outcome.to_text()
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)], is_error=outcome.status != "ok"
        )

    async def _run(self, name: str, arguments: dict[str, Any], *, route: dict[str, Any]) -> types.CallToolResult:
        cancel = Cancellation()
        call = functools.partial(self.gateway.call, name, arguments, timeout=self.config.tool_timeout, cancel=cancel)
        try:
            result = await anyio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=self._limiter)
        except anyio.get_cancelled_exc_class():
            cancel.cancel()
            raise
        except ArgumentError as e:
            return _error(f"invalid arguments for {name}: {e}")
        except CacheRouterError as e:
            return _error(f"{name} could not be run: {e}")
        if isinstance(result, UpstreamResult):
            if result.error is not None:
                return _error(f"{name}: {result.error}")
            return self._verbatim(result.result, route)
        return _script_result(result)

    def _verbatim(self, raw: dict[str, Any], route: dict[str, Any]) -> types.CallToolResult:
        holder = _RAW.get()
        if holder is not None:
            holder["raw"], holder["route"] = raw, route
        try:  # the typed twin the SDK's handler contract wants; the middleware sends the raw fields instead
            return types.CallToolResult.model_validate(
                {"content": raw.get("content", []), "isError": raw.get("isError")}
            )
        except ValueError:
            return types.CallToolResult(content=[], is_error=bool(raw.get("isError")))


def _script_result(result: ScriptResult) -> types.CallToolResult:
    payload = result.to_json()
    stdout = payload.pop("stdout")
    text = stdout if result.ok else payload.get("error", "") + ("\n" + stdout if stdout else "")
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)], structured_content=payload, is_error=not result.ok
    )


def _error(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=message)], is_error=True)


async def serve_gateway_stdio(server: RoutingMCPServer) -> None:
    """Serve on stdin/stdout until the client disconnects; then disconnect the upstreams and stop every tool."""
    server.gateway.start()
    try:
        with _exit_on_signals():
            async with stdio_server() as (read_stream, write_stream):
                await server.server.run(read_stream, write_stream, server.initialization_options())
    finally:
        kill_running()
        server.gateway.close()
