"""A cancelled shell sandbox operation keeps the sandbox until its worker thread is done (real overlays, real bash).

The shell twin of ``test_sandbox_cancellation``: a worker thread cannot be cancelled, so when the coroutine awaiting
a freeze, a digest or a teardown is (once, or again while it waits), the thread goes on using the sandbox's upper
and mount. If the lock went with the coroutine, the next call would run on a mount being frozen, or on a
descriptor being closed under it; a fork cancelled twice would leave the sandbox it built mounted, holding its
layers. The blocking steps are instrumented, not replaced: each still runs, inside a record of which steps run at
once, and the cancelled one is held at its start until the test lets it go, so it provably runs when cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tvcache.calls import ToolCall
from tvcache.errors import SandboxError
from tvcache.sandboxes import ShellSandbox, ShellSandboxFactory
from tvcache.sandboxes.shell import process as _process
from tvcache.sandboxes.shell import sandbox as shell_module
from tvcache.sandboxes.shell.linux import overlay_supported
from tvcache.sandboxes.shell.overlay import OverlaySandbox
from tvcache.sandboxes.shell.persistent import PersistentShellSandbox

pytestmark = pytest.mark.skipif(not overlay_supported(), reason="shell sandboxes need overlay mounts (root)")

CALL = ToolCall("sh", {"cmd": "cat notes.txt"})
CANCELLATIONS = 2  # a second cancellation must not cut the wait for the thread short either


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


class Held:
    """Wraps a blocking step (``function``, a plain function, so it binds as the method it replaces): records
    it, and holds its first run at its start until ``release`` is set."""

    def __init__(self, occupancy: Occupancy, step: str, original: Callable[..., Any]) -> None:
        self.running, self.release = threading.Event(), threading.Event()
        first = [True]

        def function(*args: Any, **kwargs: Any) -> Any:
            with occupancy.inside(step):
                if first[0]:
                    first[0] = False
                    self.running.set()
                    assert self.release.wait(10), "the test never released the held step"
                return original(*args, **kwargs)

        self.function = function


def recorded(occupancy: Occupancy, step: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def record(*args: Any, **kwargs: Any) -> Any:
        with occupancy.inside(step):
            return original(*args, **kwargs)

    return record


def recorded_steps(occupancy: Occupancy, step: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``recorded`` for an operation written as steps (``process.Steps``): inside from its first step to its end,
    on the event loop or in a worker."""

    def record(*args: Any, **kwargs: Any) -> Any:
        with occupancy.inside(step):
            return (yield from original(*args, **kwargs))

    return record


def make_factory(tmp_path: Path, *, persistent: bool) -> ShellSandboxFactory:
    base = tmp_path / "base"
    base.mkdir()
    (base / "notes.txt").write_text("line one\n")
    store = tmp_path / "layers"
    if persistent:
        factory = ShellSandbox.factory(base, fallback=False, store_root=store, persistent=True)
    else:  # without the keyword, so that this file also runs against shell.py before persistent shells
        factory = ShellSandbox.factory(base, fallback=False, store_root=store)
    assert isinstance(factory, ShellSandboxFactory)
    return factory


def instrument_calls(monkeypatch: pytest.MonkeyPatch, occupancy: Occupancy, *, persistent: bool) -> None:
    """Record when each flavour runs a command: bash -c under run_confined, or the live shell's steps."""
    if persistent:
        original = PersistentShellSandbox._command_steps
        monkeypatch.setattr(PersistentShellSandbox, "_command_steps", recorded_steps(occupancy, "call", original))
    else:
        monkeypatch.setattr(shell_module, "run_confined", recorded(occupancy, "call", _process.run_confined))


