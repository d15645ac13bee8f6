"""verifiers v0 (``verifiers.legacy``, used as ``vf.*``): a ``StatefulToolEnv`` whose per-rollout sandbox is a
tvcache session. See ``tvcache.integrations.verifiers`` for what is cached and how tasks are keyed.

No ``from __future__ import annotations`` here: verifiers builds each tool's JSON schema from its signature's
annotations (openai-agents' ``function_schema``), which must therefore be real types, not strings.
"""

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..calls import stable_digest
from ..protocol import SandboxFactory
from ..results import ToolResult
from ..session import Session, TestResult
from ._harness import shared_cache
from .cache_location import CacheLike, CacheLocation
from .optional_imports import require

legacy: Any = require("verifiers.legacy", "verifiers-v0")

__all__ = ["SANDBOX_ARG", "RolloutSandbox", "TVCacheSandboxEnv", "TVCacheSandboxMixin", "row_task_id"]

SANDBOX_ARG = "sandbox"
"""The hidden argument of sandbox tools: removed from the schema the model sees, injected by
``update_tool_args``."""
STATE_KEY = "tvcache_sandbox"
"""Where the rollout's ``RolloutSandbox`` lives in the verifiers ``State`` (for rewards and ``post_rollout``)."""
NO_OUTPUT = "(no output)"  # what the bash tool answers for a silent command, as verifiers' SandboxEnv does

SandboxChoice = SandboxFactory | Callable[[Any], SandboxFactory]


class RolloutSandbox:
    """One rollout's sandbox, as its tools see it: every operation is a call through the rollout's tvcache
    session, so it is answered from the task's tool call graph when the same history ran before."""

    def __init__(self, session: Session, *, timeout: float | None = None) -> None:
        self.session = session
        self.timeout = timeout

    async def bash(self, command: str, *, timeout: float | None = None) -> str:
        """The output of ``command`` (stdout and stderr as the backend combines them; a non-zero exit code is
        appended by the backend), exactly what running it after this rollout's history prints."""
        arguments: dict[str, Any] = {"cmd": command}
        limit = timeout if timeout is not None else self.timeout
        if limit is not None:
            arguments["timeout"] = limit  # part of the key: a limit can change what a command prints
        return (await self.session.call("sh", arguments)).output

    async def call(self, tool: str, arguments: Mapping[str, Any] | None = None) -> ToolResult:
        """Any tool of the backend (``sql`` of a SQLite sandbox, a ``FolderTool``), through the cache."""
        return await self.session.call(tool, dict(arguments or {}))

    async def test(self, fn: Callable[[Any], Any], *, key: str | None = None, mutates: bool = True) -> TestResult:
        """An end-of-rollout check on the sandbox, cached per state (see ``tvcache.Session.test``)."""
        return await self.session.test(fn, key=key, mutates=mutates)


def row_task_id(env_name: str, state: Mapping[str, Any]) -> str:
    """The default task of a rollout: its dataset row, named by the row's ``example_id`` and a digest of what
    the model is given (prompt, info, answer), so a row that changes never reuses another row's graph."""
    row = state.get("input") or {}
    shown = {key: row.get(key) for key in ("prompt", "info", "answer", "task")}
    digest = stable_digest(json.dumps(shown, sort_keys=True, default=str).encode()).hex()[:16]
    return f"verifiers:{env_name}:{row.get('example_id', state.get('example_id'))}:{digest}"


def _tool_name(tool: Callable[..., Any]) -> str:
    return getattr(tool, "__name__", type(tool).__name__)


