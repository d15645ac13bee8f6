"""tvcache: a stateful tool-value cache for post-training tool-using LLM agents.

    from tvcache import Cache
    from tvcache.sandboxes import SQLiteSandbox

    cache = Cache("cache-dir")                      # durable; Cache() keeps everything in memory
    db = SQLiteSandbox.factory("app.sqlite")
    async with cache.session("task-1", sandbox=db) as s:
        result = await s.call("sql", {"query": "SELECT 1"})

A hit returns exactly what executing the call after the same history would return; see README.md.
"""

from typing import TYPE_CHECKING

from .cache import Cache, NondeterminismWarning
from .calls import ToolCall, ToolSpec, canonical_json, stable_digest
from .errors import (
    ClaimLost,
    CriuError,
    InvalidInput,
    InvalidTaskId,
    InvalidToolCall,
    JournalError,
    NotFound,
    ReplayError,
    ReplicaDropped,
    SandboxError,
    ServerBusy,
    ServerError,
    SessionClosed,
    SnapshotDeclined,
    SnapshotUnusable,
    TVCacheError,
    UnknownTool,
)
from .graph import Lease, MatchResult, Node, ToolCallGraph
from .journal import JournalWarning
from .policies import AlwaysSnapshot, Budget, CostAwareSnapshots, CostModel, LowReuseFirst, NeverSnapshot
from .protocol import Outcome, Sandbox, SandboxFactory, Snapshot
from .results import AuditFinding, CacheStats, NondeterminismMark, ToolResult
from .session import Session, SessionStats, SyncSession, TestResult
from .snapshots import BlobStore, DirectoryStore

if TYPE_CHECKING:
    from .client import RemoteCache, ShardedCache
    from .sandboxes.published import PublishedSnapshots

__version__ = "0.1.0"

_LAZY = {
    "RemoteCache": "tvcache.client",
    "ShardedCache": "tvcache.client",
    "PublishedSnapshots": "tvcache.sandboxes.published",
}


def __getattr__(name: str) -> object:
    """Imported on first use: ``RemoteCache`` and ``ShardedCache`` need the ``server`` extra, and
    ``PublishedSnapshots`` the sandbox backends (the core imports none)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tvcache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AlwaysSnapshot",
    "AuditFinding",
    "BlobStore",
    "Budget",
    "Cache",
    "CacheStats",
    "ClaimLost",
    "CostAwareSnapshots",
    "CostModel",
    "CriuError",
    "DirectoryStore",
    "InvalidInput",
    "InvalidTaskId",
    "InvalidToolCall",
    "JournalError",
    "JournalWarning",
    "Lease",
    "LowReuseFirst",
    "MatchResult",
    "NeverSnapshot",
    "Node",
    "NondeterminismMark",
    "NondeterminismWarning",
    "NotFound",
    "Outcome",
    "PublishedSnapshots",
    "RemoteCache",
    "ReplayError",
    "ReplicaDropped",
    "Sandbox",
    "SandboxError",
    "SandboxFactory",
    "ServerBusy",
    "ServerError",
    "Session",
    "SessionClosed",
    "SessionStats",
    "ShardedCache",
    "Snapshot",
    "SnapshotDeclined",
    "SnapshotUnusable",
    "SyncSession",
    "TVCacheError",
    "TestResult",
    "ToolCall",
    "ToolCallGraph",
    "ToolResult",
    "ToolSpec",
    "UnknownTool",
    "__version__",
    "canonical_json",
    "stable_digest",
]
