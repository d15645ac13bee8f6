"""One upstream MCP server as the proxy sees it: ``ProxySettings`` (how to start it, which cache, which tools are
declared) and ``UpstreamSandbox`` (an MCP client session to one upstream process, run on the host by
``mcp_proxy`` or confined in a shell sandbox by ``mcp_sandbox``). Both proxies' modules build on this one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..calls import ToolCall, stable_digest
from ..errors import InvalidInput, SandboxError, TVCacheError
from ..protocol import Outcome
from .cache_location import CacheLocation
from .external_sandboxes import NoSnapshots
from .optional_imports import require

require("mcp", "mcp")

import mcp.types as types  # noqa: E402
from mcp import Client, MCPError, StdioServerParameters  # noqa: E402
from mcp.client import Transport  # noqa: E402
from pydantic import BaseModel, ConfigDict  # noqa: E402

__all__ = ["LIST_TOOLS", "ProxySettings", "UpstreamSandbox"]

LIST_TOOLS = "tools/list"  # a pseudo tool: the listing is cached per state like a read-only call
_MAX_PAGES = 1000


@dataclass(frozen=True, kw_only=True)
class ProxySettings:
    """How to start the upstream server and which cache to use.

    ``command``: the upstream server's argv. ``cache``: see ``tvcache.integrations.CacheLocation``.
    ``uncached``: tools declared non-deterministic, never served from cache. ``deterministic``: tools declared
    deterministic, whose hits are never checked. Every other tool is undeclared (see ``ToolSpec``).
    ``audit_rate``: the fraction of hits re-executed in a fresh upstream and compared (``Cache(audit_rate=...)``).
    ``env``: the upstream's environment (default: the proxy's). ``cwd``: its working directory (default: the
    proxy's). ``sandbox_dir``: the upstream's data directory, overlaid per sandbox (``mcp_sandbox``); None runs
    the upstream on the host as it is.
    """

    command: Sequence[str]
    task_id: str | None = None
    cache: CacheLocation = None
    token: str | None = None
    uncached: frozenset[str] = field(default_factory=frozenset)
    deterministic: frozenset[str] = field(default_factory=frozenset)
    audit_rate: float = 0.0
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    sandbox_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.command:
            raise TVCacheError("mcp-proxy needs the upstream server's command after '--', e.g. -- python server.py")
        if both := sorted(self.uncached & self.deterministic):
            raise InvalidInput(f"tool(s) {', '.join(both)} cannot be both --uncached and --deterministic")
        if not 0.0 <= self.audit_rate <= 1.0:
            raise InvalidInput(f"--audit-rate must be between 0 and 1, got {self.audit_rate}")

    def declared(self, tool: str) -> bool | None:
        """Whether ``tool`` was declared deterministic (True), non-deterministic (False), or neither (None)."""
        if tool in self.uncached:
            return False
        return True if tool in self.deterministic else None

    @property
    def task(self) -> str:
        if self.task_id:
            return self.task_id
        # A sandboxed upstream's state starts from its data directory: another directory is another task.
        parts = [*self.command, *(["--sandbox-dir", os.path.abspath(self.sandbox_dir)] if self.sandbox_dir else [])]
        return "mcp:" + stable_digest("\x00".join(parts).encode()).hex()[:16]

    def server_parameters(self) -> StdioServerParameters:
        env = dict(os.environ if self.env is None else self.env)
        return StdioServerParameters(command=self.command[0], args=list(self.command[1:]), env=env, cwd=self.cwd)


class _Verbatim(BaseModel):
    """A result kept as the JSON that was sent: every field (in ``model_extra``), none interpreted."""

    model_config = ConfigDict(extra="allow")


def _dump(model: Any) -> Any:
    return model.model_dump(by_alias=True, mode="json", exclude_none=True)


def _encode(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class UpstreamSandbox(NoSnapshots):
    """One upstream server process and an MCP client session to it.

    The client's transport lives in a task of its own: anyio contexts must be exited by the task that entered
    them, and the proxy starts and stops sandboxes from different requests.
    """

    def __init__(self, server: StdioServerParameters | Transport, *, describe: str | None = None) -> None:
        self._server = server
        self._describe = describe or repr(server.command if isinstance(server, StdioServerParameters) else server)
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
                f"cannot start the upstream MCP server {self._describe}: {error!r}; "
                "check the command after '--' runs on its own"
            ) from error
        return self

    async def _hold(self, ready: asyncio.Future[Client]) -> None:
        try:
            async with Client(self._server, cache=None) as client:
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
            # Not _encode: its sorted keys would reorder each schema's properties, the order a model reads the
            # arguments in. The upstream's own order is as deterministic as sorting.
            listing = json.dumps({"tools": await self._list_tools(client)}, separators=(",", ":"), ensure_ascii=False)
            return Outcome(output=listing, changed_state=False)
        try:
            result = await client.call_tool(call.name, call.arguments)
        except MCPError as error:
            if error.error.code == types.CONNECTION_CLOSED:
                # Not the call's answer: the upstream went away (crashed, exited) under it, with unknown effects.
                raise SandboxError(
                    f"the upstream MCP server {self._describe} closed the connection during {call} (it crashed or "
                    "exited); the call is not cached, and the rollout's next call starts a new upstream"
                ) from error
            # Any other protocol error is the call's answer too; the client sees it unchanged.
            return Outcome(output=_encode({"error": _dump(error.error)}), is_error=True)
        return Outcome(output=_encode({"result": _dump(result)}), is_error=result.is_error)

    async def _list_tools(self, client: Client) -> list[dict[str, Any]]:
        """Every tool the upstream lists, as the JSON it sent, page after page.

        Not ``client.list_tools()``: its typed ``Tool`` drops fields the model lacks and re-dumping it drops
        explicit nulls, so the proxy would list something other than the upstream does. The session still
        checks each page against the negotiated protocol version's schema.
        """
        tools: list[dict[str, Any]] = []
        cursor: str | None = None
        for _ in range(_MAX_PAGES):
            params = None if cursor is None else types.PaginatedRequestParams(cursor=cursor)
            sent = await client.session.send_request(types.ListToolsRequest(params=params), _Verbatim)
            page = sent.model_extra or {}
            tools.extend(page.get("tools") or [])
            cursor = page.get("nextCursor")
            if cursor is None:
                break
        return tools

    async def stop(self) -> None:
        self._stop.set()
        runner, self._runner, self._client = self._runner, None, None
        if runner is not None:
            with contextlib.suppress(Exception):
                await runner
