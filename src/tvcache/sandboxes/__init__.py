"""Sandbox backends. Each implements the protocol in ``tvcache.protocol``.

- ``SQLiteSandbox``: a private in-memory copy of a SQLite database, one ``sql`` tool.
- ``ShellSandbox``: a base tree seen through overlayfs layers; sub-millisecond fork and snapshot.
- ``FolderSandbox``: a private copy of a template directory, a ``sh`` tool plus Python ``FolderTool``s.
"""

from .folder import FolderSandbox, FolderSandboxFactory, FolderTool
from .shell import ShellSandbox, ShellSandboxFactory
from .sqlite import SQLiteSandbox, SQLiteSandboxFactory

__all__ = [
    "FolderSandbox",
    "FolderSandboxFactory",
    "FolderTool",
    "SQLiteSandbox",
    "SQLiteSandboxFactory",
    "ShellSandbox",
    "ShellSandboxFactory",
]
