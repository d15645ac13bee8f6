"""Running one sandboxed command: capped merged output, a timeout, no leftovers.

Folder sandboxes run commands in their own process group (``run_command``); shell sandboxes in their own PID
namespace, started by a zygote process (``run_confined``). ``finish_in_thread`` runs any blocking step of a
backend in a worker thread that a cancelled caller still waits for, so the sandbox's lock is never released while
the thread uses the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from ...calls import ToolCall, ToolSpec
from ...errors import InvalidToolCall, SandboxError, UnknownTool
from ...protocol import Outcome
from .limits import SandboxLimits
from .zygote import Spawned, SpawnError, Zygote

T = TypeVar("T")
P = ParamSpec("P")
FIXED_PATH = "/usr/local/bin:/usr/bin:/bin"
# How long to wait for the output pipe to close after the process group was killed.
_DRAIN_SECONDS = 2.0
_CHUNK = 1 << 16


def kill_group(group: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


def wait_unreaped(process: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait up to ``timeout`` for the process to exit, without reaping it when possible.

    An unreaped child keeps its pid, which is also its process group id, so killing the group afterwards can
    never hit an unrelated group that reused the number.
    """
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: fall back to reaping, with a negligible reuse race
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(pidfd)


class OutputReader(threading.Thread):
    """Drains a pipe to EOF, keeping the first ``limit`` bytes and counting the rest."""

    def __init__(self, fd: int, limit: int) -> None:
        super().__init__(daemon=True)
        self._fd = fd
        self._limit = limit
        self._lock = threading.Lock()
        self._kept = bytearray()
        self.total = 0

    def run(self) -> None:
        try:
            while chunk := os.read(self._fd, _CHUNK):
                with self._lock:
                    room = self._limit - len(self._kept)
                    if room > 0:
                        self._kept += chunk[:room]
                    self.total += len(chunk)
        finally:
            os.close(self._fd)

    def result(self) -> tuple[bytes, int]:
        with self._lock:
            return bytes(self._kept), self.total


@dataclass(frozen=True, kw_only=True, slots=True)
class ShellResult:
    output: bytes
    total_bytes: int
    returncode: int
    timed_out: bool
    escaped: bool
    limit: str | None = None  # the limit its tree hit, as the output says it (``SandboxLimits.describe``)


def fixed_environment(home: str) -> dict[str, str]:
    """The whole environment of a sandboxed command: nothing is inherited from the host process."""
    return {"PATH": FIXED_PATH, "HOME": home, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC"}


def run_command(
    argv: list[str],
    *,
    cwd: Path | None,
    env: dict[str, str],
    timeout: float,
    limit: int,
    live_groups: set[int],
    abandon: threading.Event,
    preexec: Callable[[], None] | None = None,
) -> ShellResult:
    """Run ``argv`` in its own process group with merged, capped output; kill the group when it ends."""
    process = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=preexec,
    )
    if process.stdout is None:  # cannot happen with stdout=PIPE; narrows the type
        raise SandboxError("bash started without an output pipe")
    reader = OutputReader(os.dup(process.stdout.fileno()), limit)  # the reader owns and closes its copy
    process.stdout.close()
    live_groups.add(process.pid)
    reader.start()
    try:
        # Registered first, checked second: a canceller either finds the group in live_groups or sees abandon set.
        exited = wait_unreaped(process, 0 if abandon.is_set() else timeout)
    finally:
        kill_group(process.pid)  # always: whatever the command left running in its group goes too
        returncode = process.wait()
        live_groups.discard(process.pid)
    reader.join(_DRAIN_SECONDS)
    output, total = reader.result()
    return ShellResult(
        output=output, total_bytes=total, returncode=returncode, timed_out=not exited, escaped=reader.is_alive()
    )


