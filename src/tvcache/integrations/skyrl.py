"""SkyRL-gym: tool calls of ``BaseTextEnv`` environments served from a tvcache graph per dataset instance.

SkyRL's generator makes one environment per trajectory and calls its synchronous ``step``; ``step`` parses the
model's action and reaches tools through ``BaseTextEnv._execute_tool(group, tool, tool_input)``. ``cache_env``
replaces that one method on an environment instance, so the environment's own ``step`` (parsing, rewards, turn
counting) runs unchanged and only tool executions go through the cache. The task key is the trajectory's
``TrajectoryID.instance_id`` (the dataset index, stable across epochs), never its repetition.

What is cached is the *raw* tool result: arguments that only decorate the output (text2sql's ``turns_left``,
which the observation embeds) are declared ``presentation`` arguments; the tool runs with a placeholder in their
place, the output is stored with the placeholder, and every answer (hit or miss) has the caller's real value put
back. So a query asked at turn 2 in one rollout hits at turn 4 in another, with the right reminder.

    import skyrl_gym
    from tvcache.integrations.skyrl import register_cached_env

    register_cached_env("text2sql-tvcache", base="text2sql", cache="/data/tvcache")  # or a URL, or [URLs]
    env = skyrl_gym.make("text2sql-tvcache", env_config=cfg, extras={**extras, "trajectory_id": trajectory_id})

In a SkyRL generator, pass the trajectory id through the ``_setup_env_extras`` hook (see README).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..calls import ToolCall, ToolSpec
from ..errors import InvalidInput, SandboxError, TVCacheError
from ..protocol import Outcome
from ..session import Session
from .background_loop import shared_loop
from .cache_location import CacheLike, CacheLocation, open_cache
from .external_sandboxes import ExternalSandboxFactory, NoSnapshots
from .optional_imports import require

__all__ = ["TEXT2SQL", "CachedTools", "ToolBinding", "ToolException", "cache_env", "register_cached_env", "task_key"]

KIND = "skyrl"


@dataclass(frozen=True, kw_only=True)
class ToolBinding:
    """How a tool of a SkyRL ``ToolGroup`` becomes a cached call.

    ``arguments``: names for the positional ``tool_input`` entries, in order. ``presentation``: the arguments
    that only appear in the output's text (never change the result), replaced by a placeholder when the tool
    runs. ``read_only``: the tool never changes state (text2sql rolls every query back). ``deterministic``: True
    or False declares it (see ``ToolSpec``); None (default) caches it with a first-hit check per task.
    """

    group: str
    tool: str
    arguments: Sequence[str]
    presentation: frozenset[str] = field(default_factory=frozenset)
    read_only: bool = False
    deterministic: bool | None = None

    def __post_init__(self) -> None:
        unknown = set(self.presentation) - set(self.arguments)
        if unknown:
            raise InvalidInput(f"presentation arguments {sorted(unknown)} of {self.name} are not in its arguments")

    @property
    def name(self) -> str:
        return f"{self.group}.{self.tool}"

    def spec(self) -> ToolSpec:
        return ToolSpec(name=self.name, read_only=self.read_only, deterministic=self.deterministic)


TEXT2SQL = ToolBinding(
    group="SQLCodeExecutorToolGroup",
    tool="sql",
    arguments=("db_id", "sql", "turns_left"),
    presentation=frozenset({"turns_left"}),
    read_only=True,
)
"""skyrl_gym's text2sql tool: ``sql(db_id, sql, turns_left)``; every query runs in a rolled-back transaction."""


def _placeholder(name: str) -> str:
    return f"\x00tvcache:{name}\x00"


class ToolException(Exception):
    """A tool raised during execution; re-raised from the cache with the same message, so the environment's
    ``step`` turns it into the same observation as when the tool ran."""


def task_key(trajectory_id: Any) -> str:
    """The task key of a trajectory: ``TrajectoryID.instance_id`` (or a mapping's ``"instance_id"``)."""
    instance = trajectory_id.get("instance_id") if isinstance(trajectory_id, Mapping) else None
    if instance is None:
        instance = getattr(trajectory_id, "instance_id", None)
    if instance is None or isinstance(trajectory_id, str):
        raise InvalidInput(
            f"expected a SkyRL TrajectoryID (with .instance_id), got {trajectory_id!r:.100}; pass the generator's "
            "trajectory_id into the env extras (see tvcache.integrations.skyrl)"
        )
    return f"skyrl:{instance}"


class _EnvSandbox(NoSnapshots):
    """Tools of one environment instance. Tools run in a worker thread (they are synchronous)."""

    def __init__(self, execute: Callable[[str, str, Any], Any], bindings: Mapping[str, ToolBinding]) -> None:
        self._execute = execute
        self._bindings = bindings

    async def execute(self, call: ToolCall) -> Outcome:
        binding = self._bindings[call.name]
        given = call.arguments
        tool_input = [_placeholder(n) if n in binding.presentation else given.get(n) for n in binding.arguments]
        try:
            output = await asyncio.to_thread(self._execute, binding.group, binding.tool, tool_input)
        except Exception as error:
            return Outcome(output=json.dumps({"exception": str(error)}), is_error=True)
        if not isinstance(output, str):
            raise SandboxError(f"{call.name} returned {type(output).__name__}, not text; it cannot be cached")
        return Outcome(output=json.dumps({"output": output}))

    async def stop(self) -> None:
        """The environment's own ``close`` releases its resources."""


