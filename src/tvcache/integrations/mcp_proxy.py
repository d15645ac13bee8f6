"""A caching MCP proxy: ``tvcache mcp-proxy -- CMD ARGS...`` serves the tools of the MCP server ``CMD`` over stdio
and answers repeated calls from a tvcache graph.

One connection to the proxy is one rollout (a tvcache session) of one task (``--task``, default
``$TVCACHE_TASK``, else a digest of the upstream command). Tools annotated ``readOnlyHint: true`` are read-only
(keyed by the state they read); every other tool is state-changing, so its result is keyed by the whole history
of state-changing calls before it. No annotation says a tool is deterministic (a clock is read-only and
idempotent), so every tool starts undeclared: cached, and its first hit in a task executed once more and
compared. ``--uncached TOOL`` declares a tool non-deterministic: it always runs, and a rollout that calls it
leaves the cached paths; ``--deterministic TOOL`` declares it deterministic (its hits are not checked);
``--audit-rate`` re-executes a fraction of all hits in a fresh upstream. See docs/mcp-proxy.md.

The tool listing is passed through as the upstream sent it, field for field, whichever protocol era the client
and the upstream speak.

The upstream server is started lazily: a connection whose calls (and whose tool listing) all hit, with no
first-hit check or audit due, never starts it. On a miss after hits the proxy starts a fresh upstream process
and replays the cached state-changing calls of the path first, so the upstream must start in the task's initial
state every time it is launched. ``--sandbox-dir DIR`` arranges that: the upstream runs confined on an overlay
of its data directory ``DIR``, one per sandbox, so it always starts from ``DIR`` as it is on the host (which
never changes), and sandboxes fork from overlay snapshots (``mcp_sandbox``). Without it, wrap the command in a
script that resets its working data if it keeps any.

Upstream protocol errors are cached like results and re-raised to the client unchanged; an upstream that closes
the connection during a call (it crashed) fails that call, uncached.

Statistics of the connection and the cache are the resource ``tvcache://stats`` (JSON). Upstream resources and
prompts are not forwarded: the proxy caches tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ..calls import ToolSpec
from ..errors import InvalidInput, TVCacheError
from ..session import Session
from .cache_location import CacheLike, CacheLocation, open_cache
from .external_sandboxes import ExternalSandboxFactory
from .mcp_upstream import LIST_TOOLS, ProxySettings, UpstreamSandbox
from .optional_imports import require

if TYPE_CHECKING:
    from .mcp_sandbox import SandboxedUpstreams

require("mcp", "mcp")

import mcp.types as types  # noqa: E402
from mcp import MCPError  # noqa: E402
from mcp.server import Server  # noqa: E402
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext  # noqa: E402
from mcp.server.stdio import stdio_server  # noqa: E402

__all__ = [
    "LIST_TOOLS",
    "STATS_URI",
    "CachingProxy",
    "ProxySettings",
    "UpstreamSandbox",
    "open_proxy_cache",
    "serve_stdio",
]

KIND = "mcp"
STATS_URI = "tvcache://stats"
# The upstream's tools as it listed them, from the listing middleware to the tools/list handler of one request.
_LISTING: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar("tvcache_mcp_listing")


class CachingProxy:
    """The proxy's MCP server (``self.server``) for one connection: a tvcache session per connection.

    With ``settings.sandbox_dir``, upstreams run sandboxed: pass ``sandboxes`` (a ``SandboxedUpstreams`` shared
    by the connections of this process, so they fork each other's snapshots), or the proxy makes one of its own
    for this connection, without snapshots (they could not outlive it), and closes it when the connection ends.
    """

    def __init__(
        self, settings: ProxySettings, cache: CacheLike, *, sandboxes: SandboxedUpstreams | None = None
    ) -> None:
        self.settings = settings
        self.cache = cache
        # The listing is declared deterministic: it is the server's description of itself, not a computed
        # result, and checking its first hit would start the upstream on connections whose calls all hit.
        listing = ToolSpec(name=LIST_TOOLS, read_only=True, deterministic=True)
        self.specs: dict[str, ToolSpec] = {LIST_TOOLS: listing}
        self._owned_sandboxes: SandboxedUpstreams | None = None
        self.factory: Any
        if settings.sandbox_dir is None:
            if sandboxes is not None:
                raise InvalidInput("CachingProxy(sandboxes=...) needs ProxySettings(sandbox_dir=...) too")
            self.factory = ExternalSandboxFactory(kind=KIND, tools=self.specs, start=self._start_upstream)
        else:
            if sandboxes is None:
                from .mcp_sandbox import SandboxedUpstreams

                sandboxes = self._owned_sandboxes = SandboxedUpstreams(settings, snapshots=False)
            self.factory = sandboxes.factory(self.specs, on_start=self._count_start)
        self.session: Session | None = None
        self.upstream_starts = 0
        self.server: Server[Any] = Server(
            "tvcache-mcp-proxy",
            instructions="tvcache caching proxy; statistics at " + STATS_URI,
            lifespan=self._lifespan,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_list_resources=self._list_resources,
            on_read_resource=self._read_resource,
        )
        self.server.middleware.append(self._list_tools_verbatim)

    async def _start_upstream(self) -> UpstreamSandbox:
        self._count_start()
        return await UpstreamSandbox(self.settings.server_parameters()).open()

    def _count_start(self) -> None:
        self.upstream_starts += 1

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: Server[Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            async with self.cache.session(self.settings.task, sandbox=self.factory) as session:
                self.session = session
                try:
                    yield {}
                finally:
                    self.session = None
        finally:
            if self._owned_sandboxes is not None:
                self._owned_sandboxes.close()

    def _session(self) -> Session:
        if self.session is None:
            raise MCPError(types.INTERNAL_ERROR, "the tvcache session is not open (the proxy is shutting down)")
        return self.session

    async def _tools(self) -> list[dict[str, Any]]:
        """The upstream's tools (cached per state, as it listed them); learns which are read-only."""
        result = await self._session().call(LIST_TOOLS, {})
        tools: list[dict[str, Any]] = json.loads(result.output)["tools"]
        for tool in tools:
            name = tool["name"]
            read_only = (tool.get("annotations") or {}).get("readOnlyHint") is True
            self.specs[name] = ToolSpec(name=name, read_only=read_only, deterministic=self.settings.declared(name))
        return tools

    async def _list_tools_verbatim(self, ctx: ServerRequestContext[Any], call_next: CallNext) -> HandlerResult:
        """Answer tools/list with the upstream's tools field for field, in whichever protocol era the client is.

        The SDK's server shapes each result to the schema of the client's protocol version and drops what that
        schema lacks: a 2026-07-28 client would lose the ``execution`` a 2025-11-25 upstream declares, a
        2025-11-25 client what only 2026-07-28 has. The proxy is not the author of the tools: the SDK still
        builds and checks the envelope (``resultType``, ``_meta``), then the tools go out as the upstream sent.
        """
        if ctx.method != "tools/list":
            return await call_next(ctx)
        tools = await self._tools()
        token = _LISTING.set(tools)
        try:
            result = await call_next(ctx)
        finally:
            _LISTING.reset(token)
        # The SDK's inner chain returns the wire dict; anything else is not a listing to complete.
        return {**result, "tools": tools} if isinstance(result, dict) else result

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        tools = _LISTING.get(None)
        if tools is None:  # reached without the listing middleware (it was removed from server.middleware)
            tools = await self._tools()
        return types.ListToolsResult(tools=[types.Tool.model_validate(tool) for tool in tools])

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        if params.name == LIST_TOOLS or (
            params.name not in self.specs and params.name not in {tool["name"] for tool in await self._tools()}
        ):
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {params.name}")
        try:
            result = await self._session().call(params.name, params.arguments or {})
        except TVCacheError as error:
            raise MCPError(types.INTERNAL_ERROR, f"tvcache: {error}") from error
        payload = json.loads(result.output)
        if "error" in payload:
            raise MCPError.from_error_data(types.ErrorData.model_validate(payload["error"]))
        return types.CallToolResult.model_validate(payload["result"])

    async def _list_resources(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        stats = types.Resource(
            uri=STATS_URI,
            name="tvcache-stats",
            description="tvcache statistics of this connection and of the cache (JSON)",
            mime_type="application/json",
        )
        return types.ListResourcesResult(resources=[stats])

    async def _read_resource(
        self, ctx: ServerRequestContext[Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        if str(params.uri) != STATS_URI:
            raise MCPError(types.INVALID_PARAMS, f"Unknown resource: {params.uri}; this proxy serves {STATS_URI}")
        text = json.dumps(self.stats(), sort_keys=True)
        contents = types.TextResourceContents(uri=STATS_URI, mime_type="application/json", text=text)
        return types.ReadResourceResult(contents=[contents])

    def stats(self) -> dict[str, Any]:
        """This connection's counters and the cache's (for a remote cache: this client's)."""
        session = self._session()
        cache_stats = session.cache.stats()
        return {
            "task_id": session.task_id,
            "upstream_starts": self.upstream_starts,
            "session": asdict(session.stats),
            "cache": {**asdict(cache_stats), "hit_rate": cache_stats.hit_rate},
        }


def open_proxy_cache(settings: ProxySettings) -> CacheLike:
    """The cache ``settings`` names, with its audit rate (an already open cache keeps its own)."""
    return open_cache(settings.cache, token=settings.token, audit_rate=settings.audit_rate)


async def serve_stdio(settings: ProxySettings) -> None:
    """Serve one connection on stdin/stdout until the client closes it."""
    cache = open_proxy_cache(settings)
    owned = cache is not settings.cache
    try:
        proxy = CachingProxy(settings, cache)
        async with stdio_server() as (read_stream, write_stream):
            await proxy.server.run(read_stream, write_stream, proxy.server.create_initialization_options())
    finally:
        if owned:
            cache.close()


def parse_location(text: str | None) -> CacheLocation:
    """``--cache`` as given on the command line: a directory, a URL, or comma-separated URLs (sharded)."""
    if not text:
        return None
    if "," in text:
        return [part.strip() for part in text.split(",") if part.strip()]
    return text


def main(
    command: Sequence[str],
    *,
    task_id: str | None,
    cache: str | None,
    token: str | None,
    uncached: Sequence[str],
    deterministic: Sequence[str] = (),
    audit_rate: float = 0.0,
    sandbox_dir: str | None = None,
) -> int:
    """The ``tvcache mcp-proxy`` command (errors go to stderr: stdout is the MCP channel)."""
    try:
        settings = ProxySettings(
            command=list(command),
            task_id=task_id or os.environ.get("TVCACHE_TASK") or None,
            cache=parse_location(cache),
            token=token or os.environ.get("TVCACHE_TOKEN") or None,
            uncached=frozenset(uncached),
            deterministic=frozenset(deterministic),
            audit_rate=audit_rate,
            sandbox_dir=sandbox_dir,
        )
        asyncio.run(serve_stdio(settings))
    except TVCacheError as error:
        print(f"tvcache mcp-proxy: {error}", file=sys.stderr)
        return 2
    return 0