async def cancel_repeatedly(task: asyncio.Task[Any]) -> None:
    for _ in range(CANCELLATIONS):
        task.cancel()
        for _ in range(20):  # event loop turns (no clock): the cancellation reaches the task in one or two
            await asyncio.sleep(0)


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Yield to the event loop until ``condition`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.001)


def leftovers(factory: ShellSandboxFactory) -> tuple[list[str], list[str]]:
    """Layers still referenced, and upper directories still on disk: both empty once everything is released."""
    uppers = sorted(path.name for path in (factory.store.directory / "uppers").iterdir())
    return [str(layer.path) for layer in factory.store.live_layers()], uppers


# The persistent flavour's snapshot and digest are its own (its shell is captured around the same steps).
@pytest.mark.parametrize("persistent", [False, True], ids=["one-shot", "persistent"])
@pytest.mark.parametrize("operation", ["snapshot", "state_digest"])
def test_a_cancelled_snapshot_or_digest_keeps_the_sandbox_until_its_thread_is_done(
    operation: str, persistent: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    occupancy = Occupancy()
    factory = make_factory(tmp_path, persistent=persistent)
    step = {"snapshot": "_freeze", "state_digest": "_state_digest"}[operation]
    held = Held(occupancy, operation, getattr(OverlaySandbox, step))
    dest = tmp_path / "snapshot"

    async def main() -> str:
        sandbox = await factory.start()
        monkeypatch.setattr(OverlaySandbox, step, held.function)  # both kinds freeze and digest there
        instrument_calls(monkeypatch, occupancy, persistent=persistent)
        work: asyncio.Task[Any]
        if operation == "snapshot":
            work = asyncio.create_task(sandbox.snapshot(dest))
        else:
            work = asyncio.create_task(sandbox.state_digest())
        assert await asyncio.to_thread(held.running.wait, 10)
        await cancel_repeatedly(work)
        call = asyncio.create_task(sandbox.execute(CALL))
        # The hazard shows as the call running; the fix as the cancelled operation still waiting for its thread.
        await until(lambda: "call starts" in occupancy.order or not work.done())
        held.release.set()
        outcome = await call
        with pytest.raises(asyncio.CancelledError):
            await work
        await sandbox.stop()
        return outcome.output

    output = asyncio.run(main())
    assert (
        occupancy.overlaps == []
    ), f"the call ran while the cancelled {operation}'s thread still did: {occupancy.order}"
    assert occupancy.order[:3] == [f"{operation} starts", f"{operation} ends", "call starts"]
    assert output == "line one\n"
    assert not dest.exists()  # a cancelled snapshot that froze anyway writes no snapshot file
    assert leftovers(factory) == ([], [])  # and takes no references the cache would never release
    factory.close()


@pytest.mark.parametrize("persistent", [False, True], ids=["one-shot", "persistent"])
def test_a_cancelled_stop_finishes_before_another_call_gets_the_sandbox(
    persistent: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call let in while the teardown's thread closes the mount would run on a descriptor closed (or reused)
    under it; kept out, it finds the sandbox stopped."""
    occupancy = Occupancy()
    factory = make_factory(tmp_path, persistent=persistent)

    async def main() -> None:
        sandbox = await factory.start()
        owner = type(sandbox)
        held = Held(occupancy, "stop", owner._teardown)
        monkeypatch.setattr(owner, "_teardown", held.function)
        instrument_calls(monkeypatch, occupancy, persistent=persistent)
        stop = asyncio.create_task(sandbox.stop())
        assert await asyncio.to_thread(held.running.wait, 10)
        await cancel_repeatedly(stop)
        call = asyncio.create_task(sandbox.execute(CALL))
        await until(lambda: "call starts" in occupancy.order or not stop.done())
        held.release.set()
        with pytest.raises(SandboxError, match="stopped"):
            await call
        with pytest.raises(asyncio.CancelledError):
            await stop
        await sandbox.stop()  # idempotent: the cancelled stop did finish

    asyncio.run(main())
    assert occupancy.overlaps == [], f"a call ran while the cancelled stop still tore down: {occupancy.order}"
    assert occupancy.order == ["stop starts", "stop ends"]
    assert leftovers(factory) == ([], [])
    factory.close()


@pytest.mark.parametrize("persistent", [False, True], ids=["one-shot", "persistent"])
def test_a_cancelled_fork_returns_only_once_its_sandbox_is_built_and_torn_down(
    persistent: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller of a fork may release (and so evict) the snapshot as soon as the fork returns, even cancelled:
    the building thread must be done by then, and the sandbox it built unmounted, with its references gone."""
    occupancy = Occupancy()
    factory = make_factory(tmp_path, persistent=persistent)
    held = Held(occupancy, "fork", ShellSandboxFactory._make)

    async def main() -> bool:
        origin = await factory.start()
        assert not (await origin.execute(ToolCall("sh", {"cmd": "echo two >> notes.txt"}))).is_error
        snapshot = await origin.snapshot(tmp_path / "snapshot")
        await origin.stop()
        monkeypatch.setattr(ShellSandboxFactory, "_make", held.function)
        fork = asyncio.create_task(factory.fork(snapshot))
        assert await asyncio.to_thread(held.running.wait, 10)
        await cancel_repeatedly(fork)
        returned_while_building = fork.done()
        held.release.set()
        with pytest.raises(asyncio.CancelledError):
            await fork
        factory.discard(snapshot)  # what the cache does with a snapshot it evicts
        return returned_while_building

    returned_while_building = asyncio.run(main())
    assert not returned_while_building, "the cancelled fork returned while its thread still built the sandbox"
    assert occupancy.order == ["fork starts", "fork ends"]
    assert leftovers(factory) == ([], [])  # the sandbox the cancelled fork built is gone, and its layers with it
    factory.close()
