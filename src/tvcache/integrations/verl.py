"""veRL: a ``BaseTool`` wrapper that routes any tool's calls through tvcache, and an agent loop that opens one
tvcache session per rollout.

veRL's ``ToolAgentLoop._call_tool`` wraps *every* call in ``tool.create`` / ``tool.execute`` / ``tool.release``,
so a tool instance is not a rollout. The rollout is the agent loop's ``run``: ``TVCacheToolAgentLoop``
(registered as ``tvcache_tool_agent``; select it with the dataset's ``agent_name``) opens a rollout scope with a
stable task key — ``extra_info["tvcache_task"]`` if the dataset sets it, else a digest of the prompt and the tool
kwargs (never the per-step ``uid``, which changes every epoch) — and closes the rollout's sessions and sandboxes
when ``run`` ends. ``CachedTool`` (in the tool-config YAML) finds the session by ``agent_data.request_id``.

Parallel calls of one turn (``multi_turn.max_parallel_calls`` > 1) run concurrently in veRL; ``CachedTool``
executes them in a canonical order (by call digest) so the graph does not depend on scheduling. Responses keep
the model's order.

A miss creates the rollout's "sandbox": the inner tools, executed with an ``agent_data`` whose ``request_id`` is
the sandbox's own (``<request_id>/sandbox-<n>``), so per-rollout tool state starts fresh in each sandbox; cached
state-changing calls are replayed into it first. Results with images or video are passed through uncached.

Tool config (``actor_rollout_ref.rollout.multi_turn.tool_config_path``)::

    tools:
      - class_name: tvcache.integrations.verl.CachedTool
        config:
          type: native
          cache: http://127.0.0.1:8000      # null (in memory), a directory, a URL or a list of URLs
          read_only: false                  # true for tools that never change state
          inner: {class_name: my_tools.SearchTool, config: {type: native}}
        tool_schema: {type: function, function: {name: search, description: ..., parameters: {...}}}
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import importlib
import itertools
import json
import warnings
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..calls import ToolCall, ToolSpec, canonical_json, stable_digest
from ..errors import InvalidInput
from ..protocol import Outcome
from ..session import Session
from .cache_location import CacheLike, CacheLocation, open_cache
from .external_sandboxes import ExternalSandboxFactory, NoSnapshots
from .optional_imports import require

require("verl.tools.base_tool", "verl")

from verl.experimental.agent_loop.agent_loop import (  # type: ignore[import-not-found, unused-ignore]  # noqa: E402
    AgentLoopOutput,
    register,
)
from verl.experimental.agent_loop.tool_agent_loop import (  # type: ignore[import-not-found, unused-ignore]  # noqa: E402
    ToolAgentLoop,
)
from verl.tools.base_tool import BaseTool  # type: ignore[import-not-found, unused-ignore]  # noqa: E402
from verl.tools.schemas import (  # type: ignore[import-not-found, unused-ignore]  # noqa: E402
    OpenAIFunctionToolSchema,
    ToolResponse,
)

__all__ = ["CachedTool", "RolloutScope", "TVCacheToolAgentLoop", "rollout_scope", "task_key"]

KIND = "verl"
_TOOLS: dict[str, CachedTool] = {}  # cached tools of this process, by name
_CACHES: dict[str, CacheLike] = {}  # one cache per location, shared by the tools that name it
_ROLLOUT: contextvars.ContextVar[RolloutScope | None] = contextvars.ContextVar("tvcache_verl_rollout", default=None)
_sandbox_ids = itertools.count()


def task_key(kwargs: Mapping[str, Any]) -> str:
    """The stable task key of a rollout from ``run``'s keyword arguments (see the module docstring)."""
    extra_info = kwargs.get("extra_info") or {}
    explicit = extra_info.get("tvcache_task") if isinstance(extra_info, Mapping) else None
    if explicit:
        return str(explicit)
    prompt = {"raw_prompt": list(kwargs.get("raw_prompt") or []), "tools_kwargs": kwargs.get("tools_kwargs") or {}}
    try:
        body = canonical_json(prompt)
    except InvalidInput:
        body = json.dumps(prompt, sort_keys=True, default=str).encode()
    return "verl:" + stable_digest(body).hex()


