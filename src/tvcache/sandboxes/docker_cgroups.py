"""A container's limit hits, read on this machine: the counters of its cgroups (``ContainerCounters``), found once
per container from its main process (``container_counters``).

The engine runs here (a documented requirement of docker sandboxes), so the cgroups the engine made for a
container are files of this machine's cgroup mounts: on cgroup v1, one directory in the ``memory`` and one in the
``pids`` hierarchy (``memory.oom_control``: ``oom_kill N``; ``pids.events``: ``max N``); on v2, one directory
(``memory.events``: ``oom_kill N``; ``pids.events``: ``max N``). Reading two small files takes a few microseconds,
so a sandbox reads them around every call — against ~75 ms for a ``docker exec`` into the container to ask.

A hybrid host (v1 hierarchies, and an empty cgroup2 mount beside them, as here) is read as v1: a controller's v1
line in ``/proc/<pid>/cgroup`` wins over the ``0::`` line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .shell.cgroups import MEMORY, PIDS, cgroup_mounts, counter_fields, read_small_file

__all__ = ["ContainerCounters", "container_counters"]

# The file counting OOM kills, by cgroup version; pids.events is the same on both.
_V1_MEMORY, _V2_MEMORY, _PIDS = "memory.oom_control", "memory.events", "pids.events"


@dataclass(frozen=True, kw_only=True, slots=True)
class ContainerCounters:
    """The files counting one container's OOM kills (``memory``) and refused forks (``pids``): None for a limit
    the container does not have, whose counter says nothing."""

    memory: str | None
    pids: str | None

    def counts(self) -> dict[str, int]:
        """Hits so far, by kind; OSError once the cgroups are gone (the container stopped)."""
        found = {}
        if self.memory is not None:
            found[MEMORY] = counter_fields(read_small_file(self.memory)).get("oom_kill", 0)
        if self.pids is not None:
            found[PIDS] = counter_fields(read_small_file(self.pids)).get("max", 0)
        return found

    def hit_since(self, mark: dict[str, int]) -> str | None:
        """The kind of limit hit since ``mark`` (``counts()`` then), or None; OSError as ``counts``. Memory comes
        first: an OOM kill is the more certain harm, and a hog may also hit the pids limit while it is killed."""
        now = self.counts()
        for kind in (MEMORY, PIDS):
            if now.get(kind, 0) > mark.get(kind, 0):
                return kind
        return None


def container_counters(pid: int, *, memory: bool, pids: bool) -> ContainerCounters | str:
    """The counters of the cgroups process ``pid`` (a container's main process, on this machine) is in, for the
    limits asked for; or why they cannot be found here (another machine's engine, a /proc or cgroup mount
    this process cannot read), for the caller's fallback."""
    try:
        with open(f"/proc/{pid}/cgroup") as handle:
            lines = handle.read().splitlines()
        mounts = list(cgroup_mounts())
    except OSError as error:
        return f"cannot read the cgroups of process {pid}: {error.strerror}"
    v1: dict[str, str] = {}
    unified: str | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers:
            for controller in controllers.split(","):
                v1[controller] = path
        else:
            unified = path
    v1_points = {
        controller: point
        for point, kind, options in mounts
        if kind == "cgroup"
        for controller in (MEMORY, PIDS)
        if controller in options
    }
    v2_point = next((point for point, kind, _ in mounts if kind == "cgroup2"), None)

    def counter(controller: str, v1_file: str, v2_file: str) -> str | None:
        if controller in v1 and controller in v1_points:
            path = os.path.join(v1_points[controller] + v1[controller], v1_file)
        elif unified is not None and v2_point is not None:
            path = os.path.join(v2_point + unified, v2_file)
        else:
            return None
        return path if os.path.isfile(path) else None

    found = ContainerCounters(
        memory=counter(MEMORY, _V1_MEMORY, _V2_MEMORY) if memory else None,
        pids=counter(PIDS, _PIDS, _PIDS) if pids else None,
    )
    missing = [
        kind
        for kind, wanted, path in ((MEMORY, memory, found.memory), (PIDS, pids, found.pids))
        if wanted and path is None
    ]
    if missing:
        return f"no {' or '.join(missing)} cgroup of process {pid} found under this machine's cgroup mounts"
    return found
