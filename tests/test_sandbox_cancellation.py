"""A cancelled sandbox operation keeps the sandbox until its worker thread is done (real SQLite, real folders).

A worker thread cannot be cancelled: when the coroutine awaiting it is, the thread goes on using the sandbox (the
SQLite connection, the folder). If the sandbox's lock went with the coroutine, the next call would share the
connection with a backup still running (seen: 8 overlaps in 20 tries, and one SIGSEGV in libsqlite3).

The blocking steps are instrumented, not replaced: each still runs, inside a thread-safe record of which steps
are running at once. The snapshot's step is held at its start until the test lets it go, so it is provably
running when it is cancelled, and the next call is let go only once it either runs (the hazard) or provably waits
behind the cancelled snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tvcache.calls import ToolCall
from tvcache.protocol import SandboxFactory
from tvcache.sandboxes import FolderSandbox, SQLiteSandbox
from tvcache.sandboxes import folder as folder_backend
from tvcache.sandboxes import sqlite as sqlite_backend


class Occupancy:
    """Which instrumented steps run right now, recorded from the worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[str] = set()
        self.overlaps: list[tuple[str, set[str]]] = []
        self.order: list[str] = []

    @contextlib.contextmanager
    def inside(self, step: str) -> Iterator[None]:
        with self._lock:
            if self._running:
                self.overlaps.append((step, set(self._running)))
            self._running.add(step)
            self.order.append(f"{step} starts")
        try:
            yield
        finally:
            with self._lock:
                self._running.discard(step)
                self.order.append(f"{step} ends")


@dataclass(frozen=True, kw_only=True)
class Case:
    make: Callable[[Path], SandboxFactory]
    module: ModuleType
    snapshot_step: str  # the module function a snapshot runs in its worker thread
    call_step: str  # the module function the call below runs in its worker thread
    call: ToolCall
    output: str


def make_database(root: Path) -> SandboxFactory:
    path = root / "base.db"
    connection = sqlite3.connect(path)
    connection.executescript("CREATE TABLE items (name TEXT); INSERT INTO items VALUES ('apple'), ('pear');")
    connection.commit()
    connection.close()
    return SQLiteSandbox.factory(path)


def make_folder(root: Path) -> SandboxFactory:
    template = root / "template"
    template.mkdir()
    (template / "notes.txt").write_text("line one\n")
    return FolderSandbox.factory(template)


