"""Connections to upstream MCP servers: their tools as registry entries, and tool calls passed through verbatim.

An :class:`UpstreamHub` keeps one MCP client connection per configured server (:mod:`cacherouter.tools.upstreams`), all
on one event loop in one background thread, and offers a synchronous face to the gateway: the current tools, a
call, a status report, and a callback after every change. A change -- a first listing, a
``notifications/tools/list_changed`` (handshake era) or ``ToolsListChanged`` event (2026-07-28 ``listen``
stream), a reconnect, a server joining or leaving -- ends in the gateway building a new immutable registry and
swapping it in, as a script edit does. Tools enter only the long tail: the main view is rendered once and never
changes because of them.

The rules for a server that misbehaves (each is reported in :attr:`UpstreamStatus.last_error` and in the
registry's problems):

* **never answers initialize** (or listing): the attempt is abandoned after the server's ``timeout``, its process
  is stopped (the SDK kills the process tree) and it is retried with backoff (0.25 s doubling to 30 s);
* **a tool with an invalid schema or a duplicate name**: that tool is left out -- or, if it had a good definition
  before, the last good one keeps serving -- while the server's other tools serve; a listing the SDK rejects as
  a whole (it breaks the protocol's types) is rejected whole, and the server's last good tools keep serving;
* **list_changed storms**: notifications only mark the listing stale; it is fetched again at most once per
  ``debounce`` seconds, and a listing identical to the last one changes nothing;
* **dies or crashes mid-call**: the call gets a clear error at once; the tools stay registered for the
  server's ``keep_tools_for`` seconds (calls fail fast meanwhile) while it is reconnected, and are dropped after
  that until it is back. A reconnect that lists the same tools changes nothing, so a quick restart is invisible.

A call's result -- ``content`` (text, images, audio, resources), ``structuredContent``, ``isError``, ``_meta``
-- is kept as the JSON the server sent, not re-typed: the SDK's models would drop fields they lack. A call is
bounded by the server's ``call_timeout`` (or a shorter limit the caller gives), never by its connect ``timeout``;
when that deadline passes, the error says the gateway gave up, not that the server answered.

A stdio server's stderr reaches the hub's ``errlog`` line by line, each line prefixed with ``[server]``, through
a pipe of ours. That pipe also finds the server's processes when the gateway must stop at once
(:func:`stop_upstream_processes`, e.g. on SIGTERM): every process whose stderr is still one of these pipes.

Requires the ``mcp`` SDK (``pip install 'tvcache[mcp]'``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TextIO

from ..canonical import canonical_json
from ..errors import ConfigError
from .executor import Cancellation
from .registry import Limits, Problem, RegisteredTool
from .upstreams import UpstreamConfig, check_input_schema, namespaced_name

try:
    import anyio
    import mcp_types as types
    from mcp import Client, MCPError, StdioServerParameters
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.client.subscriptions import ToolsListChanged
    from mcp.shared._httpx_utils import create_mcp_http_client
    from mcp.shared.message import SessionMessage
    from mcp_types import CONNECTION_CLOSED
    from mcp_types.jsonrpc import JSONRPCRequest, JSONRPCResponse
    from mcp_types.methods import validate_server_result
    from mcp_types.version import MODERN_PROTOCOL_VERSIONS
    from pydantic import BaseModel, ConfigDict, ValidationError
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ConfigError("MCP upstreams need the 'mcp' SDK: pip install 'tvcache[mcp]' (mcp>=2.3,<3)") from e

__all__ = ["UpstreamHub", "UpstreamResult", "UpstreamStatus", "stop_upstream_processes"]

logger = logging.getLogger(__name__)
CLIENT_INFO = types.Implementation(name="cacherouter", version="0.1.0")
MAX_PAGES = 50  # a paginator that never ends cannot hang a listing
_BACKOFF_START = 0.25
_BACKOFF_MAX = 30.0
# Fields of a tool definition the registry keeps apart; the rest are passed on verbatim (declared_fields).
_OWN_FIELDS = frozenset({"name", "description", "inputSchema"})


# ---------------------------------------------------------------- upstream stderr and processes

_relays_lock = threading.Lock()
_relays: dict[int, str] = {}  # inode of a live stderr pipe -> its server's name


class _StderrRelay:
    """The stderr of one stdio server process: a pipe whose lines go to ``errlog`` as ``[server] line``.

    The pipe stays registered (by inode) until every process holding it has exited, so that
    :func:`stop_upstream_processes` finds the server -- and its children, which inherit the pipe -- even after
    the SDK lost track of it.
    """

    def __init__(self, server: str, errlog: TextIO) -> None:
        read_fd, write_fd = os.pipe()
        self.server, self.errlog = server, errlog
        self.inode = os.fstat(write_fd).st_ino
        self.writer = os.fdopen(write_fd, "w")  # the process's stderr; ours is closed once the process has stopped
        with _relays_lock:
            _relays[self.inode] = server
        threading.Thread(
            target=self._pump, args=(read_fd,), name=f"cacherouter-mcp-stderr-{server}", daemon=True
        ).start()

    def _pump(self, read_fd: int) -> None:
        try:
            with os.fdopen(read_fd, "rb") as stream:
                for line in stream:
                    text = line.decode("utf-8", "replace").rstrip("\r\n")
                    with contextlib.suppress(OSError, ValueError):  # a closed errlog must not stop the draining
                        self.errlog.write(f"[{self.server}] {text}\n")
                        self.errlog.flush()
        finally:
            with _relays_lock:
                _relays.pop(self.inode, None)

    def close(self) -> None:
        self.writer.close()


def upstream_process_groups() -> dict[int, str]:
    """The process groups (pgid -> server) of every live process whose stderr is an upstream's pipe.

    Read from ``/proc`` (Linux); empty where there is none. Never this process's own group.
    """
    with _relays_lock:
        pipes = {f"pipe:[{inode}]": server for inode, server in _relays.items()}
    if not pipes:
        return {}
    own = os.getpgid(0)
    groups: dict[int, str] = {}
    try:
        entries = [entry.name for entry in os.scandir("/proc") if entry.name.isdigit()]
    except OSError:
        return {}
    for pid in entries:
        try:
            server = pipes.get(os.readlink(f"/proc/{pid}/fd/2"))
            if server is None:
                continue
            pgid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
        if pgid != own:
            groups[pgid] = server
    return groups


def stop_upstream_processes(grace: float = 1.0) -> int:
    """SIGTERM every upstream process group still alive, wait up to ``grace`` seconds, SIGKILL what is left.

    For a gateway that must stop now (a signal, or after a close that may have left a survivor): the SDK's own
    shutdown gives each server 2 s after its stdin closes and 2 s more after SIGTERM, more than a client that
    sends SIGTERM leaves us. Safe from any thread and from the event loop; returns the number of groups found.
    """
    groups = upstream_process_groups()
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    left = set(groups)
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left &= set(upstream_process_groups())
    for pgid in left:
        logger.warning("MCP upstream %s: still running %gs after SIGTERM; killed", groups[pgid], grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    return len(groups)


class _Verbatim(BaseModel):
    """A result kept as the JSON that was sent (in ``model_extra``); the SDK still checks it against the protocol."""

    model_config = ConfigDict(extra="allow")


@dataclass(frozen=True, kw_only=True)
class UpstreamResult:
    """What one call to an upstream tool produced.

    ``result_json`` is the ``CallToolResult`` exactly as the server sent it (a tool that failed and said so has
    ``isError: true`` there: a result the model must see). ``error`` is set instead when no result came back: the
    server is not connected, did not answer in time, crashed, or answered with a JSON-RPC error.
    """

    tool: str
    upstream: str
    result_json: str = ""
    error: str | None = None
    duration_s: float = 0.0

    @property
    def result(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.result_json) if self.result_json else {}
        return loaded

    @property
    def ok(self) -> bool:
        return self.error is None and self.result.get("isError") is not True

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tool": self.tool, "ok": self.ok}
        if self.error is not None:
            out["error"] = self.error
        else:
            out["result"] = self.result
        return out


@dataclass(frozen=True, kw_only=True)
class UpstreamStatus:
    name: str
    transport: str
    state: str  # "connecting", "up", "down" or "stopped"
    tools: int
    protocol_version: str | None = None
    last_error: str | None = None
    connects: int = 0
    listings: int = 0
    list_changed: int = 0  # change notifications received


class _Screen:
    """Sits between the session and the transport: notes which requests are listings, and takes the tools that
    break the protocol's types out of their answers, so one broken tool does not fail a server's whole listing
    (the SDK checks a page as a whole). The tools taken out are kept in ``rejected`` for the link to report."""

    def __init__(self, version: Callable[[], str | None]) -> None:
        self._version = version
        self._listings: set[Any] = set()
        self.rejected: list[tuple[str, str]] = []  # (tool name, why)

    def outgoing(self, item: Any) -> None:
        message = getattr(item, "message", None)
        if isinstance(message, JSONRPCRequest) and message.method == "tools/list":
            self._listings.add(message.id)

    def incoming(self, item: Any) -> Any:
        message = getattr(item, "message", None)
        if not isinstance(message, JSONRPCResponse) or message.id not in self._listings:
            return item
        self._listings.discard(message.id)
        tools = message.result.get("tools")
        if not isinstance(tools, list):
            return item
        version = self._version() or "2025-11-25"
        kept: list[Any] = []
        for tool in tools:
            try:
                validate_server_result("tools/list", version, {**message.result, "tools": [tool]})
            except ValidationError as e:
                details = e.errors()
                where = ".".join(str(part) for part in details[0]["loc"][2:]) if details else ""
                what = details[0]["msg"] if details else str(e)
                name = tool.get("name") if isinstance(tool, dict) else None
                self.rejected.append((str(name) if name else "", f"breaks the MCP schema ({where}: {what})"))
                continue
            except (KeyError, ValueError):  # a version the SDK has no table for: leave the check to the session
                pass
            kept.append(tool)
        if len(kept) == len(tools):
            return item
        result = {**message.result, "tools": kept}
        return SessionMessage(message=JSONRPCResponse(jsonrpc="2.0", id=message.id, result=result))


@contextlib.asynccontextmanager
async def _watched(transport: Any, closed: anyio.Event, screen: _Screen) -> AsyncIterator[Any]:
    """``transport`` with both streams relayed: the end of the connection sets ``closed`` (the session reports a
    dead server only to requests in flight; an idle server that exits would go unnoticed until the next call),
    and listings pass through ``screen``."""
    async with transport as (read_stream, write_stream):
        relay_send, relay_receive = anyio.create_memory_object_stream[Any](0)
        out_send, out_receive = anyio.create_memory_object_stream[Any](0)

        async def pump_in() -> None:
            try:
                async with relay_send:
                    async for item in read_stream:
                        await relay_send.send(screen.incoming(item))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
                pass
            finally:
                closed.set()

        async def pump_out() -> None:
            try:
                async with out_receive:
                    async for item in out_receive:
                        screen.outgoing(item)
                        await write_stream.send(item)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                closed.set()

        async with anyio.create_task_group() as group:
            group.start_soon(pump_in)
            group.start_soon(pump_out)
            try:
                yield relay_receive, out_send
            finally:
                group.cancel_scope.cancel()


@dataclass
class _Link:
    """One upstream server's connection and tools; lives on the hub's loop."""

    config: UpstreamConfig
    hub: UpstreamHub
    state: str = "connecting"
    client: Client | None = None
    tools: dict[str, RegisteredTool] = field(default_factory=dict)  # registry name -> spec, what is served now
    last_good: dict[str, RegisteredTool] = field(default_factory=dict)  # the server's tool name -> last good spec
    problems: tuple[Problem, ...] = ()
    protocol_version: str | None = None
    instructions: str = ""
    last_error: str | None = None
    connects: int = 0
    listings: int = 0
    list_changed: int = 0
    attempted: threading.Event = field(default_factory=threading.Event)  # the first attempt has ended
    task: asyncio.Task[None] | None = None
    _dirty: asyncio.Event = field(default_factory=asyncio.Event)
    _closed: anyio.Event | None = None
    _screen: _Screen | None = None
    _down_since: int = 0  # connects count when it went down: a drop timer for an older outage is stale

    def status(self) -> UpstreamStatus:
        return UpstreamStatus(
            name=self.config.name,
            transport=self.config.transport,
            state=self.state,
            tools=len(self.tools),
            protocol_version=self.protocol_version,
            last_error=self.last_error,
            connects=self.connects,
            listings=self.listings,
            list_changed=self.list_changed,
        )

    def _transport(self, closed: anyio.Event, stack: contextlib.AsyncExitStack) -> Any:
        config = self.config
        self._screen = screen = _Screen(lambda: self.protocol_version)
        if config.url:
            http = create_mcp_http_client(headers=dict(config.headers) or None)
            stack.push_async_callback(http.aclose)
            return _watched(streamable_http_client(config.url, http_client=http), closed, screen)
        parameters = StdioServerParameters(
            command=config.command, args=list(config.args), env=dict(config.env) or None, cwd=config.cwd
        )
        relay = _StderrRelay(config.name, self.hub.errlog)
        stack.callback(relay.close)  # runs after the client, and so the process, has stopped
        return _watched(stdio_client(parameters, errlog=relay.writer), closed, screen)

    async def run(self) -> None:
        """Connect, list, follow changes; on any failure report it, wait, and connect again, until cancelled."""
        backoff = _BACKOFF_START
        while True:
            closed = anyio.Event()
            try:
                # One scope around the whole connection, its deadline lifted once the server has listed: a
                # deadline scope around entering the client alone would close before the client's own scopes.
                with anyio.CancelScope() as connecting:
                    connecting.deadline = anyio.current_time() + self.config.timeout
                    async with contextlib.AsyncExitStack() as stack:
                        client = await stack.enter_async_context(
                            Client(
                                self._transport(closed, stack),
                                cache=None,
                                mode="auto",
                                message_handler=self._on_message,
                                client_info=CLIENT_INFO,
                                read_timeout_seconds=self.config.timeout,
                            )
                        )
                        self.client, self._closed = client, closed
                        self.protocol_version = client.session.protocol_version
                        self.instructions = (client.instructions or "")[:2000]
                        self.state, self.last_error = "up", None
                        await self._relist(client)
                        connecting.deadline = math.inf
                        self.connects += 1
                        self.hub.changed()  # the "down" problem goes, even when the tools are the same as before
                        self.attempted.set()
                        backoff = _BACKOFF_START
                        async with anyio.create_task_group() as group:
                            group.start_soon(self._follow_changes, client)
                            if client.session.protocol_version in MODERN_PROTOCOL_VERSIONS:
                                group.start_soon(self._listen, client)
                            await closed.wait()
                            group.cancel_scope.cancel()
                if connecting.cancelled_caught:
                    raise TimeoutError
                raise ConnectionError("the server closed the connection (it exited or crashed)")
            except TimeoutError:
                self._went_down(
                    f"no answer within {self.config.timeout:g}s (initialize or tools/list); the server is stopped "
                    "and retried"
                )
            except Exception as e:  # any failure of this server is reported and retried, never raised
                self._went_down(_describe(e))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX)

    def _went_down(self, message: str) -> None:
        self.client, self._closed = None, None
        self.state = "down"
        self.last_error = message
        logger.warning("MCP upstream %s: %s", self.config.name, message)
        self.attempted.set()
        token = self._down_since = self.connects
        if self.tools:
            asyncio.get_running_loop().call_later(self.config.keep_tools_for, self._drop_if_still_down, token)
        self.hub.changed()

    def _drop_if_still_down(self, token: int) -> None:
        if self.state != "up" and self._down_since == token and self.tools:
            logger.warning("MCP upstream %s: still down; its %d tools are dropped", self.config.name, len(self.tools))
            self.tools = {}
            self.hub.changed()

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self.list_changed += 1
            self._dirty.set()  # marks the listing stale; _follow_changes fetches it, at most once per debounce

    async def _listen(self, client: Client) -> None:
        """2026-07-28 connections announce changes on a ``subscriptions/listen`` stream, not as notifications."""
        try:
            async with client.listen(tools_list_changed=True) as subscription:
                async for event in subscription:
                    if isinstance(event, ToolsListChanged):
                        self.list_changed += 1
                        self._dirty.set()
        except Exception as e:  # a server that cannot listen still serves; its list is read at each connect
            logger.info("MCP upstream %s: no change subscription (%s)", self.config.name, _describe(e))

    async def _follow_changes(self, client: Client) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(self.hub.debounce)  # a storm of notifications costs one listing
            self._dirty.clear()
            try:
                await self._relist(client)
            except Exception as e:  # a failed relisting keeps the last good tools serving
                self.last_error = f"relisting after list_changed failed: {_describe(e)}; the last tools keep serving"
                logger.warning("MCP upstream %s: %s", self.config.name, self.last_error)
                if isinstance(e, MCPError) and e.code == CONNECTION_CLOSED and self._closed is not None:
                    self._closed.set()

    async def _relist(self, client: Client) -> None:
        raw: list[Any] = []
        if self._screen is not None:
            self._screen.rejected.clear()
        cursor: str | None = None
        with anyio.fail_after(self.config.timeout):
            for _ in range(MAX_PAGES):
                params = None if cursor is None else types.PaginatedRequestParams(cursor=cursor)
                try:
                    page = await client.session.send_request(types.ListToolsRequest(params=params), _Verbatim)
                except ValidationError as e:
                    self._reject_listing(e)
                    return
                extra = page.model_extra or {}
                raw.extend(extra.get("tools") or [])
                cursor = extra.get("nextCursor")
                if not cursor:
                    break
        self.listings += 1
        self._accept(raw, list(self._screen.rejected) if self._screen is not None else [])

    def _reject_listing(self, error: ValidationError) -> None:
        details = error.errors()
        where = ".".join(str(part) for part in details[0]["loc"]) if details else ""
        what = details[0]["msg"] if details else str(error)
        message = (
            f"its tools/list answer breaks the MCP schema ({where}: {what}); the whole listing "
            f"is rejected and the last good tools ({len(self.tools)}) keep serving"
        )
        self.listings += 1
        self.last_error = message
        self.problems = (Problem(path=f"mcp:{self.config.name}", message=message),)
        logger.warning("MCP upstream %s: %s", self.config.name, message)
        self.hub.changed()

    def _accept(self, raw: list[Any], rejected: list[tuple[str, str]]) -> None:
        """Turn one listing into the served tools: per tool, the current definition, the last good one, or none.

        ``rejected`` are the tools the screen took out of the answer, as (name, why).
        """
        config = self.config
        names = Counter(t.get("name") for t in raw if isinstance(t, dict))
        tools: dict[str, RegisteredTool] = {}
        problems: dict[str, str] = {}
        listed: set[str] = set()
        for rejected_name, why in rejected:
            if not rejected_name:
                problems[f"#{len(problems)}"] = f"a listed tool without a usable name {why}; left out"
            elif config.takes(rejected_name):
                listed.add(rejected_name)
                problems[rejected_name] = why
        for entry in raw:
            name = entry.get("name") if isinstance(entry, dict) else None
            if not isinstance(name, str) or not name:
                problems[f"#{len(problems)}"] = "a listed tool has no name; left out"
                continue
            listed.add(name)
            if not config.takes(name):
                continue
            if names[name] > 1:
                problems[name] = f"listed {names[name]} times with one name; a call could reach either"
                continue
            reason = check_input_schema(entry.get("inputSchema"))
            if reason is not None:
                problems[name] = reason
                continue
            spec = self._spec(entry)
            tools[spec.name] = spec
            self.last_good[name] = spec
        for name in list(self.last_good):
            if name not in listed or not config.takes(name):
                del self.last_good[name]  # gone from the server: no last good definition to fall back on
            elif name in problems:
                kept = self.last_good[name]
                tools[kept.name] = kept
                problems[name] += " (the last good definition keeps serving)"
            elif name not in {spec.upstream_tool for spec in tools.values()}:
                del self.last_good[name]
        new_problems = tuple(
            Problem(path=f"mcp:{config.name}/{name}", message=message) for name, message in sorted(problems.items())
        )
        for problem in sorted(set(new_problems) - set(self.problems), key=lambda p: p.path):
            logger.warning("MCP upstream tool %s: %s", problem.path, problem.message)
        changed = _digests(tools) != _digests(self.tools) or new_problems != self.problems
        self.tools, self.problems = tools, new_problems
        if changed:
            self.hub.changed()

    def _spec(self, entry: dict[str, Any]) -> RegisteredTool:
        fields = {key: value for key, value in entry.items() if key not in _OWN_FIELDS}
        name: str = entry["name"]
        limit = self.hub.limits.max_description_length
        description = str(entry.get("description") or entry.get("title") or "")
        description = description or f"{name} from the MCP server {self.config.name}"
        if len(description) > limit:
            description = description[: limit - 3].rstrip() + "..."
        return RegisteredTool(
            name=namespaced_name(self.config.name, name),
            package=f"mcp:{self.config.name}",
            skill=self.config.name,
            description=description,
            skill_text=self.instructions,
            digest=hashlib.sha256(canonical_json(entry).encode("utf-8")).hexdigest(),
            upstream=self.config.name,
            upstream_tool=name,
            declared_schema=json.dumps(entry["inputSchema"], ensure_ascii=False, separators=(",", ":")),
            declared_fields=json.dumps(fields, ensure_ascii=False, separators=(",", ":")) if fields else "",
        )

    async def call(
        self, spec: RegisteredTool, arguments: Mapping[str, Any], timeout: float, limit: str
    ) -> UpstreamResult:
        """Call ``spec``, giving up after ``timeout`` seconds (``limit`` says whose limit that is)."""
        start = time.monotonic()
        client = self.client
        server = self.config.name

        def failed(message: str) -> UpstreamResult:
            return UpstreamResult(tool=spec.name, upstream=server, error=message, duration_s=time.monotonic() - start)

        if client is None:
            return failed(
                f"the MCP server {server!r} is not connected ({self.last_error or 'connecting'}); its tools fail "
                "until it is back"
            )
        request = types.CallToolRequest(
            params=types.CallToolRequestParams(name=spec.upstream_tool, arguments=dict(arguments))
        )
        gave_up = (
            f"no answer from {spec.upstream_tool} on MCP server {server!r}: the gateway gave up after {timeout:g} s "
            f"({limit})"
        )
        try:
            with anyio.fail_after(timeout):
                # The session's read timeout is the connect timeout: a call must not inherit it (a slow call that
                # fits its call_timeout would be cut), so this request's own is set past our deadline.
                sent = await client.session.send_request(request, _Verbatim, request_read_timeout_seconds=timeout + 5.0)
        except TimeoutError:
            return failed(gave_up)
        except MCPError as e:
            if e.code == CONNECTION_CLOSED:
                if self._closed is not None:
                    self._closed.set()
                return failed(
                    f"the MCP server {server!r} closed the connection during the call (it crashed or exited); "
                    "it is being reconnected"
                )
            return failed(f"MCP server {server!r} answered {spec.upstream_tool} with error {e.code}: {e}")
        except ValidationError as e:
            return failed(f"MCP server {server!r} sent a result for {spec.upstream_tool} that is not valid MCP: {e}")
        except Exception as e:  # a transport failure (HTTP) is this call's error; the link reconnects
            if self._closed is not None:
                self._closed.set()
            return failed(f"calling {spec.upstream_tool} on MCP server {server!r} failed: {_describe(e)}")
        return UpstreamResult(
            tool=spec.name,
            upstream=server,
            result_json=json.dumps(sent.model_extra or {}, ensure_ascii=False, separators=(",", ":")),
            duration_s=time.monotonic() - start,
        )


def _digests(tools: Mapping[str, RegisteredTool]) -> dict[str, str]:
    return {name: spec.digest for name, spec in tools.items()}


def _describe(error: BaseException) -> str:
    if isinstance(error, BaseExceptionGroup) and error.exceptions:
        return _describe(error.exceptions[0])
    if isinstance(error, FileNotFoundError):
        return f"cannot start the server: {error.strerror}: {error.filename}"
    text = str(error) or type(error).__name__
    return f"{type(error).__name__}: {text}" if type(error).__name__ not in text else text


class UpstreamHub:
    """The upstream MCP servers of one gateway, connected from a background thread (see the module docstring)."""

    def __init__(
        self,
        upstreams: tuple[UpstreamConfig, ...] = (),
        *,
        limits: Limits | None = None,
        on_change: Callable[[], None] | None = None,
        debounce: float = 0.2,
        errlog: TextIO | None = None,
    ) -> None:
        names = [u.name for u in upstreams]
        if len(set(names)) != len(names):
            raise ConfigError(f"upstream names must be unique, got {names}")
        self.limits = limits or Limits()
        self.on_change = on_change
        self.debounce = debounce
        self.errlog = errlog if errlog is not None else sys.stderr
        self._configs = upstreams
        self._links: dict[str, _Link] = {}
        self._lock = threading.Lock()
        self._tools: Mapping[str, RegisteredTool] = MappingProxyType({})
        self._problems: tuple[Problem, ...] = ()
        self.generation = 0
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._closed = False

    # ---------------------------------------------------------------- lifecycle (any thread)

    def start(self) -> None:
        """Start the connections and wait until each server's first attempt has ended (bounded by its timeout)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop.run_forever, name="cacherouter-mcp-upstreams", daemon=True)
        self._thread.start()
        self.set_upstreams(self._configs)

    def set_upstreams(self, upstreams: tuple[UpstreamConfig, ...]) -> None:
        """Connect to the servers that are new or changed, disconnect those that are gone, keep the rest as they are.

        Returns once each new server's first attempt has ended (listed, or failed and reported).
        """
        if self._thread is None:
            self._configs = upstreams
            return
        future = asyncio.run_coroutine_threadsafe(self._reconcile(upstreams), self._loop)
        started = future.result(timeout=max((u.timeout for u in upstreams), default=1.0) + 30.0)
        self._configs = upstreams
        deadline = time.monotonic() + max((u.timeout for u in upstreams), default=0.0) + 5.0
        for link in started:
            link.attempted.wait(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Disconnect every server (each process is stopped) and end the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                asyncio.run_coroutine_threadsafe(self._reconcile(()), self._loop).result(timeout=30.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)
            self._thread = None
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> UpstreamHub:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- what the gateway reads (any thread)

    @property
    def tools(self) -> Mapping[str, RegisteredTool]:
        return self._tools

    @property
    def problems(self) -> tuple[Problem, ...]:
        return self._problems

    def status(self) -> tuple[UpstreamStatus, ...]:
        return tuple(self._links[name].status() for name in sorted(self._links))

    def call(
        self,
        spec: RegisteredTool,
        arguments: Mapping[str, Any],
        *,
        timeout: float | None = None,
        cancel: Cancellation | None = None,
    ) -> UpstreamResult:
        """Call upstream tool ``spec``; returns within about the server's call_timeout, or ``timeout`` if shorter."""
        link = self._links.get(spec.upstream)
        if link is None or self._thread is None:
            return UpstreamResult(
                tool=spec.name, upstream=spec.upstream, error=f"the MCP server {spec.upstream!r} is not configured"
            )
        own = link.config.call_timeout
        if timeout is None or timeout >= own:
            limit, whose = own, f"call_timeout of server {spec.upstream}"
        else:
            limit, whose = (
                timeout,
                f"this call's limit, shorter than server {spec.upstream}'s call_timeout of {own:g} s",
            )
        future = asyncio.run_coroutine_threadsafe(link.call(spec, arguments, limit, whose), self._loop)
        deadline = time.monotonic() + limit + 5.0  # the call times itself out; this only guards a stuck loop
        while True:
            try:
                return future.result(timeout=0.05)
            except concurrent.futures.TimeoutError:
                if cancel is not None and cancel.cancelled:
                    future.cancel()  # the SDK tells the server the request is cancelled
                    return UpstreamResult(
                        tool=spec.name, upstream=spec.upstream, error="cancelled: the call was stopped before it ended"
                    )
                if time.monotonic() > deadline:
                    future.cancel()
                    return UpstreamResult(
                        tool=spec.name,
                        upstream=spec.upstream,
                        error=f"no answer: the gateway gave up after {limit:g} s ({whose})",
                    )

    # ---------------------------------------------------------------- on the loop

    async def _reconcile(self, upstreams: tuple[UpstreamConfig, ...]) -> list[_Link]:
        wanted = {u.name: u for u in upstreams}
        stopping = [link for name, link in self._links.items() if wanted.get(name) != link.config]
        for link in stopping:
            del self._links[link.config.name]
            if link.task is not None:
                link.task.cancel()
        for link in stopping:
            if link.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await link.task
            link.state = "stopped"
        started: list[_Link] = []
        for name, config in sorted(wanted.items()):
            if name not in self._links:
                link = _Link(config=config, hub=self)
                link.task = asyncio.get_running_loop().create_task(link.run(), name=f"cacherouter-mcp-{name}")
                self._links[name] = link
                started.append(link)
        if stopping:
            self.changed()
        return started

    def changed(self) -> None:
        """Rebuild the merged tool map after a link changed, and tell the gateway (from the loop's thread)."""
        tools: dict[str, RegisteredTool] = {}
        problems: list[Problem] = []
        for name in sorted(self._links):
            link = self._links[name]
            tools.update(link.tools)
            problems.extend(link.problems)
            if link.state == "down" and link.last_error:
                problems.append(Problem(path=f"mcp:{name}", message=link.last_error))
        snapshot = MappingProxyType(tools)
        with self._lock:
            if _digests(snapshot) == _digests(self._tools) and tuple(problems) == self._problems:
                return
            self._tools, self._problems = snapshot, tuple(problems)
            self.generation += 1
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # a failing subscriber must not stop the connections
                logger.exception("MCP upstream change listener failed")
