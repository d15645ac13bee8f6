"""verifiers v1 (``verifiers.v1``): the tools of a ``vf.Toolset`` cached through tvcache's MCP proxy. See
``tvcache.integrations.verifiers`` for the design, what is cached and how tasks are keyed.

The chain of one rollout: the harness's MCP client -> (streamable HTTP) ``CachedToolset``, the per-rollout tool
server verifiers launches, which holds one connection to our MCP proxy (``CachingProxy``, in its process), so one
tvcache session -> (stdio) the user's toolset (``_verifiers_stdio``), started by the proxy only when a call misses.
The proxy runs in the tool server's process rather than as ``tvcache mcp-proxy``: one process fewer per rollout,
and its upstream is reached through the SDK's ``stdio_client`` transport, which every mcp 2.x takes (verifiers
0.4 pins mcp 2.0.0, whose ``Client`` does not take server parameters as the proxy's CLI path passes them).

Run as ``python -m tvcache.integrations._verifiers_v1`` (as verifiers launches every toolset), it serves a
``CachedToolset``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from .cache_location import CacheLike
from .optional_imports import require

v1: Any = require("verifiers.v1", "verifiers")
_mcp: Any = require("mcp", "verifiers")
_stdio: Any = require("mcp.client.stdio", "verifiers")
_task_key: Any = require("verifiers.v1.task", "verifiers").task_key

from . import _verifiers_stdio as upstream  # noqa: E402
from .mcp_proxy import CachingProxy, ProxySettings, UpstreamSandbox, open_proxy_cache, parse_location  # noqa: E402

__all__ = ["CachedToolset", "CachedToolsetConfig", "toolset_task_id"]

# What the toolset server inherits that must not reach the user's toolset: verifiers' state channel and bind
# controls (the proxy's upstream serves stdio, and never syncs the rollout's State).
_CONTROLS = frozenset({"VF_CONFIG", "VF_STATE_URL", "VF_STATE_SECRET", "MCP_HOST", "MCP_PORT", "MCP_PORT_FILE"})


class _InProcessProxy(CachingProxy):
    """Our MCP proxy for one rollout, its upstream started through the SDK's stdio transport."""

    async def _start_upstream(self) -> UpstreamSandbox:
        self._count_start()
        command = self.settings.command
        transport = _stdio.stdio_client(self.settings.server_parameters())
        return await UpstreamSandbox(transport, describe=" ".join(command)).open()


class CachedToolsetConfig(v1.ToolsetConfig):  # type: ignore[misc]
    """``toolset``: the ``module:Class`` of the ``vf.Toolset`` to cache, ``toolset_config`` its config (JSON
    values). ``cache``: where the graphs live — a ``tvcache serve`` URL (or comma-separated URLs of shards),
    which every rollout's proxy process shares; a directory serves one process at a time. ``read_only``: tools
    that never change the toolset's state (keyed by the state they read); ``deterministic`` / ``uncached``:
    declare tools deterministic (their first hit per task is not re-checked) or never served from cache;
    ``audit_rate``: the fraction of hits re-executed in a fresh toolset and compared; ``sandbox_dir``: run the
    toolset confined on an overlay of this directory, so each rollout starts from it as it is (root)."""

    toolset: str
    toolset_config: dict[str, Any] = {}
    cache: str
    read_only: list[str] = []
    deterministic: list[str] = []
    uncached: list[str] = []
    audit_rate: float = 0.0
    sandbox_dir: str | None = None


def toolset_task_id(server_name: str, task: Any) -> str:
    """The task of a rollout's tool calls: the toolset's name and the task's durable ``id`` when its data has
    one, else the content hash verifiers records as the trace's ``task.hash`` (stable across epochs)."""
    identity = task.id or _task_key(task.model_dump(mode="json", exclude_none=True))
    return f"verifiers:{server_name}:{identity}"


class CachedToolset(v1.Toolset[CachedToolsetConfig]):  # type: ignore[misc]
    """A ``vf.Toolset`` that serves another toolset's tools through ``tvcache mcp-proxy``: declare it in
    ``Task.toolsets`` (one server per rollout) in place of the toolset it caches. Its tools carry the cached
    toolset's names, descriptions and schemas, as listed by that toolset."""

    def __init__(self, config: CachedToolsetConfig) -> None:
        super().__init__(config)
        inner = upstream.import_ref(config.toolset)
        self.cached = inner(inner._config_cls().model_validate(config.toolset_config))
        if self.cached._state_cls is not v1.State:
            raise v1.ToolsetError(
                f"{config.toolset} reads or writes the rollout's State ({self.cached._state_cls.__name__}), so its "
                "results depend on more than its own calls: it cannot be cached"
            )
        self.client: Any = None

    @property
    def server_name(self) -> str:
        name: str = self.cached.server_name
        return name

    async def setup_task(self, task: Any) -> None:
        """Connect this rollout to the proxy: one connection, one tvcache session of the task's graph."""
        settings = self._settings(task)
        cache: CacheLike = open_proxy_cache(settings)
        self._exit_stack.callback(cache.close)  # after the connection below ends (the stack unwinds in reverse)
        proxy = _InProcessProxy(settings, cache)
        self.client = await self._exit_stack.enter_async_context(_mcp.Client(proxy.server, cache=None))

    def register(self, mcp: Any) -> None:
        mcp.list_tools = self.list_tools
        mcp.call_tool = self.call_tool

    async def list_tools(self) -> list[Any]:
        tools: list[Any] = []
        cursor = None
        while True:
            page = await self._connected().list_tools(cursor=cursor)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                return tools

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        return await self._connected().call_tool(name, arguments)

    # ------------------------------------------------------------------ internals

    def _connected(self) -> Any:
        if self.client is None:
            raise v1.ToolsetError(
                "CachedToolset has no task: declare it in Task.toolsets (one server per rollout), not in "
                "Taskset.toolsets (shared by every rollout, so no rollout's history keys its calls)"
            )
        return self.client

    def _settings(self, task: Any) -> ProxySettings:
        config = self.config
        return ProxySettings(
            command=[sys.executable, "-m", upstream.__name__],
            task_id=toolset_task_id(self.server_name, task),
            cache=parse_location(config.cache),
            token=os.environ.get("TVCACHE_TOKEN") or None,
            uncached=frozenset(config.uncached),
            deterministic=frozenset(config.deterministic),
            audit_rate=config.audit_rate,
            env=self._env(task),
            sandbox_dir=config.sandbox_dir,
        )

    def _env(self, task: Any) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if key not in _CONTROLS}
        env[upstream.TOOLSET] = self.config.toolset
        env[upstream.CONFIG] = json.dumps(self.config.toolset_config)
        env[upstream.READ_ONLY] = json.dumps(self.config.read_only)
        cls = type(task)
        env[upstream.TASK] = json.dumps({"cls": f"{cls.__module__}:{cls.__qualname__}", "task": task.model_dump_json()})
        return env


if __name__ == "__main__":
    CachedToolset.run()
