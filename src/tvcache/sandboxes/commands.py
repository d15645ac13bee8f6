"""What every backend's ``sh`` tool shares: its specs, the fixed environment, one command run in its own process
group with capped merged output and a timeout (``run_command``), and how a result reads (``render_shell``).

Shell sandboxes run their commands confined instead (``shell.process.run_confined``), with the same result type
and rendering.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..calls import ToolCall, ToolSpec
from ..errors import InvalidToolCall, SandboxError, UnknownTool
from ..protocol import Outcome
from .threads import run_in_worker

__all__ = [
    "DRAIN_SECONDS",
    "FIXED_PATH",
    "PERSISTENT_SH_TOOL",
    "SH_TOOL",
    "OutputCollector",
    "OutputReader",
    "ShellResult",
    "command_timeout",
    "fixed_environment",
    "kill_group",
    "render_shell",
    "run_cancellable",
    "run_command",
    "sh_tools",
    "validated",
    "wait_unreaped",
]

FIXED_PATH = "/usr/local/bin:/usr/bin:/bin"
# How long to wait for the output pipe to close after the process group was killed.
DRAIN_SECONDS = 2.0
_CHUNK = 1 << 16

SH_TOOL = ToolSpec(
    name="sh",
    arguments={"cmd": str},
    optional_arguments={"timeout": (int, float)},
    read_only=False,
    deterministic=True,
    description=(
        "Run a bash command in the working folder and return its combined stdout and stderr. Each call is a "
        "fresh process: shell state and background processes do not survive the call. Optional 'timeout' in "
        "seconds (capped by the sandbox limit)."
    ),
)
# The same tool over a persistent shell (``persistent=True``): what differs is what survives a call.
PERSISTENT_SH_TOOL = replace(
    SH_TOOL,
    description=(
        "Run a bash command in the sandbox's one long-lived shell and return its combined stdout and stderr. The "
        "working directory, variables, functions and background jobs carry over to the next call. Optional "
        "'timeout' in seconds (capped by the sandbox limit)."
    ),
)


def sh_tools(*, persistent: bool) -> Mapping[str, ToolSpec]:
    """The tools of a backend whose one tool is ``sh``: one-shot, or over a persistent shell."""
    sh = PERSISTENT_SH_TOOL if persistent else SH_TOOL
    return MappingProxyType({sh.name: sh})


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


class OutputCollector:
    """The first ``limit`` bytes of a command's output, and a count of all of them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = bytearray()
        self.total = 0

    def absorb(self, step: OutputCollector, kept: bytes) -> None:
        """Add ``kept``, what remains of ``step``'s bytes, counting what ``step`` saw beyond its own limit."""
        self.add(kept)
        self.total += step.total - len(step.kept)

    def add(self, data: bytes | bytearray) -> None:
        room = self.limit - len(self.kept)
        if room > 0:
            self.kept += data[:room]
        self.total += len(data)


class OutputReader(threading.Thread):
    """Drains a pipe to EOF into an ``OutputCollector``: the first ``limit`` bytes kept, the rest counted."""

    def __init__(self, fd: int, limit: int) -> None:
        super().__init__(daemon=True)
        self._fd = fd
        self._lock = threading.Lock()
        self._collected = OutputCollector(limit)

    def run(self) -> None:
        try:
            while chunk := os.read(self._fd, _CHUNK):
                with self._lock:
                    self._collected.add(chunk)
        finally:
            os.close(self._fd)

    def result(self) -> tuple[bytes, int]:
        with self._lock:
            return bytes(self._collected.kept), self._collected.total


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
    reader.join(DRAIN_SECONDS)
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