class TVCacheSandboxMixin:
    """The tvcache half of a sandbox environment, for a ``vf.StatefulToolEnv`` of your own:
    ``class MyEnv(TVCacheSandboxMixin, vf.StatefulToolEnv)``.

    ``sandbox``: the backend, a tvcache ``SandboxFactory`` (``ShellSandbox.factory(tree)``, ``persistent=True``
    for one long-lived shell per rollout, ``ImageSandboxFactory``, ``DockerSandboxFactory``, ...) or a function
    of the rollout's ``State`` returning the factory of its task (return the same factory for the same task:
    its snapshots live in it). ``cache``: one ``CacheLocation`` (None: in memory). ``sandbox_tools``: your tools
    that reach the sandbox; each takes a ``sandbox: RolloutSandbox`` parameter, hidden from the model.
    ``timeout_per_command_seconds``: the ``timeout`` passed to every bash command (the backend's own otherwise).
    """

    def __init__(
        self,
        *args: Any,
        sandbox: SandboxChoice,
        cache: CacheLocation = None,
        sandbox_tools: Sequence[Callable[..., Any]] = (),
        timeout_per_command_seconds: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.tvcache: CacheLike = shared_cache(cache)
        self._sandbox = sandbox
        self._timeout = timeout_per_command_seconds
        self._sandbox_tools: set[str] = set()
        self.add_sandbox_tool(self.bash)
        for tool in sandbox_tools:
            self.add_sandbox_tool(tool)

    def add_sandbox_tool(self, tool: Callable[..., Any]) -> None:
        """Add a tool whose ``sandbox`` parameter receives the rollout's ``RolloutSandbox``."""
        if SANDBOX_ARG not in inspect.signature(tool).parameters:
            raise TypeError(f"sandbox tool {_tool_name(tool)!r} needs a {SANDBOX_ARG!r} parameter to receive it")
        self.add_tool(tool, args_to_skip=[SANDBOX_ARG])  # type: ignore[attr-defined]
        self._sandbox_tools.add(_tool_name(tool))

    # ------------------------------------------------------------------ hooks to override

    def task_id(self, state: Any) -> str:
        """The task whose tool call graph this rollout follows: by default its dataset row (``row_task_id``), the
        same for every epoch and for the ``rollouts_per_example`` siblings of a group."""
        name = getattr(self, "env_id", "") or type(self).__name__
        return row_task_id(name, state)

    def sandbox_factory(self, state: Any) -> SandboxFactory:
        """The factory of this rollout's task (``sandbox``, or what it returns for ``state``)."""
        if isinstance(self._sandbox, SandboxFactory):
            return self._sandbox
        return self._sandbox(state)

    async def post_rollout(self, state: Any) -> None:
        """Runs before the session closes (as in verifiers' ``SandboxEnv``): compute what rewards need from the
        sandbox here, e.g. ``await state["tvcache_sandbox"].test(run_tests, key="tests")``."""

    # ------------------------------------------------------------------ the StatefulToolEnv protocol

    async def setup_state(self, state: Any, **kwargs: Any) -> Any:
        session = self.tvcache.session(self.task_id(state), sandbox=self.sandbox_factory(state))
        state[STATE_KEY] = RolloutSandbox(session, timeout=self._timeout)
        ready = await super().setup_state(state, **kwargs)  # type: ignore[misc]
        return state if ready is None else ready

    def update_tool_args(
        self, tool_name: str, tool_args: dict[str, Any], messages: Any, state: Any, **kwargs: Any
    ) -> dict[str, Any]:
        if tool_name in self._sandbox_tools:
            return {**tool_args, SANDBOX_ARG: state[STATE_KEY]}
        return tool_args

    async def bash(self, command: str, sandbox: RolloutSandbox) -> str:
        """Run a bash command in the task's sandbox and return its combined output.

        Args:
            command: the bash command to run
        """
        return await sandbox.bash(command) or NO_OUTPUT

    @legacy.cleanup  # type: ignore[misc]  # verifiers' decorators are untyped here
    async def close_tvcache_session(self, state: Any) -> None:
        try:
            await self.post_rollout(state)
        finally:
            sandbox = state.get(STATE_KEY)
            if isinstance(sandbox, RolloutSandbox):
                await sandbox.session.close()


class TVCacheSandboxEnv(TVCacheSandboxMixin, legacy.StatefulToolEnv):  # type: ignore[misc]
    """A ``vf.StatefulToolEnv`` shaped like verifiers' ``SandboxEnv`` (a ``bash`` tool, one sandbox per rollout,
    ``post_rollout`` before it goes), whose sandbox is a tvcache session over any tvcache backend. Takes the
    mixin's arguments (``sandbox``, ``cache``, ``sandbox_tools``, ``timeout_per_command_seconds``) and
    ``StatefulToolEnv``'s (``dataset``, ``rubric``, ``tools``, ``max_turns``, ...)."""
