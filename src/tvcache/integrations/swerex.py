"""SWE-ReX: a runtime (and a deployment) whose bash sessions and commands are served from a tvcache graph, one graph
per task.

SWE-agent talks to its sandbox through a SWE-ReX runtime: ``create_session`` starts a persistent bash,
``run_in_session(BashAction)`` types a command into it (the working directory, variables and background jobs
carry over), plus one-shot ``execute``, ``read_file``, ``write_file`` and ``upload``. ``CachingDeployment`` wraps
the deployment you use today (``DockerDeployment``, ``ModalDeployment``, ``LocalDeployment``...): its runtime
answers from the cache and starts the real deployment only on the first miss. A persistent shell's state is the
whole history of the calls made in it, so a call is keyed by everything before it; on a miss after hits a fresh
deployment is started and the cached calls of the path (session creation included) replayed into it, each result
checked, so the deployment must start in the task's initial state (a container from an image does).

    from swerex.deployment.docker import DockerDeployment
    from tvcache.integrations.swerex import CachingDeployment

    deployment = CachingDeployment(lambda: DockerDeployment(image=image), cache="/data/tvcache", task_id=instance)
    await deployment.start()                      # starts nothing real yet
    runtime = deployment.runtime                  # create_session / run_in_session / close_session as usual

Answers are the runtime's own response models, rebuilt from their JSON; an answer that was an exception
(``NonZeroExitCodeError`` for ``check="raise"``, a missing session) is cached when it can be rebuilt exactly and
raised again on a hit. A request that timed out (``TimeoutError``, or pexpect's ``TIMEOUT`` from a session start
past its ``startup_timeout``) is never cached. A shell command is not known deterministic, so the first hit of
each tool per task is checked by executing it once more unless ``deterministic=True``. Keep the
check on unless you accept one recorded answer for all: SWE-ReX's own ``BashSession`` output varies from run to
run in blank lines and in whether bash's startup prompt appears (pexpect timing), so the check may find a
``run_in_session`` call non-deterministic in a task, which then runs uncached there.
Interrupts and interactive commands (timing-dependent), and requests with fields the adapter does not know,
pass through to the real runtime uncached (``pass_throughs`` counts them; each kind is logged once).

The ``deployment`` argument picks the sandbox flavour. A function returning a SWE-ReX deployment: replay, as
above. A persistent shell factory, ``ShellSandbox.factory(tree, persistent=True)`` (or ``rootfs=True`` over an
unpacked image): the runtime is a ``ShellRuntime`` on tvcache's own confined shells, with no SWE-ReX runtime at
all, whose snapshots carry the shell's state (working directory, variables, functions, aliases, options), so a
divergent rollout forks the snapshot nearest its divergence instead of replaying its whole prefix::

    shell = ShellSandbox.factory(checkout, persistent=True)     # one per process; its layers hold the snapshots
    deployment = CachingDeployment(shell, cache="/data/tvcache", task_id=instance)

How requests map onto the shell: ``_swerex_shell_sandbox``; what still differs from SWE-ReX's ``LocalRuntime``,
each with the test that pins it: docs/harnesses.md.
``ShellDeployment(shell)`` is the same runtime uncached.
"""

from __future__ import annotations

import itertools
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..calls import ToolCall, ToolSpec
from ..errors import InvalidToolCall
from ..protocol import Outcome
from ..sandboxes.shell.sandbox import ShellSandboxFactory
from ._harness import PASS_THROUGH_TOOLS, HarnessSandbox, PassThroughs, shared_cache
from ._recorded_errors import UnrecordedErrors
from ._swerex_rollout import RolloutRuntime
from ._swerex_shell_runtime import ShellDeployment, ShellRuntime
from ._swerex_shell_sandbox import rebuilt_response, response_payload, shell_tool_specs
from .cache_location import CacheLocation
from .external_sandboxes import ExternalSandboxFactory
from .optional_imports import require

__all__ = ["CachingDeployment", "CachingRuntime", "ShellDeployment", "ShellRuntime", "shell_tool_specs", "tool_specs"]

KIND = "swe-rex"
_STATEFUL = ("create_session", "run_in_session", "close_session", "execute", "write_file", "upload")
_counter = itertools.count()


