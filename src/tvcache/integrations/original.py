"""The original TVCache release's environments under tvcache: keep your ``ToolCallEnv`` and ``ToolCall`` classes,
gain the embedded cache, ``tvcache serve``, coalescing, audits and the other integrations.

Users of the original release (``tvclient``, its ``train/integration.md``) wrote two classes:

* a ``ToolCall`` subclass: ``to_dict()`` / ``from_dict(data)`` and ``will_mutate_state()``;
* a ``ToolCallEnv`` subclass: ``__init__(env_id=None, task_name=...)`` (a new env, or a handle on an existing one),
  ``execute(tool_call)``, ``fork()``, ``stop()``, ``test()``, ``get_id()`` (``hash()``, ``get_state()``) --
  synchronous, or ``async`` as in the guide's video agent. Both kinds work here; blocking methods run in a thread.

``ToolCallEnvFactory`` makes a tvcache sandbox factory of them: a sandbox is one env; a call is
``ToolCall(<the ToolCall class's name>, to_dict())`` (keyed by its canonical JSON, so key order no longer splits
a call in two); ``will_mutate_state() == False`` makes it a read-only call, keyed by the state it reads; a snapshot
is an env frozen in the graph -- a ``fork()`` of the live env that nothing executes in again, its id written to a
small file -- and continuing from it is another ``fork()``; a snapshot the budget evicts has its env ``stop()``-ed.
``ToolCallEnvExecutor`` has the released executors' shape (the full history on every call):

    from tvcache.integrations.original import ToolCallEnvExecutor

    executor = ToolCallEnvExecutor(VideoSandboxEnv, VideoToolCall, task_id, cache="http://127.0.0.1:8765")
    result = await executor.execute(history)     # was AsyncSemanticStatefulExecutor(...).execute(history)
    verdict = await executor.test(history)       # env.test(), cached per reached state
    await executor.close()

``execute`` results are strings (the guide's contract); another value is stored, and returned, as its JSON text.
``hash()`` is not used: the release compared it with the sentinel ``"0000"`` rather than with another env's hash.
Determinism is undeclared by default, so the cache checks each tool's first hit per task (``deterministic=True``
declares what the original release assumed, ``False`` never serves a call from cache).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..calls import ToolCall, ToolSpec, canonical_json
from ..errors import InvalidInput, SandboxError
from ..protocol import Outcome, Snapshot
from ..session import Session
from .background_loop import shared_loop
from .cache_location import CacheLocation, open_cache

__all__ = ["ToolCallEnvExecutor", "ToolCallEnvFactory", "ToolCallEnvSandbox"]

TEST_KEY = "ToolCallEnv.test"


async def _call(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Await an ``async`` method; run a blocking one in a thread, so many rollouts' envs work at once."""
    if inspect.iscoroutinefunction(method):
        return await method(*args, **kwargs)
    result = await asyncio.to_thread(method, *args, **kwargs)
    if inspect.isawaitable(result):
        return await result
    return result


def _text(result: Any) -> str:
    return result if isinstance(result, str) else canonical_json(result).decode()


class ToolCallEnvSandbox:
    """One ``ToolCallEnv`` as a tvcache sandbox. ``env`` is the user's object (``executor.test`` runs its
    ``test()``)."""

    def __init__(self, factory: ToolCallEnvFactory, env: Any) -> None:
        self.factory = factory
        self.env = env
        self._stopped = False

    async def execute(self, call: ToolCall) -> Outcome:
        tool_call = self.factory.tool_call(call)
        result = await _call(self.env.execute, tool_call)
        mutates = bool(tool_call.will_mutate_state())
        # Declared read-only by its class: keyed by the state it reads, and it does not move the rollout.
        return Outcome(output=_text(result), changed_state=None if mutates else False)

    async def snapshot(self, dest: Path) -> Snapshot:
        frozen = await _call(self.env.fork)  # the fork stays frozen; the rollout goes on in its own env
        env_id = str(frozen.get_id())
        dest.write_text(json.dumps({"env_id": env_id, "task_name": self.factory.task_name}))
        return Snapshot(kind=self.factory.kind, path=str(dest), bytes=0, meta={"env_id": env_id})

    async def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            await _call(self.env.stop)


