"""``run_briefly_then_in_worker``: a quick blocking operation (written as ``Steps``) stays on the event loop, a
slow one goes on in a worker thread from where it was, and a cancelled one is stopped and waited for."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tvcache.sandboxes.threads import Steps, drive, run_briefly_then_in_worker


def waits(pauses: list[float], abandon: threading.Event, seen: list[tuple[float, int]]) -> Steps[str]:
    """Yields before each pause, then sleeps it (or stops early once abandoned); notes the thread of each."""
    for pause in pauses:
        yield pause
        seen.append((pause, threading.get_ident()))
        if abandon.wait(pause):
            return "abandoned"
    return "done"


def test_drive_runs_the_steps_to_their_end_in_the_calling_thread() -> None:
    seen: list[tuple[float, int]] = []
    assert drive(waits([0.0001, 0.0002], threading.Event(), seen)) == "done"
    assert [thread for _, thread in seen] == [threading.get_ident()] * 2


def test_steps_whose_waits_fit_the_budget_never_leave_the_event_loop() -> None:
    seen: list[tuple[float, int]] = []

    async def main() -> tuple[str, int]:
        result = await run_briefly_then_in_worker(lambda abandon: waits([0.0001] * 3, abandon, seen), lambda: None, 0.5)
        return result, threading.get_ident()

    result, loop_thread = asyncio.run(main())
    assert result == "done"
    assert [thread for _, thread in seen] == [loop_thread] * 3


def test_a_wait_beyond_the_budget_goes_on_in_a_worker_from_where_it_was() -> None:
    seen: list[tuple[float, int]] = []

    async def main() -> tuple[str, int]:
        steps = lambda abandon: waits([0.0001, 0.05, 0.0001], abandon, seen)  # noqa: E731
        result = await run_briefly_then_in_worker(steps, lambda: None, 0.01)
        return result, threading.get_ident()

    result, loop_thread = asyncio.run(main())
    assert result == "done"
    assert [pause for pause, _ in seen] == [0.0001, 0.05, 0.0001]  # each step once, in order
    assert seen[0][1] == loop_thread
    assert seen[1][1] == seen[2][1] != loop_thread


def test_a_cancelled_call_is_abandoned_killed_and_waited_for() -> None:
    killed = threading.Event()
    seen: list[tuple[float, int]] = []

    async def main() -> None:
        task = asyncio.ensure_future(
            run_briefly_then_in_worker(lambda abandon: waits([10.0], abandon, seen), killed.set, 0.001)
        )
        await asyncio.sleep(0.05)
        began = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - began < 5  # the abandon flag stopped the wait
        assert len(seen) == 1  # the thread was done when the cancellation went on

    asyncio.run(main())
    assert killed.is_set()


def test_an_error_in_a_quick_step_reaches_the_caller() -> None:
    def failing(abandon: threading.Event) -> Steps[None]:
        yield 0.0
        raise OSError("the terminal went away")

    with pytest.raises(OSError, match="terminal went away"):
        asyncio.run(run_briefly_then_in_worker(failing, lambda: None, 0.5))