def render_shell(result: ShellResult, limit: int, timeout: float) -> Outcome:
    text = result.output.decode("utf-8", errors="replace")
    notes = []
    if result.total_bytes > limit:
        notes.append(f"[output truncated: first {limit} of {result.total_bytes} bytes shown]")
    is_error, deterministic = False, True
    if result.limit is not None:
        # The tree was killed at the hit (``cgroups``); how far it got depends on timing, so neither output nor
        # state can be reproduced.
        notes.append(f"[{result.limit}]")
        is_error, deterministic = True, False
    elif result.timed_out:
        # How far the command got depends on timing, so neither output nor state can be reproduced.
        notes.append(f"[timed out after {timeout:g}s]")
        is_error, deterministic = True, False
    elif result.returncode > 0:
        notes.append(f"[exit code {result.returncode}]")
        is_error = True
    elif result.returncode < 0:
        notes.append(f"[killed by signal {-result.returncode}]")
        is_error = True
    if result.escaped:
        notes.append("[warning: a process left the command's process group and still runs]")
        deterministic = False
    if notes:
        if text and not text.endswith("\n"):
            text += "\n"
        text += "\n".join(notes)
    return Outcome(output=text, is_error=is_error, deterministic=deterministic)


def validated(call: ToolCall, tools: Mapping[str, ToolSpec]) -> tuple[ToolSpec, dict[str, Any]]:
    """The spec of a call's tool and its arguments, or UnknownTool / InvalidToolCall."""
    spec = tools.get(call.name)
    if spec is None:
        raise UnknownTool(call.name, list(tools))
    spec.validate(call)
    return spec, call.arguments


def command_timeout(arguments: Mapping[str, Any], limit: float) -> float:
    """A call's own ``timeout`` argument may lower the sandbox's limit, never raise it."""
    if "timeout" not in arguments:
        return limit
    if not arguments["timeout"] > 0:
        raise InvalidToolCall(f"tool 'sh': timeout must be > 0 seconds, got {arguments['timeout']!r}")
    return min(float(arguments["timeout"]), limit)


async def run_cancellable(argv: list[str], *, live_groups: set[int], **options: Any) -> ShellResult:
    """``run_command`` in a worker thread, killed (with its whole group) when the caller is cancelled."""

    def run(abandon: threading.Event) -> ShellResult:
        return run_command(argv, live_groups=live_groups, abandon=abandon, **options)

    def kill_all() -> None:
        for group in list(live_groups):
            kill_group(group)

    return await run_in_worker(run, kill_all)


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


def run_confined(
    zygote: Zygote,
    argv: list[str],
    *,
    env: Mapping[str, str],
    mount_fd: int,
    timeout: float,
    limit: int,
    live: set[Spawned],
    abandon: threading.Event,
    limits: SandboxLimits | None = None,
) -> ShellResult:
    """Run ``argv`` confined, started by ``zygote`` as PID 1 of a new PID namespace, with merged, capped output.

    When PID 1 ends (or is killed on timeout, or at a hit of one of its cgroup's ``limits``), the kernel kills
    everything else in its namespace before its exit is reported, so nothing the command started outlives the
    call.
    """
    read_end, write_end = os.pipe()
    try:
        spawned = zygote.spawn(argv, env=env, mount_fd=mount_fd, output_fd=write_end)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    reader = OutputReader(read_end, limit)
    reader.start()
    try:
        spawned.wait_started()
        live.add(spawned)
        # Registered first, checked second: a canceller either finds the command in live or sees abandon set.
        exited = spawned.wait(0 if abandon.is_set() else timeout)
    finally:
        spawned.kill()  # a no-op once it exited
        spawned.wait(None)
        live.discard(spawned)
        spawned.close()
    reader.join(_DRAIN_SECONDS)
    if spawned.errors or spawned.returncode is None:
        raise SpawnError(0, "; ".join(spawned.errors) or "the command was not started")
    output, total = reader.result()
    return ShellResult(
        output=output,
        total_bytes=total,
        returncode=spawned.returncode,
        timed_out=not exited,
        escaped=reader.is_alive(),
        limit=describe_hit(spawned.limit, limits),
    )


def describe_hit(kind: str | None, limits: SandboxLimits | None) -> str | None:
    """How the hit of limit ``kind`` reads in a call's output (None: no hit)."""
    if kind is None:
        return None
    return (limits or SandboxLimits()).describe(kind)