class _ToolSandbox(NoSnapshots):
    """The inner tools of one rollout, as one tvcache sandbox."""

    def __init__(self, agent_data: Any) -> None:
        self.agent_data = copy.copy(agent_data)
        self.agent_data.request_id = f"{agent_data.request_id}/sandbox-{next(_sandbox_ids)}"

    async def execute(self, call: ToolCall) -> Outcome:
        tool = _TOOLS[call.name].inner
        arguments = call.arguments
        instance_id, _ = await tool.create(create_kwargs=arguments["create_kwargs"])
        try:
            response, reward, metrics = await tool.execute(
                instance_id, arguments["parameters"], agent_data=self.agent_data
            )
        finally:
            await tool.release(instance_id)
        multimodal = bool(response.image or response.video)
        output = {"text": response.text, "reward": reward, "metrics": metrics}
        try:
            encoded = json.dumps(output, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError):
            encoded, multimodal = json.dumps({"text": response.text, "reward": 0.0, "metrics": {}}), True
        return Outcome(output=encoded, deterministic=not multimodal)

    async def stop(self) -> None:
        """Inner instances are released after every call."""


@dataclass(kw_only=True)
class RolloutScope:
    """One rollout: its task key, its sessions (by ``request_id``) and the canonical order of a turn's calls."""

    task_id: str
    max_parallel: int = 1
    sessions: dict[str, Session] = field(default_factory=dict)
    _turn: int | None = None
    _order: list[bytes] = field(default_factory=list)
    _claimed: set[int] = field(default_factory=set)
    _done: int = 0
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def session(self, cache: CacheLike, agent_data: Any) -> Session:
        request_id = str(agent_data.request_id)
        session = self.sessions.get(request_id)
        if session is None:
            factory = ExternalSandboxFactory(
                kind=KIND,
                tools={name: tool.spec for name, tool in _TOOLS.items()},
                start=lambda: _start(agent_data),
            )
            session = self.sessions[request_id] = cache.session(self.task_id, sandbox=factory)
        return session

    @contextlib.asynccontextmanager
    async def in_order(self, agent_data: Any, digest: bytes) -> AsyncIterator[None]:
        """Hold a call of the current turn until every call before it in canonical order has run."""
        calls = getattr(agent_data, "tool_calls", None) or []
        order = sorted(_digests(list(calls)[: self.max_parallel], agent_data))
        if id(calls) != self._turn or order != self._order or self._done >= len(self._order):  # a new turn
            self._turn, self._order, self._claimed, self._done = id(calls), order, set(), 0
        positions = [i for i, d in enumerate(self._order) if d == digest and i not in self._claimed]
        if not positions:  # not part of this turn's batch as veRL parsed it: no ordering to keep
            yield
            return
        position = positions[0]
        self._claimed.add(position)
        async with self._changed:
            await self._changed.wait_for(lambda: self._done >= position)
        try:
            yield
        finally:
            async with self._changed:
                self._done += 1
                self._changed.notify_all()

    async def close(self) -> None:
        sessions, self.sessions = list(self.sessions.values()), {}
        for session in sessions:
            await session.close()


async def _start(agent_data: Any) -> _ToolSandbox:
    return _ToolSandbox(agent_data)


