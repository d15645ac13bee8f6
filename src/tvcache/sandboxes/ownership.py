"""What every backend's leftover sweep and size count share: a name that says which process made it, whether that
process is gone, and the bytes of a file tree: used by the layer stores, CRIU's scratch directories, the Docker
containers and the folder backend alike, so it belongs to none of them. Standard library only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["owner_is_gone", "process_tag", "tree_bytes"]


def process_tag(pid: int) -> str | None:
    """``pid-starttime``: unique for a process across pid reuse (None when the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return f"{pid}-{int(fields[19])}"


def owner_is_gone(name: str) -> bool:
    """Whether ``name``, which starts with the ``process_tag`` of the process that made it (``<pid>-<start>``,
    then anything after a dash), was made by a process that no longer runs: the one helper every leftover sweep
    uses (layer stores, CRIU scratch directories, Docker containers). A name with a PID but no start time (older
    versions named CRIU scratch so) counts as gone only while no process has that PID; a name that starts with
    no PID is never taken for a dead process's leftover."""
    pid, _, rest = name.partition("-")
    if not pid.isdigit():
        return False
    start = rest.split("-", 1)[0]
    tag = process_tag(int(pid))
    if not start.isdigit():
        return tag is None
    return tag != f"{pid}-{start}"


def tree_bytes(path: Path) -> int:
    """The bytes of the regular files under ``path`` (links and special files count nothing)."""
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            info = os.lstat(os.path.join(directory, name))
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    return total
