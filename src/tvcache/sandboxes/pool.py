"""Warm pools: sandboxes made ready ahead of time, off the critical path (the paper's proactive, reactive and
background forking).

``WarmPool(factory, roots=N, forks_per_snapshot=K)`` wraps any backend's factory and serves the same protocol:

* **proactive**: it keeps ``roots`` freshly started sandboxes ready; ``start()`` hands one out at once;
* **background instantiation**: when a sandbox it served takes a snapshot, ``forks_per_snapshot`` forks of
  that snapshot are created in the background, ready for the next rollout that resumes there;
* **reactive**: ``fork()`` hands out a ready fork of the snapshot when there is one, and forks on the critical
  path otherwise.

``stats`` counts how often a ready sandbox was there when needed. ``close()`` stops every ready sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..calls import ToolSpec
from ..protocol import DiscardsForeign, Sandbox, SandboxFactory, SandboxWrapper, Snapshot, cost_hints

__all__ = ["PoolStats", "WarmPool"]


@dataclass(kw_only=True)
class PoolStats:
    ready_starts: int = 0
    cold_starts: int = 0
    ready_forks: int = 0
    cold_forks: int = 0
    prepared: int = 0
    wasted: int = 0  # prepared but stopped unused (snapshot discarded, pool closed)

    @property
    def ready_rate(self) -> float:
        """Share of starts and forks served by a sandbox prepared ahead of time."""
        ready = self.ready_starts + self.ready_forks
        total = ready + self.cold_starts + self.cold_forks
        return ready / total if total else 0.0


class _PooledSandbox(SandboxWrapper):
    """A sandbox served by the pool: snapshots it takes get forks prepared in the background."""

    def __init__(self, pool: WarmPool, inner: Sandbox) -> None:
        super().__init__(inner)
        self._pool = pool

    async def snapshot(self, dest: Path) -> Snapshot:
        snapshot = await self.inner.snapshot(dest)
        self._pool._prepare_forks(snapshot)
        return snapshot


class WarmPool:
    """A factory that keeps sandboxes ready ahead of demand. Use it wherever a factory is expected."""

    def __init__(self, factory: SandboxFactory, *, roots: int = 2, forks_per_snapshot: int = 1) -> None:
        if roots < 0 or forks_per_snapshot < 0:
            raise ValueError("roots and forks_per_snapshot must be >= 0")
        self.factory = factory
        self.kind = factory.kind
        self.roots = roots
        self.forks_per_snapshot = forks_per_snapshot
        self.stats = PoolStats()
        self.cost_hints: Mapping[str, float] = cost_hints(factory)
        self._ready_roots: list[Sandbox] = []
        self._ready_forks: dict[str, list[Sandbox]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._discarded: set[str] = set()
        self._closed = False

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return self.factory.tools

    async def start(self) -> Sandbox:
        self._refill_roots()
        if self._ready_roots:
            self.stats.ready_starts += 1
            sandbox = self._ready_roots.pop()
            self._refill_roots()
            return _PooledSandbox(self, sandbox)
        self.stats.cold_starts += 1
        return _PooledSandbox(self, await self.factory.start())

    async def fork(self, snapshot: Snapshot) -> Sandbox:
        ready = self._ready_forks.get(snapshot.path)
        if ready:
            self.stats.ready_forks += 1
            sandbox = ready.pop()
            self._prepare_forks(snapshot)  # keep one ready for the next rollout resuming here
            return _PooledSandbox(self, sandbox)
        self.stats.cold_forks += 1
        return _PooledSandbox(self, await self.factory.fork(snapshot))

    def discard(self, snapshot: Snapshot) -> None:
        self._stop_ready_forks(snapshot)
        self.factory.discard(snapshot)

    def discard_foreign(self, snapshot: Snapshot) -> None:
        """An evicted snapshot this process did not make: stop the forks kept ready for it (the pool's own
        sandboxes), and let the wrapped factory release what it can verify
        (``store.owners.SnapshotOwners._release_foreign``)."""
        self._stop_ready_forks(snapshot)
        if isinstance(self.factory, DiscardsForeign):
            self.factory.discard_foreign(snapshot)

    def _stop_ready_forks(self, snapshot: Snapshot) -> None:
        self._discarded.add(snapshot.path)
        for sandbox in self._ready_forks.pop(snapshot.path, []):
            self.stats.wasted += 1
            self._spawn(sandbox.stop())

    async def prepare(self) -> None:
        """Fill the pool of root sandboxes now (e.g. before a training step) and wait until it is full."""
        self._refill_roots()
        await self.drain()

    async def drain(self) -> None:
        """Wait for the background work in flight."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Stop every ready sandbox and wait for background work. Idempotent."""
        self._closed = True
        await self.drain()
        ready = self._ready_roots + [sandbox for group in self._ready_forks.values() for sandbox in group]
        self._ready_roots, self._ready_forks = [], {}
        self.stats.wasted += len(ready)
        for sandbox in ready:
            with contextlib.suppress(Exception):
                await sandbox.stop()

    # ---------------------------------------------------------- background

    def _refill_roots(self) -> None:
        pending = sum(1 for task in self._tasks if task.get_name() == "root")
        for _ in range(self.roots - len(self._ready_roots) - pending):
            self._spawn(self._make_root(), name="root")

    def _prepare_forks(self, snapshot: Snapshot) -> None:
        have = len(self._ready_forks.get(snapshot.path, []))
        pending = sum(1 for task in self._tasks if task.get_name() == snapshot.path)
        for _ in range(self.forks_per_snapshot - have - pending):
            self._spawn(self._make_fork(snapshot), name=snapshot.path)

    async def _make_root(self) -> None:
        sandbox = await self.factory.start()
        if self._closed:
            await sandbox.stop()
            return
        self.stats.prepared += 1
        self._ready_roots.append(sandbox)

    async def _make_fork(self, snapshot: Snapshot) -> None:
        try:
            sandbox = await self.factory.fork(snapshot)
        except Exception:  # the snapshot went away meanwhile: nothing to prepare
            return
        if self._closed or snapshot.path in self._discarded:
            await sandbox.stop()
            return
        self.stats.prepared += 1
        self._ready_forks.setdefault(snapshot.path, []).append(sandbox)

    def _spawn(self, work: Any, *, name: str = "stop") -> None:
        if self._closed and name != "stop":
            work.close()
            return
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
