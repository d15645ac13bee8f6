"""OpenHands SDK: a workspace whose operations are served from a tvcache graph, on a persistent shell sandbox.

``CachingWorkspace`` is a ``BaseWorkspace`` (``execute_command``, ``file_upload``, ``file_download``,
``git_changes``, ``git_diff``, ``pause``, ``resume``) over one tvcache session: one rollout of one task, in a
confined, long-lived shell on an overlay of the task's tree (``ShellSandbox.factory(tree, persistent=True)``).
Rollouts of a task share its tool call graph: a repeated operation after the same history is a hit and runs
nothing, and a rollout that diverges gets its sandbox by forking the snapshot nearest its divergence (files and
processes, as the shell backend snapshots them) instead of replaying its whole prefix. A rollout whose
operations all hit starts no sandbox at all. It subclasses the SDK's ``LocalWorkspace`` only because
``Conversation`` runs a local agent loop on ``LocalWorkspace`` instances; every operation is overridden.

    from openhands.sdk import Agent, Conversation, Tool
    from tvcache.integrations.openhands import CachingWorkspace, sdk_paths
    from tvcache.sandboxes import ShellSandbox

    shell = ShellSandbox.factory(checkout, persistent=True, visible=sdk_paths())   # once per process
    workspace = CachingWorkspace(shell=shell, cache="/data/tvcache", task_id=instance_id)
    agent = Agent(llm=llm, tools=[Tool(name="WorkspaceCommandTool")])
    Conversation(agent=agent, workspace=workspace).run()
    workspace.close()

The SDK's own tools act on ``working_dir`` in this process when the conversation is local, never through the
workspace; ``WorkspaceCommandTool`` (tool ``workspace_command``) is the agent's way into it, and works the same
on a ``LocalWorkspace``, which is how an uncached reference run is made.

**Task ids** are the caller's: one per task (a SWE-bench instance id, a prompt's id), the same for every rollout
of the task and across epochs, and different whenever the tree, the factory's environment or the task changes.

**What is cached**, each operation answered as the SDK's ``LocalWorkspace`` answers it (``_openhands_sandbox``
says how; the differences are in docs/harnesses.md):

* ``execute_command``, keyed by the command, its working directory (``None``: ``working_dir``) and its timeout.
  A shell command is not known to be deterministic: by default the first hit per task is executed once more and
  compared (``deterministic=None``); declare ``deterministic=True`` once your commands are. A command that timed
  out, or whose pipes a background process held open past the timeout, is never cached.
* ``file_upload``, keyed by the destination and what lands there (the content's digest, permission bits, access
  and modification times). The uploaded bytes themselves are **not** cached: they stay in this workspace,
  for replays of its own path, and are removed by ``close``; the cache holds only their digest.
* ``file_download``, a read (it does not extend the path): the file's bytes and metadata are cached, and written
  to the local destination each time.
* ``git_changes`` and ``git_diff``: the SDK's own git code, run inside the sandbox (the factory must show this
  process's Python: ``visible=sdk_paths()``; not with ``rootfs=True``).

**Not cached**: timeouts, and anything the shell backend saw depend on timing (a background process writing
while a command ran). ``pause`` freezes the live sandbox into a snapshot and stops its shell (where the backend
declines that snapshot, the sandbox runs on, as ``LocalWorkspace``'s no-op pause would); the next operation, or
``resume``, forks it back.

Paths: a relative path in the sandbox (``cwd``, an upload's destination, a download's source) is relative to
``working_dir``; local paths (an upload's source, a download's destination) are this process's, as for
``LocalWorkspace``. ``LocalConversation`` also reads ``working_dir`` on the host (skills, ``AGENTS.md``): there
it finds the task's tree as it was, not the sandbox's files.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from pydantic import PrivateAttr

from ..errors import SandboxError, TVCacheError
from ..sandboxes.shell.sandbox import ShellSandboxFactory
from ._harness import shared_cache
from ._openhands_sandbox import WorkspaceShellFactory, WorkspaceShellSandbox, sdk_paths
from ._openhands_tool import WorkspaceCommandAction, WorkspaceCommandObservation, WorkspaceCommandTool
from ._recorded_errors import rebuilt_described
from .background_loop import shared_loop
from .cache_location import CacheLocation
from .optional_imports import require

_workspace = require("openhands.sdk.workspace", "openhands")
_git = require("openhands.sdk.git.models", "openhands")
_command = require("openhands.sdk.utils.command", "openhands")
LocalWorkspace: Any = _workspace.LocalWorkspace

__all__ = [
    "CachingWorkspace",
    "WorkspaceCommandAction",
    "WorkspaceCommandObservation",
    "WorkspaceCommandTool",
    "sdk_paths",
]


class CachingWorkspace(LocalWorkspace):  # type: ignore[misc]
    """An OpenHands workspace over one tvcache session (one rollout of one task). See the module docstring.
    ``shell``: a persistent shell factory over the task's tree, one per process (its layers hold the
    snapshots); ``working_dir``: where the agent works (default: the tree)."""

    task_id: str
    _session: Any = PrivateAttr(default=None)
    _factory: Any = PrivateAttr(default=None)
    _uploads: Any = PrivateAttr(default=None)
    _lock: Any = PrivateAttr(default=None)
    _closed: bool = PrivateAttr(default=False)

    def __init__(
        self,
        *,
        shell: ShellSandboxFactory,
        cache: CacheLocation,
        task_id: str,
        working_dir: str | Path | None = None,
        deterministic: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(shell, ShellSandboxFactory) or not shell.persistent:
            raise TVCacheError(
                "CachingWorkspace needs a persistent shell factory, ShellSandbox.factory(tree, persistent=True, "
                f"visible=sdk_paths()); got {shell!r}"
            )
        if working_dir is None:
            if shell.rootfs:
                raise TVCacheError("a workspace over a root filesystem needs working_dir (a path in the image)")
            working_dir = shell.base
        super().__init__(working_dir=working_dir, task_id=task_id, **kwargs)
        self._uploads = Path(tempfile.mkdtemp(prefix="tvcache-openhands-"))
        (self._uploads / "pauses").mkdir()
        self._factory = WorkspaceShellFactory(
            shell,
            uploads=self._uploads,
            environment=_command.sanitized_env(shell.environment),
            python=sys.executable,
            pauses=self._uploads / "pauses",
            deterministic=deterministic,
        )
        self._session = shared_cache(cache).session(task_id, sandbox=self._factory)
        self._lock = threading.Lock()  # the agent may run tools in parallel threads; a rollout's calls are a path

    @property
    def session(self) -> Any:
        """The tvcache session of this rollout (its ``stats``: hits, misses, seconds saved)."""
        return self._session

    # ---------------------------------------------------------- operations

    def execute_command(self, command: str, cwd: str | Path | None = None, timeout: float = 30.0) -> Any:
        where = self._inside(cwd if cwd is not None else self.working_dir)
        payload = self._call("execute_command", {"command": command, "cwd": where, "timeout": float(timeout)})
        return _workspace.CommandResult.model_validate(payload["result"])

    def file_upload(self, source_path: str | Path, destination_path: str | Path) -> Any:
        source, destination = Path(source_path), Path(destination_path)
        arguments: dict[str, Any] = {"destination": self._inside(destination), "name": source.name}
        try:
            data = source.read_bytes()
            status = source.stat()  # after the read, as shutil.copy2 copies the access time it then sees
        except OSError as error:  # LocalWorkspace has made the destination's parents by then: so do we
            self._call("file_upload", {**arguments, "digest": None, "mode": 0, "atime_ns": 0, "mtime_ns": 0})
            return self._file_result(False, source, destination, error=str(error))
        digest = hashlib.blake2b(data, digest_size=16).hexdigest()
        kept = self._uploads / digest
        if not kept.exists():
            kept.write_bytes(data)
        arguments |= {
            "digest": digest,
            "mode": stat.S_IMODE(status.st_mode),
            "atime_ns": status.st_atime_ns,
            "mtime_ns": status.st_mtime_ns,
        }
        payload = self._call("file_upload", arguments)
        if payload.get("error") is not None:
            return self._file_result(False, source, destination, error=payload["error"])
        return self._file_result(True, source, destination, size=payload["size"])

    def file_download(self, source_path: str | Path, destination_path: str | Path) -> Any:
        source, destination = Path(source_path), Path(destination_path)
        try:
            destination.parent.mkdir(parents=True, exist_ok=True)
            found = self._call("file_download", {"source": self._inside(source)})["file"]
            target = destination / source.name if destination.is_dir() else destination
            target.write_bytes(base64.b64decode(found["data"]))
            os.utime(target, ns=(found["atime_ns"], found["mtime_ns"]))  # as shutil.copystat: times, then mode
            os.chmod(target, found["mode"])
        except Exception as error:
            return self._file_result(False, source, destination, error=str(error))
        return self._file_result(True, source, destination, size=destination.stat().st_size)

    def git_changes(self, path: str | Path) -> list[Any]:
        payload = self._git_call("git_changes", path)
        return [_git.GitChange.model_validate(change) for change in payload["value"]]

    def git_diff(self, path: str | Path) -> Any:
        return _git.GitDiff.model_validate(self._git_call("git_diff", path)["value"])

    def pause(self) -> None:
        """Freeze the live sandbox into a snapshot and stop its shell (it runs on where that is declined)."""
        self._each_open("pause")

    def resume(self) -> None:
        """Fork a paused sandbox back now rather than at the next operation."""
        self._each_open("resume")

    def close(self) -> None:
        """End the rollout: stop the sandbox and remove the kept uploads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                shared_loop().run(self._session.close())
            finally:
                shutil.rmtree(self._uploads, ignore_errors=True)

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        try:
            super().__exit__(exc_type, exc_val, exc_tb)
        finally:
            self.close()

    # ----------------------------------------------------------- internals

    def _inside(self, path: str | Path) -> str:
        """A sandbox path: absolute as given, relative to ``working_dir`` otherwise."""
        return os.path.join(self.working_dir, os.fspath(path))

    def _call(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._closed:
                raise TVCacheError("this CachingWorkspace was closed; make a new one for the next rollout")
            result = shared_loop().run(self._session.call(tool, arguments))
        payload: dict[str, Any] = json.loads(result.output)
        if "raise" in payload:
            raise rebuilt_described(payload["raise"])
        return payload

    def _git_call(self, tool: str, path: str | Path) -> dict[str, Any]:
        shown = set(self._factory.shell.host_view().host_paths()) if not self._factory.shell.rootfs else set()
        missing = [needed for needed in sdk_paths() if not any(_within(needed, seen) for seen in shown)]
        if missing:
            raise SandboxError(
                f"{tool} runs the SDK's git code inside the sandbox, which does not see {', '.join(missing)}: make "
                "the shell factory with ShellSandbox.factory(tree, persistent=True, visible=sdk_paths()) (not with "
                "rootfs=True)"
            )
        return self._call(tool, {"working_dir": str(self.working_dir), "path": os.fspath(path)})

    def _each_open(self, operation: str) -> None:
        with self._lock:
            live: WorkspaceShellSandbox | None = self._factory.live
            if live is not None and not self._closed:
                shared_loop().run(getattr(live, operation)())

    @staticmethod
    def _file_result(
        success: bool, source: Path, destination: Path, *, size: int | None = None, error: str | None = None
    ) -> Any:
        return _workspace.FileOperationResult(
            success=success, source_path=str(source), destination_path=str(destination), file_size=size, error=error
        )


def _within(path: str, shown: str) -> bool:
    return path == shown or path.startswith(shown.rstrip("/") + "/")
