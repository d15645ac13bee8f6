"""Every error tvcache raises, under one base class.

    TVCacheError
    ├── InvalidInput           a bad value from the caller                                      HTTP 400
    │   ├── InvalidTaskId      a task id that is empty, too long or contains NUL
    │   ├── InvalidToolCall    arguments that are not JSON, or that do not fit the tool's spec
    │   │   └── UnknownTool    a call to a tool nobody declared
    │   └── NotFound           a task, node, claim or lease the request names does not exist    HTTP 404
    ├── SandboxError           a sandbox failed to start, fork, snapshot or execute
    │   ├── ReplayError        a sandbox failed while re-creating a cached state
    │   ├── CriuError          CRIU failed to dump or restore a process tree (its log is in the message)
    │   ├── SnapshotDeclined   a backend cannot freeze this state exactly (the cache goes on without a snapshot)
    │   └── SnapshotUnusable   no process can fork this snapshot any more (the cache forgets it everywhere)
    ├── JournalError           the durable journal cannot be opened or written                  HTTP 503
    ├── SessionClosed          a call on a session that has already ended
    ├── ServerBusy             the server holds as many claims or leases as it takes            HTTP 503
    ├── ServerError            a server refused a request or could not be reached (``status``; 0: unreachable)
    │   └── ReplicaDropped     the request's node ids belong to a replica the client dropped    HTTP 409
    └── ClaimLost              the client executing a call this session waited for failed or died

The HTTP statuses are those of the native API (``tvcache.api.errors`` holds the one table from exception to status
and error type and back, used by the server, the HTTP store and the Ray shards). A client meets a refusal of the
server as ``InvalidInput`` (400 and 422: the request cannot be accepted) or ``ServerError`` (anything else).

Each message says what went wrong and what to do about it.
"""

from __future__ import annotations


class TVCacheError(Exception):
    """Base class of every error raised by tvcache."""


class InvalidInput(TVCacheError, ValueError):
    """A value passed by the caller cannot be accepted; nothing was changed."""


class InvalidTaskId(InvalidInput):
    """A task id that cannot be used."""


class InvalidToolCall(InvalidInput):
    """A tool call whose name or arguments cannot be accepted."""


class UnknownTool(InvalidToolCall):
    """A call names a tool that is not declared by the cache or the sandbox."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = sorted(known)
        listing = ", ".join(self.known) or "(none)"
        super().__init__(f"unknown tool {name!r}; declared tools are: {listing}")


class SandboxError(TVCacheError):
    """A sandbox backend failed. The cache itself is left consistent."""


class SnapshotDeclined(SandboxError):
    """The backend cannot freeze this state so that its forks behave exactly like it. Not a failure: the cache
    takes no snapshot here, and later states are rebuilt by replay from an earlier snapshot or a fresh start."""


class SnapshotUnusable(SandboxError):
    """No process can fork this snapshot any more: its published data is gone from the store or fails its digest,
    or its record is malformed or in a format this tvcache refuses. The cache forgets the snapshot everywhere. Any
    other fork failure is taken as a fault of the process that met it (a full disk, a different base tree): that
    process leaves the snapshot alone from then on, and the others keep forking it."""


class CriuError(SandboxError):
    """CRIU could not dump or restore a sandbox's process tree; the message carries the end of CRIU's log. The
    dumped tree goes on running, and nothing of a failed restore is left running or mounted."""


class ReplayError(SandboxError):
    """A sandbox failed while replaying cached calls to reach a state."""

    def __init__(self, call: object, task_id: str, cause: BaseException) -> None:
        self.call = call
        self.task_id = task_id
        super().__init__(
            f"task {task_id!r}: replaying {call} to reach a cached state failed: {cause!r}; "
            "the cache is unchanged and the session can retry the call"
        )


class JournalError(TVCacheError):
    """The on-disk journal of a durable cache cannot be used."""


class SessionClosed(TVCacheError):
    """A call was made on a session after it was closed."""


class NotFound(InvalidInput):
    """A task, node, claim or lease the request names does not exist (HTTP 404)."""


class ServerBusy(TVCacheError):
    """The server holds as many claims or leases as it takes (HTTP 503): retry once some have ended."""


class ServerError(TVCacheError):
    """The server refused a request or could not be reached. ``status`` is the HTTP status (0: unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


class ReplicaDropped(ServerError):
    """The node ids of a request belong to a replica this client dropped (the server restarted, or sent a node
    that does not match the replica's). The store's operations catch it and go on without the server."""

    def __init__(self, message: str) -> None:
        super().__init__(409, message)


class ClaimLost(TVCacheError):
    """The client executing a call this session waited for failed or died; the session claims it again."""
