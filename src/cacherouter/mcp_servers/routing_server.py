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

``INTERNAL_ROUTER``'s arguments are checked against the schema it declares (unknown keys, wrong types, a
missing ``task``) and, in retrieval, against its two uses (``task`` or ``tool``, never both): a call that breaks
them is an ``isError`` result naming what is wrong, never a guess.

A core tool is listed with its server's whole definition -- ``title``, ``annotations`` (``readOnlyHint``,
``destructiveHint``, ...), ``outputSchema``, ``icons``, ``_meta`` -- verbatim, under its registry name. A core
tool whose server is not up at start-up (slow, or being retried) is waited for: the first ``tools/list`` waits up
to ``core_wait`` seconds for it, then the listing is frozen with the core tools there are (those missing are
reached through ``INTERNAL_ROUTER`` once their server is back). A core tool that goes away later stays listed; a
call to it says it is gone and why.

An upstream tool's result comes back as the server sent it: ``content``, ``structuredContent`` and ``isError``
unchanged, and ``_meta`` with one more key, ``io.github.cacherouter/route`` (which tool ran). Errors that leave no
result (an upstream down, timed out or crashed; unknown tools; arguments that do not fit) are ``isError``
results with one text block saying what went wrong. An upstream call is bounded by its server's
``call_timeout``; ``--tool-timeout`` bounds the scripts of ``--repo``.

