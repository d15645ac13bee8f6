"""A small key-value sandbox backend used by the core tests to count executions exactly.

It is a real backend (state, snapshots as JSON files, forks), just a trivial one: the real backends
(SQLite, folders) are exercised by their own contract suite and the differential tests.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

from tvcache import Outcome, SandboxError, Snapshot, ToolCall, ToolSpec, UnknownTool

# The store's own tools are deterministic by construction and declared so: the core tests count executions
# exactly, which the first-hit check of undeclared tools would change (tests of that check redeclare a tool
# through Cache(tools=...)).
TOOLS = {
    "get": ToolSpec(name="get", deterministic=True, arguments={"key": str}),
    "set": ToolSpec(name="set", deterministic=True, arguments={"key": str, "value": (str, int)}),
    "incr": ToolSpec(name="incr", deterministic=True, arguments={"key": str}),
    "keys": ToolSpec(name="keys", deterministic=True, read_only=True, arguments={}),
    "slow": ToolSpec(name="slow", deterministic=True, arguments={"key": str, "seconds": float}),
    "now": ToolSpec(name="now", deterministic=False, read_only=True, arguments={}),
    "stamp": ToolSpec(name="stamp", deterministic=False, arguments={"key": str}),
    "fail": ToolSpec(name="fail", deterministic=True, arguments={}),
    "dirty": ToolSpec(name="dirty", deterministic=True, arguments={"key": str, "seconds": float}),
    "weird": ToolSpec(name="weird", deterministic=True, arguments={}),
}
_clock = itertools.count()


class KVSandbox:
    def __init__(self, factory: KVFactory, data: dict[str, Any]) -> None:
        self.factory = factory
        self.data = data
        self.stopped = False

    async def execute(self, call: ToolCall) -> Outcome:
        if self.stopped:
            raise SandboxError("sandbox is stopped")
        spec = TOOLS.get(call.name)
        if spec is None:
            raise UnknownTool(call.name, list(TOOLS))
        self.factory.executed[call.name] += 1
        args = call.arguments
        if call.name == "fail" or self.factory.broken:
            raise RuntimeError("the sandbox broke")
        if call.name == "get":
            value = self.data.get(args["key"])
            return Outcome(output=repr(value), is_error=value is None, changed_state=False)
        if call.name == "keys":
            return Outcome(output=",".join(sorted(self.data)), changed_state=False)
        if call.name == "now":
            return Outcome(output=str(next(_clock)), changed_state=False)
        if call.name == "weird":  # output a backend forgot to decode with errors="replace"
            return Outcome(output="bad \udcff byte", changed_state=False)
        if call.name == "dirty":  # changes the state, then takes a while: a cancelled call leaves it half done
            self.data[args["key"]] = "dirty"
            await asyncio.sleep(args["seconds"])
        if call.name == "slow":
            await asyncio.sleep(args["seconds"])
        if call.name == "stamp":
            self.data[args["key"]] = next(_clock)
            return Outcome(output=f"stamped {self.data[args['key']]}", changed_state=True)
        if call.name == "set":
            self.data[args["key"]] = args["value"]
        elif call.name in ("incr", "slow", "dirty"):
            self.data[args["key"]] = int(self.data.get(args["key"], 0)) + 1
        return Outcome(output=f"{args['key']}={self.data.get(args['key'])}", changed_state=True)

    async def snapshot(self, dest: Path) -> Snapshot:
        dest.write_text(json.dumps(self.data))
        return Snapshot(kind="kv", path=str(dest), bytes=dest.stat().st_size)

    async def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.factory.live -= 1

    async def state_digest(self) -> str:
        return json.dumps(self.data, sort_keys=True)


class KVFactory:
    kind = "kv"

    def __init__(self, initial: dict[str, Any] | None = None, **cost_hints: float) -> None:
        self.initial = initial or {}
        self.executed: Counter[str] = Counter()
        self.started = 0
        self.forked = 0
        self.live = 0
        self.broken = False
        self.discarded: list[str] = []
        self.cost_hints = cost_hints

    @property
    def tools(self) -> dict[str, ToolSpec]:
        return TOOLS

    async def start(self) -> KVSandbox:
        self.started += 1
        self.live += 1
        return KVSandbox(self, dict(self.initial))

    async def fork(self, snapshot: Snapshot) -> KVSandbox:
        path = Path(snapshot.path)
        if not path.exists():
            raise SandboxError(f"snapshot {path} is gone")
        self.forked += 1
        self.live += 1
        return KVSandbox(self, json.loads(path.read_text()))

    def discard(self, snapshot: Snapshot) -> None:
        self.discarded.append(snapshot.path)
        Path(snapshot.path).unlink(missing_ok=True)


class FaultyForks(KVFactory):
    """Forking the snapshots whose paths are in ``failing`` raises ``error``: a fault of this process (a full disk)
    or data that is gone for everyone (``SnapshotUnusable``). Everything else is the real KV backend."""

    def __init__(self, error: Exception, initial: dict[str, Any] | None = None, **cost_hints: float) -> None:
        super().__init__(initial, **cost_hints)
        self.error = error
        self.failing: set[str] = set()
        self.failed: list[str] = []

    async def fork(self, snapshot: Snapshot) -> KVSandbox:
        if snapshot.path in self.failing:
            self.failed.append(snapshot.path)
            raise self.error
        return await super().fork(snapshot)