def tool_specs(deterministic: bool | None = None) -> dict[str, ToolSpec]:
    """The runtime's methods as cached tools: ``read_file`` only reads; every other call may change state."""
    specs = {name: ToolSpec(name=name, deterministic=deterministic) for name in _STATEFUL}
    specs["read_file"] = ToolSpec(name="read_file", read_only=True, deterministic=deterministic)
    return {**specs, **PASS_THROUGH_TOOLS}


class CachingRuntime(RolloutRuntime):
    """A SWE-ReX runtime over one tvcache session (one rollout of one task). See the module docstring."""

    def __init__(
        self,
        deployment: Callable[[], Any],
        *,
        cache: CacheLocation,
        task_id: str,
        deterministic: bool | None = None,
        hooks: list[Any] | None = None,
    ) -> None:
        self._abstract = require("swerex.runtime.abstract", "swe-rex")
        self._deployment = deployment
        self._hooks = hooks if hooks is not None else []
        self.task_id = task_id
        self.pass_throughs = PassThroughs(KIND)
        self.deployments_started = 0
        self._uploads = Path(tempfile.mkdtemp(prefix="tvcache-swerex-uploads-"))
        self._unrecorded = UnrecordedErrors()
        factory = ExternalSandboxFactory(kind=KIND, tools=tool_specs(deterministic), start=self._start)
        self.session = shared_cache(cache).session(task_id, sandbox=factory)
        self.closed = False

    # ------------------------------------------------------- runtime API

    async def create_session(self, request: Any) -> Any:
        return await self._request("create_session", request, self._abstract.CreateBashSessionRequest)

    async def run_in_session(self, action: Any) -> Any:
        if not isinstance(action, self._abstract.BashAction):
            why = "interrupts depend on timing"
            return await self._pass(type(action).__name__, why, lambda real: real.run_in_session(action))
        if action.is_interactive_command or action.is_interactive_quit:
            why = "interactive commands wait for output patterns, which depends on timing"
            return await self._pass("interactive BashAction", why, lambda real: real.run_in_session(action))
        return await self._request("run_in_session", action, self._abstract.BashAction)

    async def close_session(self, request: Any) -> Any:
        return await self._request("close_session", request, self._abstract.CloseBashSessionRequest)

    async def execute(self, command: Any) -> Any:
        return await self._request("execute", command, self._abstract.Command)

    async def read_file(self, request: Any) -> Any:
        return await self._request("read_file", request, self._abstract.ReadFileRequest)

    async def write_file(self, request: Any) -> Any:
        return await self._request("write_file", request, self._abstract.WriteFileRequest)

    async def upload(self, request: Any) -> Any:
        """Keyed by the content of what is uploaded (a file or a tree), never by the local path."""
        if type(request) is not self._abstract.UploadRequest:
            why = f"{type(request).__name__} is not the UploadRequest this adapter keys"
            return await self._pass(type(request).__name__, why, lambda real: real.upload(request))
        return await self._call("upload", self._upload_arguments(request))

    # ---------------------------------------------------------- internals

    async def _stop(self) -> None:
        """Close the session, which stops the real deployment if one was started."""
        await self.session.close()

    async def _request(self, tool: str, request: Any, expected: Any) -> Any:
        if type(request) is not expected:  # a subclass or another model may carry fields we cannot key
            why = f"{type(request).__name__} is not the {expected.__name__} this adapter keys"
            return await self._pass(type(request).__name__, why, lambda real: getattr(real, tool)(request))
        try:
            arguments = request.model_dump(mode="json")
            ToolCall(tool, arguments)
        except (InvalidToolCall, ValueError) as error:
            return await self._pass(tool, str(error), lambda real: getattr(real, tool)(request))
        return await self._call(tool, arguments)

    async def _call(self, tool: str, arguments: dict[str, Any]) -> Any:
        result = await self.session.call(tool, arguments)
        payload = json.loads(result.output)
        self._unrecorded.raise_any(payload)
        return rebuilt_response(payload)

    async def _pass(self, kind: str, why: str, operation: Callable[[Any], Any]) -> Any:
        """Run ``operation(real_runtime)`` uncached (the sandbox holds the real deployment)."""
        return await self.pass_throughs.run(self.session, kind, why, lambda deployment: operation(deployment.runtime))

    async def _start(self) -> HarnessSandbox:
        deployment = self._deployment()
        for hook in self._hooks:
            deployment.add_hook(hook)
        await deployment.start()
        self.deployments_started += 1
        return HarnessSandbox(deployment, self._run, _stop, self.pass_throughs)

    async def _run(self, deployment: Any, call: ToolCall) -> Outcome:
        runtime = deployment.runtime
        arguments = call.arguments
        if call.name == "upload":
            source = self._uploads / arguments["digest"] / arguments["name"]
            request: Any = self._abstract.UploadRequest(source_path=str(source), target_path=arguments["target_path"])
        else:
            request = _REQUESTS[call.name](self._abstract).model_validate(arguments)
        try:
            response = await getattr(runtime, call.name)(request)
        except Exception as error:
            return self._unrecorded.outcome(error, timeouts=_timeouts())  # how far it got depends on timing
        return Outcome(output=json.dumps(response_payload(response)))

    def __repr__(self) -> str:
        return f"CachingRuntime(task_id={self.task_id!r})"