CASES = {
    "sqlite": Case(
        make=make_database,
        module=sqlite_backend,
        snapshot_step="_backup_to_file",
        call_step="_run_statement",
        call=ToolCall("sql", {"query": "SELECT count(*) FROM items"}),
        output="count(*)\n2",
    ),
    "folder": Case(
        make=make_folder,
        module=folder_backend,
        snapshot_step="_copy_folder",
        call_step="digest_folder",  # a call not declared read-only digests the folder before and after
        call=ToolCall("sh", {"cmd": "cat notes.txt"}),
        output="line one\n",
    ),
}


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Yield to the event loop until ``condition`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("backend", sorted(CASES))
def test_a_cancelled_snapshot_keeps_the_sandbox_until_its_thread_is_done(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES[backend]
    occupancy = Occupancy()
    snapshot_running, release, call_running = threading.Event(), threading.Event(), threading.Event()
    snapshot_step = getattr(case.module, case.snapshot_step)
    call_step = getattr(case.module, case.call_step)

    def held_snapshot_step(*args: Any, **kwargs: Any) -> Any:
        with occupancy.inside("snapshot"):
            snapshot_running.set()
            release.wait(10)
            return snapshot_step(*args, **kwargs)

    def recorded_call_step(*args: Any, **kwargs: Any) -> Any:
        with occupancy.inside("call"):
            call_running.set()
            return call_step(*args, **kwargs)

    dest = tmp_path / "snapshot"

    async def main() -> str:
        sandbox = await case.make(tmp_path).start()
        monkeypatch.setattr(case.module, case.snapshot_step, held_snapshot_step)
        monkeypatch.setattr(case.module, case.call_step, recorded_call_step)
        snapshot = asyncio.create_task(sandbox.snapshot(dest))
        assert await asyncio.to_thread(snapshot_running.wait, 10)
        for _ in range(2):  # a second cancellation must not cut the wait for the thread short either
            snapshot.cancel()
            for _ in range(20):  # event loop turns (no clock): the cancellation reaches the snapshot in one or two
                await asyncio.sleep(0)
        call = asyncio.create_task(sandbox.execute(case.call))
        await until(lambda: call_running.is_set() or not snapshot.done())
        release.set()
        outcome = await call
        with pytest.raises(asyncio.CancelledError):
            await snapshot
        await sandbox.stop()
        return outcome.output

    output = asyncio.run(main())
    assert occupancy.overlaps == [], f"the call ran while the cancelled snapshot's thread still did: {occupancy.order}"
    assert occupancy.order[:3] == ["snapshot starts", "snapshot ends", "call starts"]
    assert output == case.output
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith("snapshot")) == []  # no orphan


def test_a_cancelled_sqlite_snapshot_of_a_large_database_leaves_no_file_and_the_sandbox_as_it_was(
    tmp_path: Path,
) -> None:
    """No instrumentation: a real backup many steps of ``_BACKUP_PAGES`` long, cancelled once it is provably
    copying (its file has grown). It stops at its next step; nothing is left under either name."""
    path = tmp_path / "large.db"
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE blobs (b BLOB)")
    rows = 8192  # one 4000-byte blob a page: 32 MiB, many backup steps
    connection.executemany("INSERT INTO blobs VALUES (zeroblob(4000))", [()] * rows)
    connection.commit()
    connection.close()
    dest = tmp_path / "snapshot"
    partial = dest.with_name(dest.name + ".partial")

    async def main() -> None:
        sandbox = await SQLiteSandbox.factory(path).start()
        try:
            snapshot = asyncio.create_task(sandbox.snapshot(dest))
            await until(lambda: partial.exists() and partial.stat().st_size > 0)
            snapshot.cancel()
            with pytest.raises(asyncio.CancelledError):
                await snapshot
            assert not dest.exists()
            assert not partial.exists()
            outcome = await sandbox.execute(ToolCall("sql", {"query": "SELECT count(*) FROM blobs"}))
            assert outcome.output == f"count(*)\n{rows}"
            assert (await sandbox.snapshot(dest)).bytes == dest.stat().st_size  # a later snapshot still works
        finally:
            await sandbox.stop()

    asyncio.run(main())


FORK_STEPS = {"sqlite": "_open_copy", "folder": "_copy_folder"}


@pytest.mark.parametrize("backend", sorted(CASES))
def test_a_cancelled_fork_returns_only_once_the_snapshot_is_no_longer_read(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller of a fork may release (and so evict and delete) the snapshot as soon as the fork returns, even
    cancelled: the copying thread must be done by then, and the copy it made is not left behind."""
    case = CASES[backend]
    occupancy = Occupancy()
    copying, release = threading.Event(), threading.Event()
    fork_step = getattr(case.module, FORK_STEPS[backend])

    def held_fork_step(*args: Any, **kwargs: Any) -> Any:
        with occupancy.inside("fork"):
            copying.set()
            release.wait(10)
            return fork_step(*args, **kwargs)

    async def main() -> tuple[bool, list[str]]:
        factory = case.make(tmp_path)
        sandbox = await factory.start()
        snapshot = await sandbox.snapshot(tmp_path / "snapshot")
        await sandbox.stop()
        monkeypatch.setattr(case.module, FORK_STEPS[backend], held_fork_step)
        fork = asyncio.create_task(factory.fork(snapshot))
        assert await asyncio.to_thread(copying.wait, 10)
        fork.cancel()
        for _ in range(20):  # event loop turns (no clock): the cancellation reaches the fork in one or two
            await asyncio.sleep(0)
        returned_while_copying = fork.done()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await fork
        left = sorted(path.name for path in getattr(factory, "root", tmp_path / "none").glob("sandbox-*"))
        return returned_while_copying, left

    returned_while_copying, left = asyncio.run(main())
    assert not returned_while_copying, "the cancelled fork returned while its thread still read the snapshot"
    assert occupancy.order == ["fork starts", "fork ends"]
    assert left == []  # the folder copy the cancelled fork made is removed
