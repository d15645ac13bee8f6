"""Sandbox backends. Each implements the protocol in ``tvcache.protocol``.

- ``SQLiteSandbox``: a private in-memory copy of a SQLite database, one ``sql`` tool.
- ``ShellSandbox``: a base tree seen through overlayfs layers; sub-millisecond fork and snapshot.
- ``DockerSandbox``: a container per sandbox, snapshots by ``docker commit`` (and CRIU checkpoints).
- ``WarmPool``: wraps any factory to keep sandboxes ready ahead of demand.
- ``FolderSandbox``: a private copy of a template directory, a ``sh`` tool plus Python ``FolderTool``s.
"""

from .docker import DockerSandbox, DockerSandboxFactory
from .folder import FolderSandbox, FolderSandboxFactory, FolderTool
from .pool import PoolStats, WarmPool
from .shell.limits import SandboxLimits
from .shell.sandbox import ShellSandbox, ShellSandboxFactory
from .sqlite import SQLiteSandbox, SQLiteSandboxFactory

__all__ = [
    "DockerSandbox",
    "DockerSandboxFactory",
    "FolderSandbox",
    "FolderSandboxFactory",
    "FolderTool",
    "PoolStats",
    "SQLiteSandbox",
    "SQLiteSandboxFactory",
    "SandboxLimits",
    "ShellSandbox",
    "ShellSandboxFactory",
    "WarmPool",
]