class ToolCallEnvFactory:
    """A tvcache sandbox factory over a ``ToolCallEnv`` class and its ``ToolCall`` class, for one task."""

    def __init__(
        self,
        env_class: Callable[..., Any],
        tool_call_class: Any,
        *,
        task_name: str,
        deterministic: bool | None = None,
    ) -> None:
        self.env_class = env_class
        self.tool_call_class = tool_call_class
        self.task_name = task_name
        self.tool_name = str(getattr(tool_call_class, "__name__", "ToolCall"))
        self.kind = f"toolcallenv:{getattr(env_class, '__qualname__', 'env')}"
        self._tools = {self.tool_name: ToolSpec(name=self.tool_name, deterministic=deterministic)}

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return self._tools

    def call(self, tool_call: Any) -> ToolCall:
        """The tvcache call for one of the user's tool calls."""
        data = tool_call.to_dict()
        if not isinstance(data, dict):
            raise InvalidInput(f"{type(tool_call).__name__}.to_dict() must return a dict, got {type(data).__name__}")
        return ToolCall(self.tool_name, data)

    def tool_call(self, call: ToolCall) -> Any:
        return self.tool_call_class.from_dict(dict(call.arguments))

    def _env(self, env_id: str | None = None) -> Any:
        if env_id is None:
            return self.env_class(task_name=self.task_name)
        return self.env_class(env_id=env_id, task_name=self.task_name)

    async def start(self) -> ToolCallEnvSandbox:
        return ToolCallEnvSandbox(self, await asyncio.to_thread(self._env))

    async def fork(self, snapshot: Snapshot) -> ToolCallEnvSandbox:
        try:
            env_id = json.loads(Path(snapshot.path).read_text())["env_id"]
        except (OSError, ValueError, KeyError) as error:
            raise SandboxError(f"snapshot {snapshot.path} does not name a frozen env: {error}") from error
        frozen = await asyncio.to_thread(self._env, env_id)
        return ToolCallEnvSandbox(self, await _call(frozen.fork))

    def discard(self, snapshot: Snapshot) -> None:
        """The budget evicted a frozen env: stop it (a blocking call; an ``async`` stop runs on a background loop)."""
        path = Path(snapshot.path)
        try:
            env_id = json.loads(path.read_text())["env_id"]
        except (OSError, ValueError, KeyError):
            return  # already freed
        env = self._env(env_id)
        if inspect.iscoroutinefunction(env.stop):
            shared_loop().run(env.stop())
        else:
            env.stop()
        path.unlink(missing_ok=True)


class ToolCallEnvExecutor:
    """The released executors' interface over a tvcache session: ``execute`` takes the whole history each time
    (it must extend the previous one) and returns the last call's result."""

    def __init__(
        self,
        tool_call_env_class: Callable[..., Any],
        tool_call_class: Any,
        task_id: str,
        *,
        cache: CacheLocation = None,
        token: str | None = None,
        deterministic: bool | None = None,
    ) -> None:
        self.factory = ToolCallEnvFactory(
            tool_call_env_class, tool_call_class, task_name=task_id, deterministic=deterministic
        )
        self.cache = open_cache(cache, token=token, tools=self.factory.tools.values())
        self._owns_cache = not hasattr(cache, "session")
        self.session: Session = self.cache.session(task_id, sandbox=self.factory)
        self._sent: list[ToolCall] = []

    async def _advance(self, history: Sequence[Any]) -> str | None:
        calls = [self.factory.call(tool_call) for tool_call in history]
        if calls[: len(self._sent)] != self._sent:
            raise InvalidInput(
                "the history must extend the one passed before (the executor is one rollout); "
                "start a new ToolCallEnvExecutor for a new rollout"
            )
        output = None
        for call in calls[len(self._sent) :]:
            result = await self.session.call(call.name, dict(call.arguments))
            self._sent.append(call)
            output = result.output
        return output

    async def execute(self, tool_commands: Sequence[Any]) -> str:
        """The result of the last call of ``tool_commands`` (the rollout's history so far)."""
        if not tool_commands:
            raise InvalidInput("execute() needs the history of at least one tool call")
        if len(tool_commands) == len(self._sent):
            raise InvalidInput("this history was executed already; append the next call")
        output = await self._advance(tool_commands)
        assert output is not None
        return output

    async def test(self, history: Sequence[Any]) -> Any:
        """``env.test()`` in the state ``history`` reaches, cached per state (the release's ``test``)."""
        if history:
            await self._advance(history)
        result = await self.session.test(_run_test, key=TEST_KEY)
        return result.value

    async def close(self) -> None:
        await self.session.close()
        if self._owns_cache:
            self.cache.close()


async def _run_test(sandbox: Any) -> Any:
    return await _call(sandbox.env.test)