The gateway serves on stdio (:func:`serve_gateway_stdio`) or streamable HTTP (:func:`serve_gateway_http`, the
SDK's own transport under uvicorn). However it stops -- the client hangs up, SIGTERM, SIGINT -- no tool and no
upstream process outlives it: the upstreams get the SDK's shutdown when there is time for it, and on a signal
every upstream process group is sent SIGTERM and, after a grace second, SIGKILL.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from ..canonical import canonical_json
from ..channels.relevance import make_ranker
from ..channels.router import Router, RouterConfig, filter_candidates
from ..errors import ArgumentError, CacheRouterError, ConfigError
from ..models.base import ChatModel
from ..prompts import ROUTER_TOOL, router_tool_definition
from ..tools.executor import Cancellation, kill_running
from ..tools.gateway import Gateway
from ..tools.registry import RegisteredTool
from ..tools.upstream_hub import UpstreamResult, stop_upstream_processes
from .serving import error_result, exit_on_signals, script_result

try:
    import anyio
    import mcp.types as types
    from mcp import MCPError
    from mcp.server import NotificationOptions, Server
    from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
    from mcp.server.stdio import stdio_server
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ConfigError("serving over MCP needs the 'mcp' SDK: pip install 'tvcache[mcp]' (mcp>=2.3,<3)") from e

__all__ = ["DETERMINISTIC_LABEL", "RoutingMCPServer", "serve_gateway_http", "serve_gateway_stdio"]

logger = logging.getLogger(__name__)

SERVER_NAME = "cacherouter-mcp-gateway"
ROUTE_META = "io.github.cacherouter/route"
DETERMINISTIC_LABEL = "deterministic retrieval (no router model configured)"
# The raw result of the call being answered, for the middleware that puts it on the wire unchanged.
_RAW: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("cacherouter_raw_result", default=None)
#: Seconds the upstreams get to exit after SIGTERM when the gateway itself is being stopped by a signal: an MCP
#: client that sent it (the SDK's stdio client) sends SIGKILL 2 s later.
SIGNAL_GRACE = 1.0
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "object": dict,
    "array": list,
    "boolean": bool,
    "integer": int,
    "number": (int, float),
}


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
    from ..models.endpoint import ROUTER_PREFIX, EndpointConfig, OpenAICompatibleModel

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
        core_wait: float = 30.0,
    ) -> None:
        if max_concurrent_calls < 1:
            raise ConfigError(f"max_concurrent_calls must be at least 1, got {max_concurrent_calls}")
        registry = gateway.registry
        servers = {status.name: status for status in gateway.upstreams}
        missing = sorted(set(core) - set(registry.tools))
        # A core tool of a configured server that is not up yet (slow, or being retried) is waited for; any other
        # missing name is a mistake in --core.
        unknown = [
            name
            for name in missing
            if (status := servers.get(name.split("__", 1)[0] if "__" in name else "")) is None or status.state == "up"
        ]
        if unknown:
            raise ConfigError(
                f"core tool(s) {sorted(unknown)} are not registered; registered: {sorted(registry.tools)}"
            )
        self.gateway = gateway
        self.pending: tuple[str, ...] = tuple(missing)  # core tools whose server has not listed them yet
        self.core: dict[str, RegisteredTool] = {name: registry.tools[name] for name in sorted(set(core) - set(missing))}
        self.core_names = frozenset(core)
        self.core_wait = core_wait
        self._deadline = time.monotonic() + core_wait
        self.config = router_config or RouterConfig()
        self.router = (
            Router(gateway, router_model, core_tools=self.core_names, config=self.config)
            if router_model is not None
            else None
        )
        self.mode = "router model" if self.router is not None else DETERMINISTIC_LABEL
        self.ranker = self.router.ranker if self.router is not None else make_ranker(self.config.ranker)
        router = (router_tool_definition() if self.router is not None else retrieval_tool_definition())["function"]
        self._router_entry = {
            "name": ROUTER_TOOL,
            "description": router["description"],
            "inputSchema": router["parameters"],
        }
        # Frozen at the first tools/list (or now, with nothing pending): the listing's bytes are then the same
        # for the life of the server, whatever the upstreams do.
        self._entries: list[dict[str, Any]] | None = None
        self._tools: list[types.Tool] = []
        if not self.pending:
            self._freeze()
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
        """The JSON of the ``tools`` of ``tools/list``, as the transport writes them: the same for the server's life.

        Freezes the listing now if the first ``tools/list`` has not.
        """
        return json.dumps(self._freeze(), ensure_ascii=False, separators=(",", ":"))

    def _freeze(self) -> list[dict[str, Any]]:
        """The listing: the core tools registered now (with their servers' definitions) and INTERNAL_ROUTER."""
        if self._entries is not None:
            return self._entries
        registry = self.gateway.registry
        for name in self.pending:
            spec = registry.tools.get(name)
            if spec is not None:
                self.core[name] = spec
            else:
                logger.warning(
                    "core tool %s is not registered after %gs (%s); it is left out of the listing for the life of "
                    "this server and reached through %s once its server is back",
                    name,
                    self.core_wait,
                    self._server_state(name),
                    ROUTER_TOOL,
                )
        self.core = dict(sorted(self.core.items()))
        entries = [_core_entry(spec) for spec in self.core.values()] + [self._router_entry]
        self._tools = [_typed(entry) for entry in entries]
        self._entries = entries
        return entries

    def _server_state(self, name: str) -> str:
        server = name.split("__", 1)[0]
        for status in self.gateway.upstreams:
            if status.name == server:
                return f"MCP server {server!r} is {status.state}" + (
                    f": {status.last_error}" if status.last_error and status.state != "up" else ""
                )
        return f"MCP server {server!r} is not configured"

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        while self._entries is None and time.monotonic() < self._deadline:
            if all(name in self.gateway.registry.tools for name in self.pending):
                break
            await anyio.sleep(0.1)  # the hub reconnects in the background; its registry swap is what we wait for
        self._freeze()
        return types.ListToolsResult(tools=self._tools)

    async def _verbatim_results(self, ctx: ServerRequestContext[Any], call_next: CallNext) -> HandlerResult:
        """Put an upstream's result, and the core tools' definitions, on the wire field for field: the SDK's typed
        models would drop what they lack."""
        if ctx.method == "tools/list":
            listed = await call_next(ctx)
            if isinstance(listed, dict) and self._entries is not None:
                return {**listed, "tools": self._entries}
            return listed
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
        if params.name in self.core or (params.name in self.core_names and self._entries is None):
            return await self._run(params.name, arguments, route={"tool": params.name, "mode": "core"})
        if params.name != ROUTER_TOOL:
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {params.name}; this gateway lists its tools")
        problem = _check_arguments(arguments, self._router_entry["inputSchema"])
        if problem is not None:
            return error_result(f"{ROUTER_TOOL}: {problem}")
        if self.router is None:
            return await self._retrieve(arguments)
        return await self._route(arguments)

    async def _retrieve(self, arguments: dict[str, Any]) -> types.CallToolResult:
        if "tool" in arguments and ("task" in arguments or "hint" in arguments):
            given = ", ".join(repr(key) for key in ("task", "hint") if key in arguments)
            return error_result(
                f"{ROUTER_TOOL}: 'tool' runs a tool and 'task' finds tools: give one of them, not both (got 'tool' "
                f"and {given})"
            )
        if "arguments" in arguments and "tool" not in arguments:
            return error_result(f"{ROUTER_TOOL}: 'arguments' go with 'tool' (the tool to run); 'tool' is missing")
        if "tool" in arguments:
            tool = arguments["tool"]
            if not tool:
                return error_result(f"{ROUTER_TOOL}: 'tool' is empty; give a tool name from an earlier answer")
            if tool not in self.gateway.registry.tools:
                return error_result(
                    f"{ROUTER_TOOL}: no tool {tool!r} is registered (now); call with a task to find tools"
                )
            chosen = arguments.get("arguments", {})
            return await self._run(tool, chosen, route={"tool": tool, "mode": DETERMINISTIC_LABEL})
        task = arguments.get("task")
        if not isinstance(task, str) or not task.strip():
            return error_result(
                f"{ROUTER_TOOL}: give a 'task' to find tools, or a 'tool' and its 'arguments' to run one"
            )
        hint = arguments.get("hint", "")
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
        from ..channels.router import router_arguments

        assert self.router is not None
        task, hint = router_arguments(arguments)
        router = self.router
        try:
            outcome = await anyio.to_thread.run_sync(
                functools.partial(router.route, task, hint=hint), abandon_on_cancel=True, limiter=self._limiter
            )
        except CacheRouterError as e:
            return error_result(f"{ROUTER_TOOL} failed: {e}")
        result = outcome.payload.get("result")
        if outcome.tool is not None and isinstance(result, dict):  # an upstream tool ran: its own result, verbatim
            return self._verbatim(result, {"tool": outcome.tool, "mode": "router model"})
        text = outcome.to_text()
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)], is_error=outcome.status != "ok"
        )

    async def _run(self, name: str, arguments: dict[str, Any], *, route: dict[str, Any]) -> types.CallToolResult:
        spec = self.gateway.registry.get(name)
        if spec is None:
            return error_result(self._gone(name))
        cancel = Cancellation()
        # An upstream tool is bounded by its server's call_timeout; --tool-timeout is the scripts' limit.
        timeout = None if spec.upstream else self.config.tool_timeout
        call = functools.partial(self.gateway.call, name, arguments, timeout=timeout, cancel=cancel)
        try:
            result = await anyio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=self._limiter)
        except anyio.get_cancelled_exc_class():
            cancel.cancel()
            raise
        except ArgumentError as e:
            if self.gateway.registry.get(name) is None:  # it went away between the look-up and the call
                return error_result(self._gone(name))
            return error_result(f"invalid arguments for {name}: {e}")
        except CacheRouterError as e:
            return error_result(f"{name} could not be run: {e}")
        if isinstance(result, UpstreamResult):
            if result.error is not None:
                return error_result(f"{name}: {result.error}")
            return self._verbatim(result.result, route)
        return script_result(result)

    def _gone(self, name: str) -> str:
        """Why a listed tool can no longer be called."""
        spec = self.core.get(name)
        if spec is None or not spec.upstream:
            return f"{name} is gone: it is no longer in the tool repository (its script was removed or broke)"
        server = spec.upstream
        state = next((s for s in self.gateway.upstreams if s.name == server), None)
        if state is None:
            return f"{name} is gone: its MCP server {server!r} was removed from the upstreams config"
        if state.state != "up":
            why = f" ({state.last_error})" if state.last_error else ""
            return (
                f"{name} is gone for now: its MCP server {server!r} is {state.state}{why}; it is back when the "
                "server is"
            )
        return f"{name} is gone: its MCP server {server!r} no longer lists {spec.upstream_tool!r}"

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


