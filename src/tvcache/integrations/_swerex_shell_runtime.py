"""SWE-ReX's runtime and deployment API over a persistent shell sandbox: ``ShellRuntime`` turns each request
into one call of a ``SweRexShellSandbox`` (directly, or through a tvcache session) and answers with SWE-ReX's own
response models; ``ShellDeployment`` runs it uncached. How each request maps onto the shell:
``_swerex_shell_sandbox``."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from ..calls import ToolCall
from ..errors import InvalidToolCall, TVCacheError
from ..sandboxes.shell.sandbox import ShellSandboxFactory
from ._swerex_rollout import RolloutRuntime
from ._swerex_shell_sandbox import PS1, SweRexShellFactory, SweRexShellSandbox, answer
from .cache_location import CacheLike
from .optional_imports import require

__all__ = ["ShellDeployment", "ShellRuntime"]


class ShellRuntime(RolloutRuntime):
    """A SWE-ReX runtime whose bash session is a tvcache persistent shell; requests go through ``cache`` (a
    session of ``task_id``) or, without one, straight to one sandbox started on the first request."""

    def __init__(
        self,
        shell: ShellSandboxFactory,
        *,
        cache: CacheLike | None = None,
        task_id: str | None = None,
        deterministic: bool | None = None,
    ) -> None:
        self._abstract = require("swerex.runtime.abstract", "swe-rex")
        self._exceptions = require("swerex.exceptions", "swe-rex")
        self._uploads = Path(tempfile.mkdtemp(prefix="tvcache-swerex-uploads-"))
        self.factory = SweRexShellFactory(shell, uploads=self._uploads, deterministic=deterministic)
        self.task_id = task_id
        self.session = None if cache is None else cache.session(task_id or "swe-rex", sandbox=self.factory)
        self.sandbox: SweRexShellSandbox | None = None  # the uncached runtime's own
        self._open: str | None = None  # the bash session's name, while it is open
        self._ended = False  # a session was closed: this shell cannot give a fresh one
        self.closed = False

    # ------------------------------------------------------- runtime API

    async def create_session(self, request: Any) -> Any:
        self._expect(request, self._abstract.CreateBashSessionRequest)
        if request.session == self._open:
            raise self._exceptions.SessionExistsError(f"session {request.session} already exists")
        if self._open is not None or self._ended:
            why = f"session {self._open!r} is open" if self._open is not None else "its session was closed"
            raise InvalidToolCall(
                f"cannot create SWE-ReX session {request.session!r}: a persistent shell sandbox holds one bash "
                f"session, and {why}; use one deployment per session (or the replay flavour, CachingDeployment "
                "over a real deployment)"
            )
        self._open = request.session  # as SWE-ReX registers it before it starts
        return await self._send("create_session", request)

    async def run_in_session(self, action: Any) -> Any:
        interrupt = isinstance(action, self._abstract.BashInterruptAction)
        if not interrupt:
            self._expect(action, self._abstract.BashAction)
        self._require_session(action.session)
        if interrupt:  # a command never outlives its call here: nothing runs to interrupt
            return self._abstract.BashObservation(output="", exit_code=0, expect_string=PS1)
        if action.is_interactive_command or action.is_interactive_quit or action.expect:
            raise InvalidToolCall(
                "interactive commands and expect patterns wait for output as it appears, which a persistent shell "
                "sandbox does not model (the command runs to its end); use the replay flavour for them"
            )
        return await self._send("run_in_session", action)

    async def close_session(self, request: Any) -> Any:
        self._expect(request, self._abstract.CloseBashSessionRequest)
        self._require_session(request.session)
        self._open, self._ended = None, True
        return self._abstract.CloseBashSessionResponse()

    async def execute(self, command: Any) -> Any:
        self._expect(command, self._abstract.Command)
        return await self._send("execute", command)

    async def read_file(self, request: Any) -> Any:
        self._expect(request, self._abstract.ReadFileRequest)
        return await self._send("read_file", request)

    async def write_file(self, request: Any) -> Any:
        self._expect(request, self._abstract.WriteFileRequest)
        return await self._send("write_file", request)

    async def upload(self, request: Any) -> Any:
        """Keyed by the content of what is uploaded (a file or a tree), never by the local path."""
        self._expect(request, self._abstract.UploadRequest)
        return await self._call("upload", self._upload_arguments(request))

    # ---------------------------------------------------------- internals

    async def _stop(self) -> None:
        """Close the session, or stop the uncached runtime's sandbox if one was started."""
        if self.session is not None:
            await self.session.close()
        elif self.sandbox is not None:
            await self.sandbox.stop()

    def _expect(self, request: Any, expected: type) -> None:
        if type(request) is not expected:  # a subclass or another model may carry fields this runtime ignores
            raise InvalidToolCall(
                f"{type(request).__name__} is not the {expected.__name__} a persistent shell runtime understands"
            )

    def _require_session(self, name: str) -> None:
        if name != self._open:
            raise self._exceptions.SessionDoesNotExistError(f"session {name!r} does not exist")

    async def _send(self, tool: str, request: Any) -> Any:
        return await self._call(tool, request.model_dump(mode="json"))

    async def _call(self, tool: str, arguments: dict[str, Any]) -> Any:
        if self.closed:
            raise TVCacheError("this SWE-ReX runtime was closed; start a new deployment")
        if self.session is not None:
            output = (await self.session.call(tool, arguments)).output
        else:
            if self.sandbox is None:
                self.sandbox = await self.factory.start()
            output = (await self.sandbox.execute(ToolCall(tool, arguments))).output
        return answer(json.loads(output), arguments)

    def __repr__(self) -> str:
        return f"ShellRuntime(task_id={self.task_id!r}, cached={self.session is not None})"


class ShellDeployment:
    """A SWE-ReX deployment on a persistent shell sandbox of ``shell`` (uncached): no container, no server."""

    def __init__(self, shell: ShellSandboxFactory) -> None:
        require("swerex.deployment.abstract", "swe-rex")
        self.shell = shell
        self._runtime: ShellRuntime | None = None

    def add_hook(self, hook: Any) -> None:
        """Deployment hooks report container and server start-up, of which there is none here."""

    async def is_alive(self, *, timeout: float | None = None) -> Any:
        if self._runtime is None:
            abstract = require("swerex.runtime.abstract", "swe-rex")
            return abstract.IsAliveResponse(is_alive=False, message="Runtime is None.")
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self, *args: Any, **kwargs: Any) -> None:
        self._runtime = ShellRuntime(self.shell)

    async def stop(self, *args: Any, **kwargs: Any) -> None:
        if self._runtime is not None:
            await self._runtime.close()
            self._runtime = None

    @property
    def runtime(self) -> ShellRuntime:
        if self._runtime is None:
            raise require("swerex.exceptions", "swe-rex").DeploymentNotStartedError()
        return self._runtime
