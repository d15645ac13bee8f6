"""Serve a gateway's registry over MCP: ``cacherouter serve-mcp --repo DIR``.

Every registered tool is listed with the JSON schema the AST extraction produced, and a call runs the tool's
script through the gateway's executor (an argument vector built from the schema, a subprocess with a timeout).
The listing is read from the gateway's current registry on every ``tools/list``, so a hot reload is visible at
once; after each swap the server tells clients, in both protocol eras the SDK serves:

* 2026-07-28 clients: a ``ToolsListChanged`` event on every open ``subscriptions/listen`` stream;
* handshake-era clients: ``notifications/tools/list_changed`` on each session seen so far.

The gateway's poller calls its listeners from its own thread; the notification is handed to the server's event
loop with ``run_coroutine_threadsafe``, never sent from the poller thread.

Requires the ``mcp`` SDK (``pip install 'tvcache[mcp]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator
from typing import Any

from .errors import ArgumentError, CacheRouterError, ConfigError
from .gateway import Gateway
from .registry import Registry

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


class GatewayMCPServer:
    """An MCP server (``self.server``) over a :class:`~cacherouter.gateway.Gateway`.

    One instance serves any number of connections; ``notify_changed`` reaches all of them.
    """

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
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
        try:
            result = await anyio.to_thread.run_sync(self.gateway.call, params.name, arguments)
        except ArgumentError as e:  # the model's arguments do not fit: a result it can correct, not a crash
            return _error_result(f"invalid arguments for {params.name}: {e}")
        except CacheRouterError as e:
            return _error_result(f"{params.name} could not be run: {e}")
        payload = result.to_json()
        text = (
            result.stdout if result.ok else payload.get("error", "") + ("\n" + result.stdout if result.stdout else "")
        )
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)],
            structured_content=payload,
            is_error=not result.ok,
        )

    def _on_swap(self, registry: Registry) -> None:
        """Gateway listener (runs on the poller's thread): schedule the notification on the server's loop."""
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


def _error_result(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=message)], is_error=True)


async def serve_stdio(gateway: Gateway) -> None:
    """Serve ``gateway`` on stdin/stdout until the client disconnects; the gateway polls in the background."""
    mcp_server = GatewayMCPServer(gateway)
    gateway.start()
    try:
        async with stdio_server() as (read_stream, write_stream):
            await mcp_server.server.run(read_stream, write_stream, mcp_server.initialization_options())
    finally:
        gateway.close()