def _core_entry(spec: RegisteredTool) -> dict[str, Any]:
    """A core tool as listed: its registry name, description and schema, then its server's other fields."""
    entry: dict[str, Any] = {"name": spec.name, "description": spec.description, "inputSchema": spec.input_schema()}
    if spec.declared_fields:
        entry.update(json.loads(spec.declared_fields))
    return entry


def _typed(entry: dict[str, Any]) -> types.Tool:
    """The SDK's typed twin of a listed tool (its handler contract wants one); the middleware sends ``entry``."""
    try:
        return types.Tool.model_validate(entry)
    except ValueError:
        return types.Tool(name=entry["name"], description=entry["description"], input_schema=entry["inputSchema"])


def _check_arguments(arguments: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """What in ``arguments`` breaks ``schema`` (a flat object schema like INTERNAL_ROUTER's), or None."""
    properties: dict[str, Any] = schema.get("properties", {})
    if schema.get("additionalProperties") is False:
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return (
                f"unknown argument(s) {', '.join(repr(k) for k in unknown)}; it takes only "
                f"{', '.join(repr(k) for k in properties)}"
            )
    for key, value in arguments.items():
        kind = properties.get(key, {}).get("type")
        expected = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        wrong = expected is not None and (
            not isinstance(value, expected) or (isinstance(value, bool) and kind != "boolean")  # bool is an int
        )
        if wrong:
            return f"{key!r} must be {'an' if str(kind)[0] in 'aeiou' else 'a'} {kind}, got {json.dumps(value)}"
    missing = [key for key in schema.get("required", []) if key not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(repr(k) for k in missing)}"
    return None


def _stop_now() -> None:
    """On a signal: every upstream process group gets SIGTERM, then SIGKILL after SIGNAL_GRACE seconds."""
    stop_upstream_processes(SIGNAL_GRACE)


async def _serving(server: RoutingMCPServer, serve: Callable[[], Awaitable[None]]) -> None:
    """Run ``serve``; then stop every tool and disconnect the upstreams, with the signals still handled.

    The close runs in a worker thread, so that a SIGTERM arriving meanwhile (an MCP client gives a server 2 s
    after closing its stdin) is handled on the loop -- the upstreams stopped at once -- instead of ending the
    process in the middle of the close with the upstreams, each in its own session, left running.
    """
    server.gateway.start()
    with exit_on_signals(also=_stop_now):
        try:
            await serve()
        finally:
            with anyio.CancelScope(shield=True):
                kill_running()
                await anyio.to_thread.run_sync(server.gateway.close)
                await anyio.to_thread.run_sync(stop_upstream_processes, SIGNAL_GRACE)  # a survivor of the close


async def serve_gateway_stdio(server: RoutingMCPServer) -> None:
    """Serve on stdin/stdout until the client disconnects; then disconnect the upstreams and stop every tool."""

    async def serve() -> None:
        async with stdio_server() as (read_stream, write_stream):
            await server.server.run(read_stream, write_stream, server.initialization_options())

    await _serving(server, serve)


async def serve_gateway_http(
    server: RoutingMCPServer, *, host: str = "127.0.0.1", port: int = 8000, path: str = "/mcp"
) -> None:
    """Serve over streamable HTTP at ``http://host:port/path`` (the SDK's own transport) until SIGINT or SIGTERM.

    On loopback the SDK's DNS-rebinding protection is on (Host and Origin must be loopback).
    """
    try:
        import uvicorn
    except ImportError as e:  # pragma: no cover - uvicorn comes with the mcp SDK
        raise ConfigError("serving over streamable HTTP needs uvicorn: pip install 'tvcache[server]'") from e

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # ours (exit_on_signals) stop the tools and the upstreams, then end the process

    app = server.server.streamable_http_app(streamable_http_path=path, host=host)
    http = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    await _serving(server, http.serve)
