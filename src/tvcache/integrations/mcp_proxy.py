"""A caching MCP proxy: ``tvcache mcp-proxy -- CMD ARGS...`` serves the tools of the MCP server ``CMD`` over stdio
and answers repeated calls from a tvcache graph.

One connection to the proxy is one rollout (a tvcache session) of one task (``--task``, default
``$TVCACHE_TASK``, else a digest of the upstream command). Tools annotated ``readOnlyHint: true`` are read-only
(keyed by the state they read); every other tool is state-changing, so its result is keyed by the whole history
of state-changing calls before it. ``--uncached TOOL`` marks a tool non-deterministic: it always runs, and a
rollout that calls it leaves the cached paths.

The upstream server is started lazily: a connection whose calls (and whose tool listing) all hit never starts
it. On a miss after hits the proxy starts a fresh upstream process and replays the cached state-changing calls
of the path first, so the upstream must start in the task's initial state every time it is launched (wrap the
command in a script that resets its working data if it keeps any). Upstream protocol errors are cached like
results and re-raised to the client unchanged.

Statistics of the connection and the cache are the resource ``tvcache://stats`` (JSON). Upstream resources and
prompts are not forwarded: the proxy caches tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..calls import ToolCall, ToolSpec, stable_digest
from ..errors import SandboxError, TVCacheError
from ..protocol import Outcome
from ..session import Session
from ._common import CacheLike, CacheLocation, ExternalSandboxFactory, NoSnapshots, open_cache, require

require("mcp", "mcp")

import mcp.types as types  # noqa: E402
from mcp import Client, MCPError, StdioServerParameters  # noqa: E402
from mcp.server import Server  # noqa: E402
from mcp.server.context import ServerRequestContext  # noqa: E402
from mcp.server.stdio import stdio_server  # noqa: E402

__all__ = ["LIST_TOOLS", "STATS_URI", "CachingProxy", "ProxySettings", "UpstreamSandbox", "serve_stdio"]

KIND = "mcp"
STATS_URI = "tvcache://stats"
LIST_TOOLS = "tools/list"  # a pseudo tool: the listing is cached per state like a read-only call
_MAX_PAGES = 1000


@dataclass(frozen=True, kw_only=True)
class ProxySettings:
    """How to start the upstream server and which cache to use.

    ``command``: the upstream server's argv. ``cache``: see ``tvcache.integrations.CacheLocation``.
    ``uncached``: tools never served from cache. ``env``: the upstream's environment (default: the proxy's).
    """

    command: Sequence[str]
    task_id: str | None = None
    cache: CacheLocation = None
    token: str | None = None
    uncached: frozenset[str] = field(default_factory=frozenset)
    env: Mapping[str, str] | None = None
    cwd: str | None = None

    def __post_init__(self) -> None:
        if not self.command:
            raise TVCacheError("mcp-proxy needs the upstream server's command after '--', e.g. -- python server.py")

    @property
    def task(self) -> str:
        if self.task_id:
            return self.task_id
        return "mcp:" + stable_digest("\x00".join(self.command).encode()).hex()[:16]

    def server_parameters(self) -> StdioServerParameters:
        env = dict(os.environ if self.env is None else self.env)
        return StdioServerParameters(command=self.command[0], args=list(self.command[1:]), env=env, cwd=self.cwd)


def _dump(model: Any) -> Any:
    return model.model_dump(by_alias=True, mode="json", exclude_none=True)


def _encode(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class UpstreamSandbox(NoSnapshots):
    """One upstream server process and an MCP client session to it.

    The client's transport lives in a task of its own: anyio contexts must be exited by the task that entered
    them, and the proxy starts and stops sandboxes from different requests.
    """

    def __init__(self, parameters: StdioServerParameters) -> None:
        self._parameters = parameters
        self._client: Client | None = None
        self._stop = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None

    async def open(self) -> UpstreamSandbox:
        ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        self._runner = asyncio.create_task(self._hold(ready), name="tvcache-mcp-upstream")
        try:
            self._client = await ready
        except Exception as error:
            raise SandboxError(
                f"cannot start the upstream MCP server {self._parameters.command!r}: {error!r}; "
                "check the command after '--' runs on its own"
            ) from error
        return self

    async def _hold(self, ready: asyncio.Future[Client]) -> None:
        try:
            async with Client(self._parameters, cache=None) as client:
                ready.set_result(client)
                await self._stop.wait()
        except BaseException as error:
            if not ready.done():
                ready.set_exception(error)
            elif not isinstance(error, asyncio.CancelledError | Exception):
                raise

    async def execute(self, call: ToolCall) -> Outcome:
        client = self._client
        if client is None:
            raise SandboxError("the upstream MCP server is not running")
        if call.name == LIST_TOOLS:
            tools: list[Any] = []
            cursor: str | None = None
            for _ in range(_MAX_PAGES):
                page = await client.list_tools(cursor=cursor)
                tools.extend(_dump(tool) for tool in page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    break
            return Outcome(output=_encode({"tools": tools}), changed_state=False)
        try:
            result = await client.call_tool(call.name, call.arguments)
        except MCPError as error:  # a protocol error is the call's answer too; the client sees it unchanged
            return Outcome(output=_encode({"error": _dump(error.error)}), is_error=True)
        return Outcome(output=_encode({"result": _dump(result)}), is_error=result.is_error)

    async def stop(self) -> None:
        self._stop.set()
        runner, self._runner, self._client = self._runner, None, None
        if runner is not None:
            with contextlib.suppress(Exception):
                await runner


class CachingProxy:
    """The proxy's MCP server (``self.server``) for one connection: a tvcache session per connection."""

    def __init__(self, settings: ProxySettings, cache: CacheLike) -> None:
        self.settings = settings
        self.cache = cache
        self.specs: dict[str, ToolSpec] = {LIST_TOOLS: ToolSpec(name=LIST_TOOLS, read_only=True)}
        self.factory = ExternalSandboxFactory(kind=KIND, tools=self.specs, start=self._start_upstream)
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

    async def _start_upstream(self) -> UpstreamSandbox:
        self.upstream_starts += 1
        return await UpstreamSandbox(self.settings.server_parameters()).open()

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: Server[Any]) -> AsyncIterator[dict[str, Any]]:
        async with self.cache.session(self.settings.task, sandbox=self.factory) as session:
            self.session = session
            try:
                yield {}
            finally:
                self.session = None

    def _session(self) -> Session:
        if self.session is None:
            raise MCPError(types.INTERNAL_ERROR, "the tvcache session is not open (the proxy is shutting down)")
        return self.session

    async def _tools(self) -> list[types.Tool]:
        result = await self._session().call(LIST_TOOLS, {})
        tools = [types.Tool.model_validate(tool) for tool in json.loads(result.output)["tools"]]
        for tool in tools:
            read_only = tool.annotations is not None and tool.annotations.read_only_hint is True
            deterministic = tool.name not in self.settings.uncached
            self.specs[tool.name] = ToolSpec(name=tool.name, read_only=read_only, deterministic=deterministic)
        return tools

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=await self._tools())

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        if params.name == LIST_TOOLS or (
            params.name not in self.specs and params.name not in {tool.name for tool in await self._tools()}
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


async def serve_stdio(settings: ProxySettings) -> None:
    """Serve one connection on stdin/stdout until the client closes it."""
    cache = open_cache(settings.cache, token=settings.token)
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
) -> int:
    """The ``tvcache mcp-proxy`` command (errors go to stderr: stdout is the MCP channel)."""
    try:
        settings = ProxySettings(
            command=list(command),
            task_id=task_id or os.environ.get("TVCACHE_TASK") or None,
            cache=parse_location(cache),
            token=token or os.environ.get("TVCACHE_TOKEN") or None,
            uncached=frozenset(uncached),
        )
        asyncio.run(serve_stdio(settings))
    except TVCacheError as error:
        print(f"tvcache mcp-proxy: {error}", file=sys.stderr)
        return 2
    return 0
