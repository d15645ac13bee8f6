"""Running one command confined: started by the factory's zygote as PID 1 of its own namespaces, with merged,
capped output and a timeout, nothing left running after it (``run_confined``). The unconfined run, the result
type and its rendering are shared with the other backends (``sandboxes.commands``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from ..commands import DRAIN_SECONDS, OutputReader, ShellResult
from .limits import SandboxLimits
from .zygote import Spawned, SpawnError, Zygote

__all__ = ["describe_hit", "run_confined"]


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
    reader.join(DRAIN_SECONDS)
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
