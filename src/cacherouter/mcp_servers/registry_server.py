"""Serve a gateway's registry over MCP: ``cacherouter serve-mcp --repo DIR``.

Every registered tool is listed with the JSON schema the AST extraction produced, and a call runs the tool's
script through the gateway's executor (an argument vector built from the schema, a subprocess with a timeout).
The listing is read from the gateway's current registry on every ``tools/list``, so a hot reload is visible at
once; after each swap the server tells clients, in both protocol eras the SDK serves:

* 2026-07-28 clients: a ``ToolsListChanged`` event on every open ``subscriptions/listen`` stream;
* handshake-era clients: ``notifications/tools/list_changed`` on each session seen so far.

A swap whose listing is byte for byte the one last announced (a SKILL.md body edit, a broken script still served
by its last good schema, a ``.py`` file that is no tool) is not announced. The gateway's poller calls its
listeners from its own thread; the notification is handed to the server's event loop with
``run_coroutine_threadsafe``, never sent from the poller thread.

Tool calls run in worker threads under their own limit (``max_concurrent_calls``, 16 by default; more calls
wait), apart from the threads the stdio transport needs, so the protocol keeps answering however many calls are
in flight. A tool never outlives its call: a call the client cancels, the client hanging up (end of stdin) and
the server stopping (SIGINT, SIGTERM, normal exit) each kill the process groups of the tools involved.

Requires the ``mcp`` SDK (``pip install 'tvcache[mcp]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import AsyncIterator
from typing import Any, cast

from ..errors import ArgumentError, CacheRouterError, ConfigError
from ..tools.executor import Cancellation, ScriptResult, kill_running
from ..tools.gateway import Gateway
from ..tools.registry import Registry
from .serving import error_result, exit_on_signals, script_result

try:
    import anyio
    import mcp.types as types
    from mcp import MCPError
    from mcp.server import NotificationOptions, Server
    from mcp.server.connection import Connection
    from mcp.server.context import ServerRequestContext
    from mcp.server.stdio import stdio_server
    from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged
    from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ConfigError("serving over MCP needs the 'mcp' SDK: pip install 'tvcache[mcp]' (mcp>=2.3,<3)") from e

__all__ = ["GatewayMCPServer", "serve_stdio"]

logger = logging.getLogger(__name__)
SERVER_NAME = "cacherouter-gateway"
DEFAULT_MAX_CONCURRENT_CALLS = 16


class GatewayMCPServer:
    """An MCP server (``self.server``) over a :class:`~cacherouter.tools.gateway.Gateway`.

    One instance serves any number of connections; ``notify_changed`` reaches all of them. At most
    ``max_concurrent_calls`` tools run at once, across connections.
    """

    def __init__(self, gateway: Gateway, *, max_concurrent_calls: int = DEFAULT_MAX_CONCURRENT_CALLS) -> None:
        if max_concurrent_calls < 1:
            raise ConfigError(f"max_concurrent_calls must be at least 1, got {max_concurrent_calls}")
        self.gateway = gateway
        # Not anyio's default limiter (40 threads), which the stdio transport's reads and writes also need:
        # calls holding all of it would leave no thread to read the next request or write a reply.
        self._call_limiter = anyio.CapacityLimiter(max_concurrent_calls)
        self._listed_lock = threading.Lock()
        self._listed = self.listing(gateway.registry)  # the listing clients last saw or were told about
        self.bus = InMemorySubscriptionBus()
        # Handshake-era connections can only be reached through a request that came in on them.
        self._legacy_connections: weakref.WeakSet[Connection] = weakref.WeakSet()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.notifications_sent = 0
        self.server: Server[dict[str, Any]] = Server(
            SERVER_NAME,
            instructions="Tools of a cacherouter repository (package/skill/script); the list changes on hot reload.",
            lifespan=self._lifespan,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_subscriptions_listen=ListenHandler(self.bus),
        )
        gateway.subscribe(self._on_swap)

    def initialization_options(self) -> Any:
        return self.server.create_initialization_options(NotificationOptions(tools_changed=True))

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: Server[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        self._loop = asyncio.get_running_loop()
        yield {}

    def _remember(self, ctx: ServerRequestContext[Any]) -> None:
        if ctx.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS:
            # ctx.session is a per-request wrapper; the connection it wraps is what outlives the request. The SDK
            # (2.3) has no public accessor for it, hence the attribute; without one we cannot notify at all.
            connection = getattr(ctx.session, "_connection", None)
            if isinstance(connection, Connection):
                self._legacy_connections.add(connection)

    @staticmethod
    def tools(registry: Registry) -> list[types.Tool]:
        """The MCP listing of ``registry``: sorted by name, so the bytes are the same for the same registry."""
        return [
            types.Tool(name=spec.name, description=spec.description, input_schema=spec.input_schema())
            for spec in registry
        ]

    @classmethod
    def listing(cls, registry: Registry) -> str:
        """The JSON of the ``tools/list`` result for ``registry``, as the transport writes it."""
        result = types.ListToolsResult(tools=cls.tools(registry))
        return result.model_dump_json(by_alias=True, exclude_unset=True)

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        self._remember(ctx)
        return types.ListToolsResult(tools=self.tools(self.gateway.registry))

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        self._remember(ctx)
        if self.gateway.registry.get(params.name) is None:
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {params.name}; list the tools to see what is served")
        arguments = dict(params.arguments or {})
        cancel = Cancellation()
        call = functools.partial(self.gateway.call, params.name, arguments, cancel=cancel)
        try:
            # A thread cannot be interrupted, but its tool can: on cancellation (the client's, or the connection
            # closing) stop waiting and kill the tool, which lets the abandoned thread return within moments.
            result = await anyio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=self._call_limiter)
        except anyio.get_cancelled_exc_class():
            cancel.cancel()
            raise
        except ArgumentError as e:  # the model's arguments do not fit: a result it can correct, not a crash
            return error_result(f"invalid arguments for {params.name}: {e}")
        except CacheRouterError as e:
            return error_result(f"{params.name} could not be run: {e}")
        return script_result(cast(ScriptResult, result))  # a --repo gateway has no upstreams: always a script run

    def _on_swap(self, registry: Registry) -> None:
        """Gateway listener (runs on the poller's thread): schedule the notification on the server's loop.

        Only when the listing differs from the last one announced: many swaps change nothing a client sees.
        """
        listing = self.listing(registry)
        with self._listed_lock:
            if listing == self._listed:
                return
            self._listed = listing
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # not serving yet: the first tools/list will show the new registry anyway
        asyncio.run_coroutine_threadsafe(self.notify_changed(), loop)

    async def notify_changed(self) -> None:
        """Tell every connected client that the tool list changed."""
        await self.bus.publish(ToolsListChanged())
        for connection in list(self._legacy_connections):
            try:
                await connection.send_tool_list_changed()
            except Exception as e:  # a closed connection must not stop the others from hearing about it
                logger.info("dropping an MCP connection that could not be notified: %r", e)
                self._legacy_connections.discard(connection)
        self.notifications_sent += 1


async def serve_stdio(gateway: Gateway, *, max_concurrent_calls: int = DEFAULT_MAX_CONCURRENT_CALLS) -> None:
    """Serve ``gateway`` on stdin/stdout until the client disconnects; the gateway polls in the background.

    When it returns, no tool this process started is left running. SIGINT and SIGTERM kill the running tools
    and then the process (:func:`exit_on_signals`).
    """
    mcp_server = GatewayMCPServer(gateway, max_concurrent_calls=max_concurrent_calls)
    gateway.start()
    try:
        with exit_on_signals():
            async with stdio_server() as (read_stream, write_stream):
                await mcp_server.server.run(read_stream, write_stream, mcp_server.initialization_options())
    finally:
        kill_running()  # whatever ended the serving, no tool outlives it
        gateway.close()
