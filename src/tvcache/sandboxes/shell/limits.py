"""``SandboxLimits``: what one shell sandbox may use of the machine (enforced by ``cgroups``; tmpfs sizes by the
mounts), and how a hit reads in a call's output."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from .cgroups import MEMORY, PIDS, CgroupHost, host_cgroups

__all__ = ["DEFAULT_LIMITS", "SandboxLimits", "cgroup_spec"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxLimits:
    """Per-sandbox limits; None leaves one out. The defaults protect a shared training node from one rollout
    while ordinary tools (compilers, test suites, ``pip install``, a small server) still run:

    * ``pids`` 1024 processes and threads: ``make -j`` and a test runner's workers fit many times over; a fork
      bomb stops there, long before the node's pid space (thousands of sandboxes share it) runs out;
    * ``memory_bytes`` 2 GiB, swap excluded: what a compiler or a test suite needs; the files a sandbox writes
      into its tree and its tmpfs dirs are memory too (the layer store is on tmpfs) and count here;
    * ``cpus`` 1.0: one core at most; a command is one agent's tool call, and a busy loop must not take the
      cores the trainer's data loaders need (a single-threaded tool does not slow down at all);
    * ``tmpfs_bytes`` 1 GiB for the private tmpfs dirs together (``/tmp``, ``/var/tmp``, ``/run``, ``/dev/shm``:
      one file system, as they are on most machines), instead of the kernel's half of the memory: writes there
      fail with ENOSPC rather than fill the node.
    """

    pids: int | None = 1024
    memory_bytes: int | None = 2 << 30
    cpus: float | None = 1.0
    tmpfs_bytes: int | None = 1 << 30

    def __post_init__(self) -> None:
        for name in ("pids", "memory_bytes", "cpus", "tmpfs_bytes"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0 or None, got {value!r}")
        if self.cpus is not None and self.cpus < 0.01:
            raise ValueError(f"SandboxLimits.cpus must be at least 0.01 (1 % of a core), got {self.cpus!r}")

    def describe(self, kind: str) -> str:
        """How a hit of limit ``kind`` ("memory", "pids") reads in a call's output."""
        if kind == MEMORY:
            return f"the sandbox hit its memory limit of {_size(self.memory_bytes)}: a process was killed"
        if kind == PIDS:
            return f"the sandbox hit its process limit of {self.pids}"
        return f"the sandbox hit its {kind} limit"

    @property
    def enforced(self) -> bool:
        """Whether any limit needs a cgroup."""
        return self.pids is not None or self.memory_bytes is not None or self.cpus is not None


DEFAULT_LIMITS = SandboxLimits()

_warned = False


def cgroup_spec(limits: SandboxLimits | None) -> dict[str, object] | None:
    """What the zygote and the CRIU keeper make each tree's cgroup with, or None: no limits asked for, or no
    cgroups here (said once per process, in a warning)."""
    if limits is None or not limits.enforced:
        return None
    host = host_cgroups()
    if not isinstance(host, CgroupHost):
        global _warned
        if not _warned:
            _warned = True
            warnings.warn(
                f"cgroup limits are not available here: {host}; sandboxes run without pids/memory/CPU limits",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    return host.spec(pids=limits.pids, memory_bytes=limits.memory_bytes, cpus=limits.cpus)


def _size(value: int | None) -> str:
    if value is None:
        return "(none)"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift:
            number = value / (1 << shift)
            return f"{number:g} {unit}" if number == int(number) else f"{number:.1f} {unit}"
    return f"{value} bytes"
