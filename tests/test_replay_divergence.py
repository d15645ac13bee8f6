"""A replay that meets a non-deterministic call still applies the rest of the history (issue 19, item 1).

Found with ``mcp-server-git`` behind the proxy: a replayed ``git_commit`` got a new hash, the replay stopped there,
the cached branch and checkout after it were never applied, and the next live call ran on the wrong branch. Here
every backend gets a planted tool of that kind in mid-prefix: a real state-changing call whose output carries a
fresh counter (as a commit prints a fresh hash), mis-declared deterministic so that only the replay can see it.
"""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tvcache import Cache, NeverSnapshot, NondeterminismWarning, Outcome, Sandbox, Snapshot, ToolCall, ToolSpec
from tvcache.graph import Node, ToolCallGraph
from tvcache.policies import CostModel
from tvcache.protocol import SandboxFactory, SandboxWrapper
from tvcache.sandboxes import FolderSandbox, SQLiteSandbox
from tvcache.sandboxes.shell.linux import overlay_supported

STAMP = ToolSpec(name="stamp", deterministic=True)  # a lie, as a proxy's declaration of git_commit would be


@dataclass(frozen=True)
class Backend:
    factory: SandboxFactory
    write: Callable[[str], ToolCall]
    read: ToolCall  # the live read after the divergence: must see every write of the history
    other_read: ToolCall


def sqlite_backend(tmp_path: Path) -> Backend:
    path = tmp_path / "base.sqlite"
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE items (name TEXT PRIMARY KEY)")
    connection.commit()
    connection.close()
    return Backend(
        factory=SQLiteSandbox.factory(path),
        write=lambda name: ToolCall("sql", {"query": f"INSERT INTO items VALUES ('{name}')"}),
        read=ToolCall("sql", {"query": "SELECT name FROM items ORDER BY name"}),
        other_read=ToolCall("sql", {"query": "SELECT COUNT(*) FROM items"}),
    )


def _template(path: Path) -> Path:
    (path / "items").mkdir(parents=True)
    return path


def folder_backend(tmp_path: Path) -> Backend:
    return Backend(
        factory=FolderSandbox.factory(_template(tmp_path / "template")),
        write=lambda name: ToolCall("sh", {"cmd": f"echo {name} > items/{name}"}),
        read=ToolCall("sh", {"cmd": "ls items"}),
        other_read=ToolCall("sh", {"cmd": "ls items | wc -l"}),
    )


def shell_backend(tmp_path: Path) -> Backend:
    from tvcache.sandboxes import ShellSandbox

    if not overlay_supported():
        pytest.skip("overlay mounts need root on Linux >= 6.8; the shell backend falls back to FolderSandbox")
    return Backend(
        factory=ShellSandbox.factory(_template(tmp_path / "base"), fallback=False),
        write=lambda name: ToolCall("sh", {"cmd": f"echo {name} > items/{name}"}),
        read=ToolCall("sh", {"cmd": "ls items"}),
        other_read=ToolCall("sh", {"cmd": "ls items | wc -l"}),
    )


class StampingSandbox(SandboxWrapper):
    """The real sandbox, plus ``stamp``: the backend's own write of a fixed item, answering with a fresh count."""

    def __init__(self, inner: Sandbox, factory: Stamping) -> None:
        super().__init__(inner)
        self.factory = factory

    async def execute(self, call: ToolCall) -> Outcome:
        if call.name != STAMP.name:
            return await self.inner.execute(call)
        outcome = await self.inner.execute(self.factory.backend.write("stamp"))
        return Outcome(output=f"{outcome.output}stamp #{next(self.factory.counter)}", changed_state=True)


class Stamping:
    """The backend's factory with the planted tool added; everything else is the backend's own."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.inner = backend.factory
        self.kind = self.inner.kind
        self.counter = itertools.count()

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return {**self.inner.tools, STAMP.name: STAMP}

    async def start(self) -> Sandbox:
        return StampingSandbox(await self.inner.start(), self)

    async def fork(self, snapshot: Snapshot) -> Sandbox:
        return StampingSandbox(await self.inner.fork(snapshot), self)

    def discard(self, snapshot: Snapshot) -> None:
        self.inner.discard(snapshot)


@dataclass(frozen=True)
class SnapshotFirstState:
    """Snapshot only the first state of the path: a miss deeper down forks it and replays the rest."""

    name: str = "first-state"

    def should_snapshot(self, graph: ToolCallGraph, node: Node, costs: CostModel) -> bool:
        return not node.read_only and node.snapshot is None and node.depth == 1


@pytest.fixture(params=[sqlite_backend, folder_backend, shell_backend], ids=["sqlite", "folder", "shell"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    make: Callable[[Path], Backend] = request.param
    return make(tmp_path)


async def uncached(factory: Stamping, calls: list[ToolCall]) -> list[str]:
    sandbox = await factory.start()
    try:
        return [(await sandbox.execute(call)).output for call in calls]
    finally:
        await sandbox.stop()


async def through(cache: Cache, factory: Stamping, calls: list[ToolCall]) -> list[Any]:
    async with cache.session("task", sandbox=factory) as session:
        return [await session.call(call.name, call.arguments) for call in calls]


@pytest.mark.parametrize("snapshots", [NeverSnapshot(), SnapshotFirstState()], ids=["fresh-start", "fork"])
def test_a_diverging_replay_still_applies_the_rest_of_the_history(backend: Backend, snapshots: Any) -> None:
    factory = Stamping(backend)
    write = backend.write
    prefix = [write("a"), ToolCall("stamp"), write("b"), write("c")]
    cache = Cache(snapshot_policy=snapshots)
    asyncio.run(through(cache, factory, [*prefix, backend.read]))
    # The same prefix, then a call never seen in that state: the miss replays the prefix, whose stamp diverges.
    history = [*prefix, backend.other_read, write("d"), backend.read]
    with pytest.warns(NondeterminismWarning, match="'stamp' is non-deterministic in task 'task'"):
        results = asyncio.run(through(cache, factory, history))
    truth = asyncio.run(uncached(factory, history))
    assert [r.hit for r in results[:4]] == [True] * 4
    # What ran after the divergence ran where uncached execution of the same calls runs: after b and c too.
    assert [r.output for r in results[4:]] == truth[4:]
    assert [r.cached for r in results[4:]] == [False] * 3  # and off the cached paths, as before
    assert cache.stats().replay_divergences == 1
    cache.check_invariants()
    cache.close()
