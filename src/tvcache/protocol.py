"""The sandbox protocol every backend implements, and the values that cross it.

A *factory* starts fresh sandboxes and forks new ones from snapshots; a *sandbox* executes tool calls in its own
isolated state and can freeze that state into a snapshot. The cache never looks inside a sandbox or a snapshot:
it only decides when to start, fork, snapshot, replay and stop. Backends live in ``tvcache.sandboxes``.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .calls import ToolCall, ToolSpec

__all__ = ["Outcome", "Sandbox", "SandboxFactory", "SandboxWrapper", "Snapshot", "discard_snapshot_files"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """What one execution of a tool call returned.

    ``changed_state``: False when the backend *proved* the call left the state unchanged (SQLite's authorizer
    saw only reads, a folder digest did not move), True when it may have changed it, None when it cannot tell.
    ``deterministic``: False when the backend saw the call depend on something outside the state (a clock, a
    random source), so its result must never be served from cache.
    """

    output: str
    is_error: bool = False
    changed_state: bool | None = None
    deterministic: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class Snapshot:
    """A frozen sandbox state on disk, owned by the cache once returned. ``kind`` names the backend."""

    kind: str
    path: str
    bytes: int
    meta: Mapping[str, Any] = field(default_factory=dict)

    def exists(self) -> bool:
        """The snapshot's file and every layer it stacks (``meta["layers"]``) are still on disk."""
        layers = self.meta.get("layers", ())
        return Path(self.path).exists() and all(Path(layer).exists() for layer in layers)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "bytes": self.bytes, "meta": dict(self.meta)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Snapshot:
        return cls(kind=data["kind"], path=data["path"], bytes=int(data["bytes"]), meta=data.get("meta", {}))


def discard_snapshot_files(snapshot: Snapshot) -> None:
    """Default storage release: remove the snapshot's file or directory."""
    path = Path(snapshot.path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@runtime_checkable
class Sandbox(Protocol):
    """One isolated, mutable state in which tool calls run."""

    async def execute(self, call: ToolCall) -> Outcome:
        """Run one call. A tool's failure is an Outcome with ``is_error``; raise only when the sandbox broke."""
        ...

    async def snapshot(self, dest: Path) -> Snapshot:
        """Freeze the current state under ``dest`` (a path that does not exist yet); keep running afterwards."""
        ...

    async def stop(self) -> None:
        """Release everything the sandbox holds. Idempotent."""
        ...


@runtime_checkable
class SandboxFactory(Protocol):
    """Creates sandboxes of one backend and declares the tools they serve."""

    kind: str

    @property
    def tools(self) -> Mapping[str, ToolSpec]: ...

    async def start(self) -> Sandbox:
        """A sandbox in the task's initial state."""
        ...

    async def fork(self, snapshot: Snapshot) -> Sandbox:
        """A new, independent sandbox in the state frozen by ``snapshot`` (which stays valid)."""
        ...

    def discard(self, snapshot: Snapshot) -> None:
        """Free a snapshot's storage; called once the cache evicts it."""
        ...


class SandboxWrapper:
    """A sandbox that forwards everything to ``inner`` — subclass it to add behaviour around one operation
    (warm pools prepare forks after ``snapshot``; published snapshots upload it). Backend-specific extras
    (a folder sandbox's ``folder``, a shell sandbox's ``layers``) stay reachable as attributes."""

    def __init__(self, inner: Sandbox) -> None:
        self.inner = inner

    async def execute(self, call: ToolCall) -> Outcome:
        return await self.inner.execute(call)

    async def snapshot(self, dest: Path) -> Snapshot:
        return await self.inner.snapshot(dest)

    async def stop(self) -> None:
        await self.inner.stop()

    async def state_digest(self) -> str | None:
        return await state_digest(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def state_digest(sandbox: Sandbox) -> str | None:
    """The sandbox's optional state digest (None when the backend offers none)."""
    method = getattr(sandbox, "state_digest", None)
    if method is None:
        return None
    digest: str | None = await method()
    return digest
