"""mini-swe-agent: an ``Environment`` whose ``execute`` calls are served from a tvcache graph, one graph per task.

mini-swe-agent runs every action as its own process (``LocalEnvironment``: ``subprocess``; ``DockerEnvironment``:
``docker exec``), so the state an action sees is the environment's files, changed only by earlier actions: a
rollout's history of actions keys its state exactly. ``CachingEnvironment`` takes the same environment config
mini-swe-agent's ``get_environment`` takes (the ``environment:`` section of a run config, with
``environment_class``) and builds the real environment only on the first miss, so a rollout whose actions all
hit starts no container at all. A miss after hits builds a fresh environment and replays the cached actions of
the path into it (each result checked), so the environment class must start in the task's initial state each
time it is built (a container from an image does; ``LocalEnvironment`` on a shared directory does not).

    from minisweagent.agents.default import DefaultAgent
    from tvcache.integrations.mini_swe_agent import CachingEnvironment

    env = CachingEnvironment({"environment_class": "docker", "image": image}, cache="/data/tvcache",
                             task_id=instance_id)
    DefaultAgent(model, env, **agent_config).run(task)
    env.close()

Keys: the action (every field but ``tool_call_id``, which names the model's call, not what runs), ``cwd`` and
``timeout``. An answer that ends the episode (the environment raising ``Submitted``) is cached and raised again
on a hit. A shell command is not known to be deterministic, so by default the first hit of each task is checked
by executing it once more (``deterministic=None``, see ``tvcache.ToolSpec``); pass ``deterministic=True`` once
your commands are known to be (that is what makes a rollout of all hits start nothing). Actions that timed out
are never cached. Actions that are not JSON, and template variables the environment cannot give without being
built, pass through to the real environment uncached (counted in ``pass_throughs``, logged once).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import itertools
import json
from collections.abc import Mapping
from typing import Any

from ..calls import ToolCall, ToolSpec
from ..errors import InvalidToolCall
from ..protocol import Outcome
from ._harness import PASS_THROUGH_TOOLS, HarnessSandbox, PassThroughs, shared_cache
from ._recorded_errors import raise_recorded, recorded_payload
from .background_loop import shared_loop
from .cache_location import CacheLocation
from .external_sandboxes import ExternalSandboxFactory
from .optional_imports import require

__all__ = ["CachingEnvironment", "execute_spec"]

KIND = "mini-swe-agent"
EXECUTE = "execute"
_TIMEOUTS = frozenset({"TimeoutExpired", "TimeoutError", "CommandTimeoutError"})
_counter = itertools.count()


def execute_spec(deterministic: bool | None = None) -> ToolSpec:
    """The spec of ``Environment.execute`` as a cached tool (state-changing: an action may write files)."""
    return ToolSpec(name=EXECUTE, deterministic=deterministic, description="mini-swe-agent Environment.execute")


class CachingEnvironment:
    """A mini-swe-agent ``Environment`` over one tvcache session (one rollout of one task). See the module
    docstring. ``environment``: the config ``minisweagent.environments.get_environment`` takes."""

    def __init__(
        self,
        environment: Mapping[str, Any],
        *,
        cache: CacheLocation,
        task_id: str,
        deterministic: bool | None = None,
        default_type: str = "local",
    ) -> None:
        environments = require("minisweagent.environments", "mini-swe-agent")
        self._spec = copy.deepcopy(dict(environment))
        self._class = environments.get_environment_class(self._spec.get("environment_class", default_type))
        self._kwargs = {key: value for key, value in self._spec.items() if key != "environment_class"}
        self._cache = shared_cache(cache)
        self.task_id = task_id
        self.pass_throughs = PassThroughs(KIND)
        self.environments_built = 0
        tools = {EXECUTE: execute_spec(deterministic), **PASS_THROUGH_TOOLS}
        factory = ExternalSandboxFactory(kind=KIND, tools=tools, start=self._start)
        self.session = self._cache.session(task_id, sandbox=factory)
        # An instance of the environment's class that is never initialised (no container, no process): it holds
        # only the config, for the two methods the agent calls before any action (they read only the config).
        self._unstarted = self._class.__new__(self._class)
        self._unstarted.config = self._build_config()
        self.config = self._unstarted.config
        self._real: Any = None
        self._id = next(_counter)

    # --------------------------------------------------------- protocol

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        key = {"action": {k: v for k, v in action.items() if k != "tool_call_id"}, "cwd": cwd, "timeout": timeout}
        try:
            ToolCall(EXECUTE, key)
        except InvalidToolCall as error:
            passed: dict[str, Any] = self._pass(
                "execute", str(error), lambda real: asyncio.to_thread(real.execute, action, cwd, timeout=timeout)
            )
            return passed
        result = shared_loop().run(self.session.call(EXECUTE, key))
        payload = json.loads(result.output)
        raise_recorded(payload, field="messages")
        output: dict[str, Any] = payload["output"]
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        variables: dict[str, Any] = self._unstarted_or_real("get_template_vars", **kwargs)
        return variables

    def serialize(self) -> dict[str, Any]:
        serialized: dict[str, Any] = self._unstarted_or_real("serialize")
        return serialized

    def close(self) -> None:
        """End the rollout: stop the real environment if one was built. Idempotent."""
        shared_loop().run(self.session.close())

    # -------------------------------------------------------- internals

    def _build_config(self) -> Any:
        """The config the class's ``__init__`` would build, when that ``__init__`` is one of mini-swe-agent's
        own (they set ``self.config = config_class(**kwargs)`` and start the environment, nothing else); None for
        any other ``__init__``, which may change the config: the real environment is asked instead."""
        init = getattr(self._class, "__init__", None)
        if not getattr(init, "__module__", "").startswith("minisweagent."):
            return None
        config_class = inspect.signature(self._class).parameters.get("config_class")
        if config_class is None or config_class.default is inspect.Parameter.empty:
            return None
        return config_class.default(**self._kwargs)

    def _unstarted_or_real(self, method: str, **kwargs: Any) -> Any:
        if self._unstarted.config is not None:
            try:
                return getattr(self._unstarted, method)(**kwargs)
            except AttributeError:  # it needs more than the config: ask the real environment
                self._unstarted.config = None
        return self._pass(
            method,
            f"{self._class.__name__}.{method} needs the built environment",
            lambda real: asyncio.to_thread(getattr(real, method), **kwargs),
            read_only=True,
        )

    def _pass(self, kind: str, why: str, operation: Any, *, read_only: bool = False) -> Any:
        return shared_loop().run(self.pass_throughs.run(self.session, kind, why, operation, read_only=read_only))

    async def _start(self) -> HarnessSandbox:
        real = await asyncio.to_thread(self._class, **copy.deepcopy(self._kwargs))
        self.environments_built += 1
        self._real = real
        return HarnessSandbox(real, _run, _stop, self.pass_throughs)

    def __repr__(self) -> str:
        return f"CachingEnvironment({self._class.__name__}, task_id={self.task_id!r}, id={self._id})"


async def _run(real: Any, call: ToolCall) -> Outcome:
    arguments = call.arguments
    interrupt = require("minisweagent.exceptions", "mini-swe-agent").InterruptAgentFlow
    try:
        output = await asyncio.to_thread(
            real.execute, arguments["action"], arguments["cwd"], timeout=arguments["timeout"]
        )
    except interrupt as raised:  # Submitted and its kin: the answer is the exception, with its messages
        recorded = recorded_payload(type(raised), raised.messages, field="messages")
        return Outcome(output=json.dumps(recorded))  # insertion order kept: dicts come back as they were
    timed_out = output.get("extra", {}).get("exception_type") in _TIMEOUTS  # how far it got depends on timing
    text = json.dumps({"output": output})
    return Outcome(output=text, is_error=output.get("returncode") != 0, deterministic=not timed_out)


async def _stop(real: Any) -> None:
    cleanup = getattr(real, "cleanup", None)
    if cleanup is not None:
        await asyncio.to_thread(cleanup)
