"""The sandbox protocol every backend implements, and the values that cross it.

A *factory* starts fresh sandboxes and forks new ones from snapshots; a *sandbox* executes tool calls in its own
isolated state and can freeze that state into a snapshot. The cache never looks inside a sandbox or a snapshot:
it only decides when to start, fork, snapshot, replay and stop. Backends live in ``tvcache.sandboxes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .calls import ToolCall, ToolSpec
from .errors import SandboxError

__all__ = [
    "Closable",
    "CostHinted",
    "DigestsState",
    "DiscardsForeign",
    "ForksLocally",
    "Outcome",
    "RouteCounting",
    "Sandbox",
    "SandboxFactory",
    "SandboxWrapper",
    "Snapshot",
    "close_factory",
    "cost_hints",
    "discard_snapshot_files",
    "require_new_destination",
    "route_counts",
    "snapshot_inside",
    "state_digest",
]


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


def snapshot_inside(snapshot: Snapshot, root: str | os.PathLike[str]) -> Path | None:
    """The snapshot's path with every symbolic link resolved, if it lies strictly inside ``root`` (resolved
    too); None otherwise. A snapshot record is only a claim about where storage is: whoever wrote it (another
    client of a server, an earlier process of a journal) may name any path, or a link in ``root`` leading out."""
    resolved_root = Path(os.path.realpath(root))
    resolved = Path(os.path.realpath(snapshot.path))
    if resolved == resolved_root or resolved_root not in resolved.parents:
        return None
    return resolved


def require_new_destination(dest: str | os.PathLike[str]) -> Path:
    """``dest`` as a Path, for a snapshot about to be written there; SandboxError if anything is there already,
    a dangling symbolic link included (writing through it would land wherever it points). Every backend's
    ``snapshot`` starts with it, and ``tvcache.testing.check_sandbox`` holds them to it."""
    path = Path(dest)
    if path.exists() or path.is_symlink():
        raise SandboxError(f"snapshot destination {path} already exists; pass a path that does not exist")
    return path


def discard_snapshot_files(snapshot: Snapshot, *, root: str | os.PathLike[str] | None = None) -> bool:
    """Default storage release: remove the snapshot's file or directory (a tree made read-only by a tool
    included). With ``root``, only a path that really lies inside ``root`` (``snapshot_inside``) is removed.
    Returns whether the path was the snapshot's to remove (it may have been gone already)."""
    if root is None:
        path = Path(snapshot.path)
    else:
        inside = snapshot_inside(snapshot, root)
        if inside is None:
            return False
        path = inside
    remove_tree(path)
    return True


def remove_tree(path: Path) -> None:
    """Remove a file, a link or a directory tree, directories a tool made read-only (``chmod -w``) included;
    what cannot be removed (gone already, not permitted) is left, as ``ignore_errors`` would."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    elif sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=_writable_and_retry)
    else:
        shutil.rmtree(path, onerror=_writable_and_retry)


def _writable_and_retry(function: Callable[[str], object], target: str, _: object) -> None:
    """rmtree's error handler: make a directory a tool left read-only (``chmod -w``) writable and retry once;
    anything else (gone already, not permitted) is left, as ``ignore_errors`` would."""
    with contextlib.suppress(OSError):
        os.chmod(os.path.dirname(target), 0o700)
        if os.path.isdir(target) and not os.path.islink(target):
            os.chmod(target, 0o700)
            shutil.rmtree(target, ignore_errors=True)
        else:
            function(target)


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
        """Free a snapshot's storage; called once the cache evicts it, only with a snapshot this factory made
        (the very record it returned) or one a durable cache's journal records in its own snapshot directory.

        A factory may also offer ``discard_foreign(snapshot)`` (``DiscardsForeign``): called for an evicted
        record it did not make (another process's, handed back by a server any client writes to). It must free
        nothing the record names by path; it may release what it can verify in storage of its own (a published
        snapshot's references in its store). Without it such a record is forgotten
        (``store.owners.SnapshotOwners._release_foreign``)."""
        ...


# ----- optional capabilities: what a factory or sandbox may offer beyond the protocol, each a protocol of its own
# (checked with isinstance, so a SandboxWrapper, which forwards attributes, offers what its inner sandbox does).


@runtime_checkable
class CostHinted(Protocol):
    """A factory's guesses of its costs in seconds ("start", "fork", "snapshot"), used until they are measured."""

    cost_hints: Mapping[str, float]


@runtime_checkable
class DiscardsForeign(Protocol):
    """A factory that can release what an evicted record of another process names in storage of its own (see
    ``SandboxFactory.discard``)."""

    def discard_foreign(self, snapshot: Snapshot) -> None: ...


@runtime_checkable
class ForksLocally(Protocol):
    """A factory that can tell whether forking ``snapshot`` here is cheap (its data is in this process or node)."""

    def fork_is_local(self, snapshot: Snapshot) -> bool: ...


@runtime_checkable
class RouteCounting(Protocol):
    """A factory that counts its snapshots by the route they took (persistent shells: "criu", "declined"...)."""

    def route_counts(self) -> dict[str, int]: ...


@runtime_checkable
class DigestsState(Protocol):
    """A sandbox that digests its whole state: equal for a sandbox and its forks, different once it moved on."""

    async def state_digest(self) -> str | None: ...


@runtime_checkable
class Closable(Protocol):
    """A factory to close when done: a method, or a coroutine (``WarmPool``)."""

    def close(self) -> Any: ...


def cost_hints(factory: object) -> Mapping[str, float]:
    """The factory's cost hints; none when it offers none."""
    return factory.cost_hints if isinstance(factory, CostHinted) else {}


def route_counts(factory: object) -> dict[str, int]:
    """The factory's snapshots by route; none when it does not count them."""
    return dict(factory.route_counts()) if isinstance(factory, RouteCounting) else {}


def close_factory(factory: object) -> None:
    """Close ``factory`` whatever its ``close`` is: absent (SQLite, published snapshots), a method (shell, Docker,
    folder), or a coroutine (``WarmPool``), which runs to its end here. For code outside an event loop (a
    workload's ``close``); inside one, await the factory's own ``close()``: a coroutine dropped un-awaited would
    leave its sandboxes running."""
    if not isinstance(factory, Closable):
        return
    result = factory.close()
    if inspect.isawaitable(result):
        asyncio.run(_awaited(result))


async def _awaited(result: Any) -> None:
    await result


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
    return await sandbox.state_digest() if isinstance(sandbox, DigestsState) else None
