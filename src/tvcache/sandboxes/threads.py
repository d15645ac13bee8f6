"""Blocking work of a sandbox backend run off the event loop, without ever leaving it running behind a caller.

``finish_in_thread`` runs a blocking step in a worker thread that a cancelled caller still waits for, so the
sandbox's lock is never released while the thread uses the sandbox; ``run_in_worker`` adds an abandon flag and a
kill for commands. An operation written as ``Steps`` (a generator yielding before each wait) can be run to its
end (``drive``, ``blocking``) or started on the event loop and finished in a thread
(``run_briefly_then_in_worker``). Shared by every backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Generator
from typing import ParamSpec, TypeVar

__all__ = ["Steps", "blocking", "drive", "finish_in_thread", "run_briefly_then_in_worker", "run_in_worker"]

T = TypeVar("T")
P = ParamSpec("P")


# A blocking operation written as a generator that yields, before each wait, the longest it may wait (seconds):
# ``drive`` runs it to its end, blocking; ``run_briefly_then_in_worker`` takes its first steps on the event loop.
Steps = Generator[float, None, T]


def drive(steps: Steps[T]) -> T:
    """Run ``steps`` to its end, waiting wherever it waits."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def blocking(steps: Callable[P, Steps[T]]) -> Callable[P, T]:
    """The operation ``steps`` makes, run to its end (``drive``) when called."""

    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        return drive(steps(*args, **kwargs))

    return run


async def run_briefly_then_in_worker(
    steps_for: Callable[[threading.Event], Steps[T]], kill_all: Callable[[], None], budget: float
) -> T:
    """``steps_for(abandon)`` on the event loop itself while its waits fit in ``budget`` seconds, the rest in a
    worker thread as ``run_in_worker``. For work that is usually done within a millisecond (a persistent shell's
    command), where the hop to a thread and back costs more than the work: the loop is held for ``budget`` at
    most, and a wait longer than what is left of it goes to the thread."""
    abandon = threading.Event()
    steps = steps_for(abandon)
    end = time.monotonic() + budget
    try:
        while next(steps) <= end - time.monotonic():
            pass
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]

    def cancel() -> None:
        abandon.set()
        kill_all()

    return await finish_in_thread(lambda: drive(steps), on_cancel=cancel)


async def run_in_worker(run: Callable[[threading.Event], T], kill_all: Callable[[], None]) -> T:
    """``run(abandon)`` in a worker thread (``finish_in_thread``). On cancellation ``abandon`` is set and the
    command killed (a thread cannot be), and the caller waits until the thread is done, so nothing still runs
    when the next call or ``stop()`` comes."""
    abandon = threading.Event()

    def cancel() -> None:
        abandon.set()
        kill_all()

    return await finish_in_thread(lambda: run(abandon), on_cancel=cancel)


async def finish_in_thread(
    work: Callable[[], T],
    *,
    on_cancel: Callable[[], object] | None = None,
    undo: Callable[[T], object] | None = None,
) -> T:
    """``work()`` in a worker thread, awaited to its end even when the caller is cancelled.

    A thread cannot be cancelled. When the caller is (once or repeatedly) while ``work`` runs, ``on_cancel`` asks
    the work to stop early (interrupt a statement, set an abandon flag, kill a command), the caller still waits
    until the thread is done, ``undo`` gets the result if the work completed anyway (close what it opened,
    remove what it wrote), and only then does the cancellation go on. So a caller holding a sandbox's lock keeps
    it until the thread no longer uses the sandbox: the next call, snapshot or ``stop()`` never overlaps it.
    Every blocking step of a sandbox backend that touches its state runs through here.
    """
    running = asyncio.ensure_future(asyncio.to_thread(work))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        while not running.done():
            with contextlib.suppress(asyncio.CancelledError):  # a second cancellation must not cut the wait short
                await asyncio.wait({running})
        if not running.cancelled() and running.exception() is None and undo is not None:
            with contextlib.suppress(Exception):
                undo(running.result())
        raise