class CachedTools:
    """The replacement of one environment's ``_execute_tool`` and ``close`` (installed by ``cache_env``)."""

    def __init__(
        self,
        env: Any,
        *,
        cache: CacheLike,
        task_id: str,
        bindings: Sequence[ToolBinding],
        fresh_env: Callable[[], Any] | None,
    ) -> None:
        self.env = env
        self._original_execute = env._execute_tool
        self._original_close = env.close
        self._bindings = {(b.group, b.tool): b for b in bindings}
        by_name = {b.name: b for b in bindings}
        self._fresh_env = fresh_env
        self._started = 0
        factory = ExternalSandboxFactory(
            kind=KIND, tools={name: b.spec() for name, b in by_name.items()}, start=lambda: self._start(by_name)
        )
        self.session: Session = cache.session(task_id, sandbox=factory)

    async def _start(self, bindings: Mapping[str, ToolBinding]) -> _EnvSandbox:
        """The environment itself the first time (its tools are in the initial state: nothing ran yet);
        afterwards a new environment from ``fresh_env``, or an error."""
        self._started += 1
        if self._started == 1:
            return _EnvSandbox(self._original_execute, bindings)
        if self._fresh_env is None:
            raise SandboxError(
                "this environment's tools cannot be re-created to replay or audit cached calls; "
                "pass fresh_env= to cache_env"
            )
        return _EnvSandbox(self._fresh_env()._execute_tool, bindings)

    def execute_tool(self, tool_group_name: str, tool_name: str, tool_input: Any) -> Any:
        binding = self._bindings.get((tool_group_name, tool_name))
        if binding is None:  # not declared cacheable: run it as SkyRL would (and leave the cached paths)
            return self._original_execute(tool_group_name, tool_name, tool_input)
        values = list(tool_input)
        if len(values) != len(binding.arguments):
            raise ToolException(
                f"{binding.name} got {len(values)} inputs, its ToolBinding names {len(binding.arguments)}"
            )
        named = dict(zip(binding.arguments, values, strict=True))
        key = {n: v for n, v in named.items() if n not in binding.presentation}
        try:
            result = shared_loop().run(self.session.call(binding.name, key))
        except TVCacheError as error:
            raise ToolException(f"tvcache: {error}") from error
        payload = json.loads(result.output)
        if "exception" in payload:
            raise ToolException(payload["exception"])
        output: str = payload["output"]
        for name in binding.presentation:
            output = output.replace(_placeholder(name), str(named[name]))
        return output

    def close(self) -> None:
        try:
            shared_loop().run(self.session.close())
        finally:
            self._original_close()


def cache_env(
    env: Any,
    *,
    trajectory_id: Any,
    cache: CacheLike,
    bindings: Sequence[ToolBinding] = (TEXT2SQL,),
    fresh_env: Callable[[], Any] | None = None,
) -> Any:
    """Route ``env``'s declared tools through ``cache`` (one session = this trajectory) and return ``env``.

    ``fresh_env`` builds another environment of the same task, used only when cached state-changing calls must
    be replayed (a miss after hits on a stateful tool) or audited; read-only tools never need it.
    """
    require("skyrl_gym", "skyrl")
    tools = CachedTools(env, cache=cache, task_id=task_key(trajectory_id), bindings=bindings, fresh_env=fresh_env)
    env._execute_tool = tools.execute_tool
    env.close = tools.close
    env.tvcache = tools
    return env


def register_cached_env(
    env_id: str,
    *,
    base: str,
    cache: CacheLocation,
    bindings: Sequence[ToolBinding] = (TEXT2SQL,),
    token: str | None = None,
    audit_rate: float = 0.0,
    verify_undeclared: bool = True,
) -> CacheLike:
    """Register ``env_id`` in skyrl_gym: environment ``base`` with its tools cached. The extras must carry the
    trajectory's ``trajectory_id``. Returns the opened cache (close it when training ends). ``audit_rate`` and
    ``verify_undeclared``: the cache's checks (see ``tvcache.Cache``)."""
    skyrl_gym = require("skyrl_gym", "skyrl")
    opened = open_cache(cache, token=token, audit_rate=audit_rate, verify_undeclared=verify_undeclared)

    def make(env_config: Any = None, extras: Mapping[str, Any] | None = None) -> Any:
        extras = dict(extras or {})
        if "trajectory_id" not in extras:
            raise InvalidInput(
                f"{env_id} needs extras['trajectory_id'] (SkyRL's TrajectoryID); set it in your generator's "
                "_setup_env_extras hook"
            )

        def build() -> Any:
            return skyrl_gym.make(base, env_config=env_config, extras=extras)

        return cache_env(
            build(), trajectory_id=extras["trajectory_id"], cache=opened, bindings=bindings, fresh_env=build
        )

    skyrl_gym.register(id=env_id, entry_point=make)
    return opened