_REQUESTS: dict[str, Callable[[Any], Any]] = {
    "create_session": lambda m: m.CreateBashSessionRequest,
    "run_in_session": lambda m: m.BashAction,
    "close_session": lambda m: m.CloseBashSessionRequest,
    "execute": lambda m: m.Command,
    "read_file": lambda m: m.ReadFileRequest,
    "write_file": lambda m: m.WriteFileRequest,
}


def _timeouts() -> tuple[type[BaseException], ...]:
    """The exceptions that say a request ran out of time: ``TimeoutError`` (SWE-ReX's ``CommandTimeoutError`` is
    one) and pexpect's ``TIMEOUT``, which a ``LocalRuntime`` raises when a session's start outlasts its
    ``startup_timeout`` (and a remote runtime raises again, rebuilt from its class path)."""
    return (TimeoutError, require("pexpect", "swe-rex").TIMEOUT)


async def _stop(deployment: Any) -> None:
    await deployment.stop()


class CachingDeployment:
    """A SWE-ReX deployment whose runtime answers from the cache. ``deployment``: a callable returning a new,
    unstarted deployment of the task (replay flavour: a ``CachingRuntime``), or a persistent shell factory
    (``ShellSandbox.factory(tree, persistent=True)``: a ``ShellRuntime`` whose snapshots carry the shell's
    state). ``start`` starts nothing real."""

    def __init__(
        self,
        deployment: Callable[[], Any] | ShellSandboxFactory,
        *,
        cache: CacheLocation,
        task_id: str,
        deterministic: bool | None = None,
    ) -> None:
        require("swerex.deployment.abstract", "swe-rex")
        if isinstance(deployment, ShellSandboxFactory) and not deployment.persistent:
            raise InvalidToolCall(
                "a SWE-ReX session keeps one shell: pass ShellSandbox.factory(tree, persistent=True), "
                "not a one-shot shell factory"
            )
        self._deployment = deployment
        self._cache = shared_cache(cache)
        self.task_id = task_id
        self.deterministic = deterministic
        self._hooks: list[Any] = []
        self._runtime: CachingRuntime | ShellRuntime | None = None
        self._id = next(_counter)

    def add_hook(self, hook: Any) -> None:
        self._hooks.append(hook)  # added to every real deployment this one starts (none in the shell flavour)

    async def is_alive(self, *, timeout: float | None = None) -> Any:
        if self._runtime is None:
            abstract = require("swerex.runtime.abstract", "swe-rex")
            return abstract.IsAliveResponse(is_alive=False, message="Runtime is None.")
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self, *args: Any, **kwargs: Any) -> None:
        if isinstance(self._deployment, ShellSandboxFactory):
            self._runtime = ShellRuntime(
                self._deployment, cache=self._cache, task_id=self.task_id, deterministic=self.deterministic
            )
            return
        self._runtime = CachingRuntime(
            self._deployment,
            cache=self._cache,
            task_id=self.task_id,
            deterministic=self.deterministic,
            hooks=self._hooks,
        )

    async def stop(self, *args: Any, **kwargs: Any) -> None:
        if self._runtime is not None:
            await self._runtime.close()
            self._runtime = None

    @property
    def runtime(self) -> CachingRuntime | ShellRuntime:
        if self._runtime is None:
            raise require("swerex.exceptions", "swe-rex").DeploymentNotStartedError()
        return self._runtime
