"""Every error tvcache raises, under one base class.

    TVCacheError
    ├── InvalidInput           a bad value from the caller
    │   ├── InvalidTaskId      a task id that is empty, too long or contains NUL
    │   └── InvalidToolCall    arguments that are not JSON, or that do not fit the tool's spec
    │       └── UnknownTool    a call to a tool nobody declared
    ├── SandboxError           a sandbox failed to start, fork, snapshot or execute
    │   ├── ReplayError        a sandbox failed while re-creating a cached state
    │   ├── CriuError          CRIU failed to dump or restore a process tree (its log is in the message)
    │   └── SnapshotDeclined   a backend cannot freeze this state exactly (the cache goes on without a snapshot)
    ├── JournalError           the durable journal cannot be opened or written
    └── SessionClosed          a call on a session that has already ended

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
