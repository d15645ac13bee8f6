"""Sandboxes over state tvcache cannot snapshot (an MCP server process, a framework's tool, a cloud sandbox):
started fresh and stopped, never snapshotted or forked."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from ..calls import ToolSpec
from ..errors import SandboxError
from ..protocol import Sandbox, Snapshot

__all__ = ["ExternalSandboxFactory", "NoSnapshots"]


class ExternalSandboxFactory:
    """Sandboxes over state that lives outside tvcache (an MCP server process, a framework's tool, a cloud
    sandbox): they can be started fresh and stopped, never snapshotted or forked.

    The cost hints make snapshots look infinitely expensive, so the cache never asks for one; a miss after
    hits starts a fresh sandbox and replays the cached stateful calls of the path (checking each result).
    ``tools`` may be a mapping that fills in later (an MCP server's tool list is only known once listed).
    """

    def __init__(
        self,
        *,
        kind: str,
        tools: Mapping[str, ToolSpec],
        start: Callable[[], Awaitable[Sandbox]],
    ) -> None:
        self.kind = kind
        self._tools = tools
        self._start = start
        self.cost_hints: Mapping[str, float] = {"snapshot": math.inf, "fork": math.inf}

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return self._tools

    async def start(self) -> Sandbox:
        return await self._start()

    async def fork(self, snapshot: Snapshot) -> Sandbox:
        raise SandboxError(f"{self.kind} sandboxes cannot be forked (they are never snapshotted)")

    def discard(self, snapshot: Snapshot) -> None:
        """Nothing to free: this backend never snapshots."""

    def __repr__(self) -> str:
        return f"ExternalSandboxFactory(kind={self.kind!r}, tools={sorted(self._tools)})"


class NoSnapshots:
    """Mixin for sandboxes of an ``ExternalSandboxFactory``: ``snapshot`` is never called, and says so if it is."""

    async def snapshot(self, dest: Path) -> Snapshot:
        raise SandboxError(f"{type(self).__name__} cannot snapshot its state")