def _call_arguments(parameters: Mapping[str, Any], create_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {"parameters": dict(parameters), "create_kwargs": dict(create_kwargs)}


def _digests(calls: list[Any], agent_data: Any) -> list[bytes]:
    digests = []
    for call in calls:
        if call.name not in _TOOLS:
            continue
        try:
            parameters = json.loads(call.arguments)
            create_kwargs = (agent_data.tools_kwargs or {}).get(call.name, {}).get("create_kwargs", {})
            digests.append(ToolCall(call.name, _call_arguments(parameters, create_kwargs)).digest)
        except (ValueError, TypeError, AttributeError, InvalidInput):
            continue  # veRL answers these itself without calling the tool
    return digests


@contextlib.asynccontextmanager
async def rollout_scope(task_id: str, *, max_parallel: int = 1) -> AsyncIterator[RolloutScope]:
    """The rollout scope ``TVCacheToolAgentLoop.run`` opens; its sessions close when it exits."""
    scope = RolloutScope(task_id=task_id, max_parallel=max_parallel)
    token = _ROLLOUT.set(scope)
    try:
        yield scope
    finally:
        _ROLLOUT.reset(token)
        await scope.close()


class CachedTool(BaseTool):  # type: ignore[misc]
    """A ``BaseTool`` whose executions go through tvcache; ``config["inner"]`` names the real tool."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema) -> None:
        inner = config.get("inner")
        if not isinstance(inner, Mapping) or "class_name" not in inner:
            raise InvalidInput(
                "CachedTool needs config.inner = {class_name: ..., config: {...}} naming the tool to cache"
            )
        module, _, name = str(inner["class_name"]).rpartition(".")
        inner_class = getattr(importlib.import_module(module), name)
        self.inner: BaseTool = inner_class(
            config=dict(inner.get("config") or {"type": "native"}), tool_schema=tool_schema
        )
        super().__init__(config, self.inner.tool_schema)
        location: CacheLocation = config.get("cache")
        # The checks are settings of the cache these tools share: config.audit_rate (fraction of hits re-executed
        # in a fresh sandbox) and config.verify_undeclared (first-hit check of tools without config.deterministic).
        audit_rate = float(config.get("audit_rate", 0.0))
        verify_undeclared = bool(config.get("verify_undeclared", True))
        key = json.dumps([location, audit_rate, verify_undeclared], sort_keys=True, default=str)
        if key not in _CACHES:
            _CACHES[key] = open_cache(
                location, token=config.get("token"), audit_rate=audit_rate, verify_undeclared=verify_undeclared
            )
        self.cache = _CACHES[key]
        deterministic = config.get("deterministic")  # absent: not declared, so checked at its first hits
        if deterministic is not None and not isinstance(deterministic, bool):
            raise InvalidInput(f"CachedTool config.deterministic must be true, false or absent, got {deterministic!r}")
        self.spec = ToolSpec(
            name=self.name, read_only=bool(config.get("read_only", False)), deterministic=deterministic
        )
        self._create_kwargs: dict[str, dict[str, Any]] = {}
        _TOOLS[self.name] = self

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        created, response = await super().create(instance_id)
        self._create_kwargs[str(created)] = dict(kwargs.get("create_kwargs") or {})
        return str(created), response

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        agent_data = kwargs.get("agent_data")
        scope = _ROLLOUT.get()
        create_kwargs = self._create_kwargs.get(instance_id, {})
        if scope is None or agent_data is None:
            warnings.warn(
                f"CachedTool {self.name!r} runs uncached: select the agent loop 'tvcache_tool_agent' "
                "(TVCacheToolAgentLoop) so rollouts have a task key and a session",
                RuntimeWarning,
                stacklevel=2,
            )
            inner_id, _ = await self.inner.create(create_kwargs=create_kwargs)
            try:
                result: tuple[ToolResponse, float, dict[str, Any]] = await self.inner.execute(
                    inner_id, parameters, **kwargs
                )
                return result
            finally:
                await self.inner.release(inner_id)
        arguments = _call_arguments(parameters, create_kwargs)
        session = scope.session(self.cache, agent_data)
        async with scope.in_order(agent_data, ToolCall(self.name, arguments).digest):
            result_ = await session.call(self.name, arguments)
        data = json.loads(result_.output)
        return ToolResponse(text=data["text"]), float(data["reward"]), dict(data["metrics"])

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        inner_id, _ = await self.inner.create(create_kwargs=self._create_kwargs.get(instance_id, {}))
        try:
            reward: float = await self.inner.calc_reward(inner_id, **kwargs)
            return reward
        finally:
            await self.inner.release(inner_id)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._create_kwargs.pop(instance_id, None)


@register("tvcache_tool_agent")
class TVCacheToolAgentLoop(ToolAgentLoop):  # type: ignore[misc]
    """``ToolAgentLoop`` with one tvcache rollout scope per ``run``: stable task key, sessions closed at the end."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        async with rollout_scope(task_key(kwargs), max_parallel=self.max_parallel_calls):
            output: AgentLoopOutput = await super().run(sampling_params, **kwargs)
            return output
